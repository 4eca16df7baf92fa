"""Benchmark: plain against deflated values (`wire.encode(value_coding=...)`) on real DeMo payloads.

Trains the evidence model (3.24M parameters, or `--config`'s) for `--steps` steps on the embedded corpus
with DeMo in 4 replicas (seeds 0-3, each its own data stream), then for fp32 and bf16 values prints,
side by side in one run: the bytes of one peer's payload and of the coordinator's merged aggregate (bf16,
the top 32 per chunk, from the 4 payloads) with each value coding, their ratio, and the median time to
encode and to decode each. Not a test. Run from the repo root: `python bench/value_coding.py`.
`--smoke`: 2 steps and 2 reps, a check that the script runs.
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
from demonet.config import Config, load_config  # noqa: E402
from demonet.optim import DeMo, Payload  # noqa: E402
from demonet.train.data import Batches, data_seed, load_corpus  # noqa: E402
from demonet.train.model import GPT  # noqa: E402
from demonet.wire.merge import MergeRules, merge  # noqa: E402

EVIDENCE = {"model": {"vocab_size": 256, "seq_len": 64, "d_model": 256, "n_layers": 4, "n_heads": 4},
            "train": {"batch_size": 4, "seq_len": 64}}


def payloads(cfg: Config, encoding: str, steps: int, peers: int) -> list[Payload]:
    """Each replica's payload of its last step (the replicas start equal and train on their own data)."""
    out = []
    corpus = load_corpus()
    for peer in range(peers):
        torch.manual_seed(cfg.train.seed)
        model = GPT(cfg.model)
        opt = DeMo(model.named_parameters(), lr=cfg.optim.lr, encoding=encoding)
        batches = Batches(corpus, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len,
                          seed=data_seed(cfg.train.seed, f"peer-{peer}"))
        for _ in range(steps):
            x, y = next(batches)
            model(x, y)[1].backward()  # type: ignore[union-attr]
            payload = opt.compress()
            opt.apply(payload, lr=cfg.optim.lr)  # a world of one: its own update, so the momentum evolves
            opt.zero_grad()
        out.append(payload)
    return out


def timed(fn: object, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="training steps before the payloads are taken")
    parser.add_argument("--reps", type=int, default=15, help="timed encodes and decodes (median)")
    parser.add_argument("--config", help="a run config TOML (default: the evidence model)")
    parser.add_argument("--smoke", action="store_true", help="2 steps, 2 reps: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.reps = 2, 2
    torch.set_num_threads(1)
    cfg = load_config(Path(args.config), {}, {}) if args.config else Config.from_dict(EVIDENCE)
    print(f"{sum(p.numel() for p in GPT(cfg.model).parameters()) / 1e6:.2f}M parameters, {args.steps} steps, "
          f"4 replicas, 1 thread")
    print("| payload | values | plain B | deflate B | deflate / plain | encode ms plain | deflate | "
          "decode ms plain | deflate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for encoding in ("fp32", "bf16"):
        ps = payloads(cfg, encoding, args.steps, 4)
        specs = {n: (c.shape, c.chunk) for n, c in ps[0].tensors.items()}
        rules = MergeRules(topk=32, encoding="bf16", clip=True, max_norm=None)
        agg = merge(ps, step=1, rules=rules, expected=specs).payload
        rows = [(f"one peer's ({encoding} values)", ps[0])]
        rows += [("merged aggregate (bf16)", agg)] if encoding == "fp32" else []
        for what, payload in rows:
            row = {}
            for coding in wire.VALUE_CODINGS:
                data = wire.encode(payload, step=1, value_coding=coding)
                assert wire.decode(data, expected=specs)[1].tensors.keys() == payload.tensors.keys()
                row[coding] = (len(data),
                               timed(lambda p=payload, c=coding: wire.encode(p, step=1, value_coding=c), args.reps),
                               timed(lambda d=data, e=specs: wire.decode(d, expected=e), args.reps))
            (pb_, pe, pd), (db, de, dd) = row["plain"], row["deflate"]
            print(f"| {what} | {payload.encoding} | {pb_:,} | {db:,} | {db / pb_:.3f} | {pe:.2f} | {de:.2f} | "
                  f"{pd:.2f} | {dd:.2f} |")


if __name__ == "__main__":
    main()
