"""Benchmark: bytes on the wire per step for synthetic DeMo payloads, against the reference and the goals.

Prints a table; not a test. Run from the repo root: `python bench/wire_bytes.py [--reps 3] [--threads 1]`.
Payloads are synthetic (random top-k index sets per chunk, normal values ~1e-6 through `quantize`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demonet import wire  # noqa: E402
from demonet.optim.payload import ENCODINGS, Compressed, Payload, matrix_shape, quantize  # noqa: E402

CHUNK = 64
TOPK = 32
REFERENCE_BYTES_PER_ENTRY = 12  # bloc97/DeMo: int64 index + fp32 value
GOALS = {"fp16": 0.30, "sign": 0.14}  # share of the reference's bytes
GOAL_OVER_FLOOR = 1.10

Shapes = dict[str, tuple[int, ...]]


def transformer_shapes(*, vocab: int, seq: int, d_model: int, layers: int) -> Shapes:
    """Parameter shapes of a GPT-style transformer (weights (out, in), biases, LayerNorms)."""
    shapes: Shapes = {"tok_emb": (vocab, d_model), "pos_emb": (seq, d_model)}
    for i in range(layers):
        linears = {
            "qkv": (3 * d_model, d_model),
            "attn_out": (d_model, d_model),
            "mlp_up": (4 * d_model, d_model),
            "mlp_down": (d_model, 4 * d_model),
        }
        for name, (out_features, in_features) in linears.items():
            shapes[f"h{i}.{name}.weight"] = (out_features, in_features)
            shapes[f"h{i}.{name}.bias"] = (out_features,)
        for ln in ("ln1", "ln2"):
            shapes[f"h{i}.{ln}.weight"] = (d_model,)
            shapes[f"h{i}.{ln}.bias"] = (d_model,)
    shapes["ln_f.weight"] = (d_model,)
    shapes["ln_f.bias"] = (d_model,)
    return shapes


MODELS = {
    "11M (d384 L6 V256 T256)": transformer_shapes(vocab=256, seq=256, d_model=384, layers=6),
    "GPT-2 124M (d768 L12 V50257 T1024)": transformer_shapes(vocab=50257, seq=1024, d_model=768, layers=12),
}


def chunk_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """(64, 64) on a padded grid for matrices, (1, 64) for vectors."""
    return (1, CHUNK) if len(shape) < 2 else (CHUNK, CHUNK)


def random_topk(num_chunks: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(C, K) random k-subsets of range(n), made in batches to bound memory."""
    out = []
    for start in range(0, num_chunks, 2048):
        rows = min(2048, num_chunks - start)
        out.append(torch.rand(rows, n, generator=gen).topk(k, dim=1).indices)
    return torch.cat(out) if out else torch.zeros(0, k, dtype=torch.int64)


def synthetic_indices(shapes: Shapes, gen: torch.Generator) -> dict[str, torch.Tensor]:
    idx = {}
    for name, shape in shapes.items():
        h, w = chunk_of(shape)
        rows, cols = matrix_shape(shape)
        num_chunks = -(-rows // h) * -(-cols // w)
        idx[name] = random_topk(num_chunks, h * w, min(TOPK, h * w), gen)
    return idx


def make_payload(shapes: Shapes, idx: dict[str, torch.Tensor], encoding: str, gen: torch.Generator) -> Payload:
    tensors = {}
    for name, shape in shapes.items():
        idx_CK = idx[name]
        val_CK, scale = quantize(torch.randn(idx_CK.shape, generator=gen) * 1e-6, encoding)
        tensors[name] = Compressed(idx=idx_CK, val=val_CK, shape=shape, chunk=chunk_of(shape), scale=scale)
    return Payload(tensors=tensors, encoding=encoding)


def time_ms(payload: Payload, coding: str, reps: int) -> tuple[int, float, float]:
    """(bytes, median encode ms, median decode ms), decode with full validation against the model."""
    expected = {name: (c.shape, c.chunk) for name, c in payload.tensors.items()}
    enc_ms, dec_ms, data = [], [], b""
    for _ in range(reps + 1):  # one warmup
        start = time.perf_counter()
        data = wire.encode(payload, step=1, index_coding=coding)
        mid = time.perf_counter()
        wire.decode(data, expected=expected)
        enc_ms.append((mid - start) * 1e3)
        dec_ms.append((time.perf_counter() - mid) * 1e3)
    return len(data), statistics.median(enc_ms[1:]), statistics.median(dec_ms[1:])


def bench_model(title: str, shapes: Shapes, reps: int) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    idx = synthetic_indices(shapes, gen)
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    entries = sum(t.numel() for t in idx.values())
    reference = REFERENCE_BYTES_PER_ENTRY * entries
    report = wire.index_bits_report(make_payload(shapes, idx, "fp32", gen))
    print(
        f"\n## {title}: {numel / 1e6:.1f}M params, {len(shapes)} tensors, {entries:,} entries "
        f"(k={TOPK}, chunk {CHUNK}x{CHUNK} / 1x{CHUNK})"
    )
    print(f"dense fp32 gradient: {4 * numel:>12,} B")
    print(f"reference (int64 idx + fp32 val): {reference:>12,} B  = {reference / (4 * numel):.2%} of dense")
    print(
        f"index bits/index: floor {report['floor_bits_per_index']:.3f}, "
        f"packed {report['packed_bits_per_index']:.3f} ({report['packed_over_floor']:.3f}x floor), "
        f"entropy {report['entropy_bits_per_index']:.3f} ({report['entropy_over_floor']:.3f}x floor)"
    )
    print(
        f"{'values':<6} {'indices':<8} {'bytes':>11} {'vs ref':>7} {'vs dense':>8} {'B/entry':>7} "
        f"{'enc ms':>7} {'dec ms':>7}  goal"
    )
    verdicts = []
    for encoding in ENCODINGS:
        payload = make_payload(shapes, idx, encoding, gen)
        for coding in wire.INDEX_CODINGS:
            size, enc, dec = time_ms(payload, coding, reps)
            assert size == wire.payload_bytes(payload, index_coding=coding, step=1)
            ratio = size / reference
            goal = ""
            if encoding in GOALS:
                ok = ratio <= GOALS[encoding]
                goal = f"<= {GOALS[encoding]:.0%} of ref: {'PASS' if ok else 'FAIL'}"
                verdicts.append(f"{title} {encoding}/{coding}: {ratio:.1%} of reference ({goal})")
            print(
                f"{encoding:<6} {coding:<8} {size:>11,} {ratio:>7.1%} {size / (4 * numel):>8.2%} "
                f"{size / entries:>7.3f} {enc:>7.1f} {dec:>7.1f}  {goal}"
            )
    ok = report["entropy_over_floor"] <= GOAL_OVER_FLOOR
    verdicts.append(
        f"{title} entropy indices: {report['entropy_over_floor']:.3f}x the floor "
        f"(<= {GOAL_OVER_FLOOR}x: {'PASS' if ok else 'FAIL'})"
    )
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=3, help="timed encode+decode rounds (median)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# demonet wire bytes per step (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    verdicts = []
    for title, shapes in MODELS.items():
        verdicts += bench_model(title, shapes, args.reps)
    print("\n## goals")
    for line in verdicts:
        print(line)


if __name__ == "__main__":
    main()
