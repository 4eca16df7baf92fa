"""Benchmark: the cost of median-norm clipping (net.clip_to_median_norm) in the coordinator's merge.

For 2, 4 and 8 peers' payloads of BENCH_MODEL, times `aggregate(payloads, topk=k)` with and without
`clip=True`, round-robin in alternating order (so a noisy machine slows both alike), and prints the medians and their
ratio. Goal: clipping costs under 5 % of the merge. Run from the repo root:
`python bench/robust_aggregate.py`. `--smoke`: 2 and 4 peers, 2 reps: checks that it runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from demonet.optim import DeMo, Payload, aggregate
from demonet.optim.payload import Compressed
from demonet.train.model import BENCH_MODEL, GPT

GOAL_RATIO = 1.05


def _payloads(num_peers: int, topk: int) -> list[Payload]:
    torch.manual_seed(0)
    model = GPT(BENCH_MODEL)
    opt = DeMo(model.named_parameters(), lr=1e-3, compression_topk=topk)
    x = torch.randint(0, BENCH_MODEL.vocab_size, (2, 64))
    _, loss = model(x, x)
    assert loss is not None
    loss.backward()
    base = opt.compress()
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(num_peers):  # same indices, different values per peer: the merge's usual case
        out.append(Payload(tensors={n: Compressed(idx=c.idx, val=c.val * (1 + torch.rand(c.val.shape, generator=g)),
                                                  shape=c.shape, chunk=c.chunk)
                                    for n, c in base.tensors.items()}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--topk", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="2 and 4 peers, 2 reps: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.reps = 2
    torch.set_num_threads(1)
    print(f"{'peers':>5} {'merge ms':>9} {'clip+merge ms':>14} {'ratio':>6}  goal <= {GOAL_RATIO}")
    for num_peers in (2, 4) if args.smoke else (2, 4, 8):
        payloads = _payloads(num_peers, args.topk)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.reps + 2):
            for clip in ((False, True) if i % 2 else (True, False)):  # alternate which one runs first
                t = time.perf_counter()
                aggregate(payloads, topk=args.topk, clip=clip)
                if i >= 2:
                    times[clip].append((time.perf_counter() - t) * 1e3)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        ratio = on / off
        print(f"{num_peers:>5} {off:>9.2f} {on:>14.2f} {ratio:>6.3f}  {'met' if ratio <= GOAL_RATIO else 'NOT met'}")


if __name__ == "__main__":
    main()
