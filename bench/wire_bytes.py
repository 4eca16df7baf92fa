"""Benchmark: bytes on the wire and encode+decode time per step for DeMo payloads, against the goals.

Prints a table; not a test. Run from the repo root: `python bench/wire_bytes.py [--reps 15] [--threads 1]`.
Payloads are synthetic (random top-k index sets per chunk, normal values ~1e-6 through `quantize`), plus,
for the 11M model, a real one: `DeMo.compress()` of `GPT(BENCH_MODEL)`, whose `DeMo.step()` is timed in
the same run as the yardstick of the time goal. `--smoke`: the 11M model only, one rep: checks that it runs.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demonet import wire  # noqa: E402
from demonet.optim import DeMo  # noqa: E402
from demonet.optim.payload import ENCODINGS, Compressed, Payload, matrix_shape, quantize  # noqa: E402
from demonet.train.model import BENCH_MODEL, GPT  # noqa: E402

CHUNK = 64
TOPK = 32
REFERENCE_BYTES_PER_ENTRY = 12  # bloc97/DeMo: int64 index + fp32 value
GOALS = {"fp16": 0.30, "sign": 0.14}  # share of the reference's bytes
GOAL_OVER_FLOOR = 1.10
GOAL_STEP_SHARE = 0.20  # encode+decode of the 11M model's payload, as a share of its DeMo step

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


SMALL = "11M (d384 L6 V256 T256)"
MODELS = {
    SMALL: transformer_shapes(vocab=256, seq=256, d_model=384, layers=6),
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


def demo_step(reps: int = 15, warmup: int = 3) -> tuple[float, Payload]:
    """(median ms of `DeMo.step()` on GPT(BENCH_MODEL) after one forward+backward on 8x256 random bytes,
    the payload `DeMo.compress()` then returns)."""
    torch.manual_seed(0)
    model = GPT(BENCH_MODEL)
    tokens = torch.randint(0, 256, (8, BENCH_MODEL.seq_len + 1))  # 8x256 inputs, shifted by one for targets
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    assert loss is not None
    loss.backward()
    opt = DeMo(model.parameters(), lr=1e-3)
    step_ms = []
    for _ in range(warmup + reps):
        start = time.perf_counter()
        opt.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
    return statistics.median(step_ms[warmup:]), opt.compress()


def print_rows(payload: Payload, label: str, reference: int, reps: int, step_ms: float | None) -> list[str]:
    """One table row per index coding; verdicts of the byte goals and, given the step time, the time goal."""
    entries, verdicts = payload.numel(), []
    numel = sum(math.prod(c.shape) for c in payload.tensors.values())
    for coding in wire.INDEX_CODINGS:
        size, enc, dec = time_ms(payload, coding, reps)
        assert size == wire.payload_bytes(payload, index_coding=coding, step=1)
        ratio, goal = size / reference, ""
        if payload.encoding in GOALS and label == "synthetic":
            ok = ratio <= GOALS[payload.encoding]
            goal = f"<= {GOALS[payload.encoding]:.0%} of ref: {'PASS' if ok else 'FAIL'}"
            verdicts.append(f"{payload.encoding}/{coding}: {ratio:.1%} of reference ({goal})")
        share = ""
        if step_ms is not None:
            ok = enc + dec <= GOAL_STEP_SHARE * step_ms
            share = f"{(enc + dec) / step_ms:>6.1%}"
            goal = f"{goal}{'; ' if goal else ''}step share: {'PASS' if ok else 'FAIL'}"
            verdicts.append(
                f"{payload.encoding}/{coding} {label}: encode+decode {enc + dec:.1f} ms = "
                f"{(enc + dec) / step_ms:.1%} of the DeMo step (<= {GOAL_STEP_SHARE:.0%}: {'PASS' if ok else 'FAIL'})"
            )
        print(
            f"{payload.encoding:<6} {coding:<8} {label:<9} {size:>11,} {ratio:>7.1%} {size / (4 * numel):>8.2%} "
            f"{size / max(entries, 1):>7.3f} {enc:>7.2f} {dec:>7.2f} {enc + dec:>7.2f} {share:>6}  {goal}"
        )
    return verdicts


def bench_model(title: str, shapes: Shapes, reps: int, step: tuple[float, Payload] | None = None) -> list[str]:
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
    step_ms = None if step is None else step[0]
    if step is not None:
        real = step[1]
        print(
            f"DeMo step on GPT(BENCH_MODEL), 8x256 batch: {step_ms:.1f} ms (median after warm-ups); "
            f"real payload = its DeMo.compress(): {len(real.tensors)} tensors, {real.numel():,} entries"
        )
        print(f"goal: encode+decode <= {GOAL_STEP_SHARE:.0%} of the DeMo step (<= {GOAL_STEP_SHARE * step[0]:.1f} ms)")
    print(
        f"{'values':<6} {'indices':<8} {'payload':<9} {'bytes':>11} {'vs ref':>7} {'vs dense':>8} {'B/entry':>7} "
        f"{'enc ms':>7} {'dec ms':>7} {'e+d ms':>7} {'%step':>6}  goal"
    )
    verdicts = []
    for encoding in ENCODINGS:
        payload = make_payload(shapes, idx, encoding, gen)
        verdicts += print_rows(payload, "synthetic", reference, reps, step_ms)
    if step is not None:
        verdicts += print_rows(step[1], "real", REFERENCE_BYTES_PER_ENTRY * step[1].numel(), reps, step_ms)
    over = report["entropy_over_floor"]
    verdict = "PASS" if over <= GOAL_OVER_FLOOR else "FAIL"
    verdicts.append(f"entropy indices: {over:.3f}x the floor (<= {GOAL_OVER_FLOOR}x: {verdict})")
    return [f"{title} {line}" for line in verdicts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=15, help="timed encode+decode rounds (median)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--smoke", action="store_true", help="the 11M model only, one rep: checks that it runs")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.reps = 1
    print(f"# demonet wire bytes per step (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    step = demo_step(reps=1, warmup=1) if args.smoke else demo_step()
    verdicts = []
    for title, shapes in MODELS.items():
        if args.smoke and title != SMALL:
            continue
        verdicts += bench_model(title, shapes, args.reps, step if title == SMALL else None)
    print("\n## goals")
    for line in verdicts:
        print(line)


if __name__ == "__main__":
    main()
