"""Benchmark: the exact apply (`DeMo.apply`) against the float32-GEMM apply it replaced, side by side.

Prints a table; not a test. Run from the repo root: `python bench/apply_exact.py [--reps 7] [--models small]`.
For each model shape (BENCH_MODEL's 11M, GPT-2 small's 124M) and aggregate width S (coefficients per
chunk: 32 is one peer's top-32 or a coordinator's top-k aggregate, 128 a union of several peers), it
times one apply of the same aggregate by both, round-robin, and reports medians and the ratio.

The float32-GEMM apply is kept here only as the yardstick: its decode is one float32 `bmm` (or two
dense GEMMs), its update ``p.add_(u, alpha=-lr)``; both round differently on different kernels.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.optim_step import _interleaved_ms  # noqa: E402
from bench.wire_bytes import MODELS, SMALL, random_topk  # noqa: E402
from demonet.optim import Compressed, DeMo, Payload, dct_matrix  # noqa: E402
from demonet.optim.payload import num_chunks  # noqa: E402

GOAL = 1.3
"""The exact apply should cost at most this many times the float32-GEMM apply on CPU."""


@torch.no_grad()
def gemm_apply(opt: DeMo, agg: Payload) -> None:
    """The apply as it was before it was made exact (sign and sgd bases, no weight decay)."""
    for bucket in opt._buckets:
        lr = opt.param_groups[bucket.group]["lr"]
        u_BHW, t_BHW, c_BHW = opt._scratch_for(bucket)
        d_h = dct_matrix(bucket.h, u_BHW.dtype)  # cached by the basis; the cast is a copy of h*h
        d_w = dct_matrix(bucket.w, u_BHW.dtype)
        parts = [agg.tensors[s.name] for s in bucket.slots]
        width = max(c.k for c in parts)
        num_blocks, h, w = u_BHW.shape
        if h > 1 and width <= min(h, w):  # one bmm of inner size S
            idx_BS = torch.cat([c.idx for c in parts])
            val_BS = torch.cat([c.val for c in parts])
            i_BS = torch.div(idx_BS, w, rounding_mode="floor")
            rows = torch.index_select(d_h, 0, i_BS.view(-1)).view(num_blocks, width, h)
            cols = torch.index_select(d_w, 0, (idx_BS - i_BS * w).view(-1)).view(num_blocks, width, w)
            cols.mul_(val_BS.unsqueeze(-1))
            torch.bmm(rows.transpose(1, 2), cols, out=u_BHW)
        else:  # dense coefficients, two GEMMs
            coef_BN = c_BHW.view(num_blocks, h * w).zero_()
            for slot, c in zip(bucket.slots, parts, strict=True):
                coef_BN[slot.start:slot.stop].scatter_add_(1, c.idx, c.val)
            torch.mm(c_BHW.view(num_blocks * h, w), d_w, out=t_BHW.view(num_blocks * h, w))
            torch.bmm(d_h.t().expand(num_blocks, h, h), t_BHW, out=u_BHW) if h > 1 else u_BHW.copy_(t_BHW)
        if opt.options.base == "sign":
            u_BHW.sign_()
        for slot in bucket.slots:
            x2d = slot.param.view(slot.rows, slot.cols)
            grid_y, grid_x = -(-slot.rows // h), -(-slot.cols // w)
            blocks = u_BHW[slot.start:slot.stop].view(grid_y, grid_x, h, w).permute(0, 2, 1, 3)
            if (grid_y * h, grid_x * w) == (slot.rows, slot.cols):
                x2d.view(grid_y, h, grid_x, w).add_(blocks, alpha=-lr)
            else:  # a padded grid
                x2d.add_(blocks.reshape(grid_y * h, grid_x * w)[:slot.rows, :slot.cols], alpha=-lr)


def aggregate_of(opt: DeMo, width: int, gen: torch.Generator) -> Payload:
    """A synthetic aggregate: `width` distinct coefficients per chunk (fewer if the chunk is smaller)."""
    tensors = {}
    for name, (shape, chunk) in opt.param_specs().items():
        rows, n = num_chunks(shape, chunk), chunk[0] * chunk[1]
        k = min(width, n)
        tensors[name] = Compressed(idx=random_topk(rows, n, k, gen), val=torch.randn(rows, k, generator=gen) * 1e-4,
                                   shape=shape, chunk=chunk)
    return Payload(tensors=tensors)


def _time_both(opt: DeMo, agg: Payload, args: argparse.Namespace) -> tuple[float, float]:
    """Median ms of the float32-GEMM apply and of the exact apply of `agg`, timed round-robin."""
    samples = _interleaved_ms({"gemm": lambda: gemm_apply(opt, agg), "exact": lambda: opt.apply(agg)},
                              args.reps, args.warmup, torch.device("cpu"))
    return statistics.median(samples["gemm"]), statistics.median(samples["exact"])


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions (median reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--models", choices=("small", "all"), default="all")
    parser.add_argument("--bases", nargs="+", default=["sign", "sgd"], choices=["sign", "sgd"])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"device=cpu threads={torch.get_num_threads()} capability={torch.backends.cpu.get_cpu_capability()} "
          f"reps={args.reps} (medians, run round-robin)")
    print(f"{'model':<36}{'base':<6}{'S':>5}{'fp32-GEMM ms':>14}{'exact ms':>10}{'ratio':>8}")
    ratios = []
    for model, shapes in MODELS.items():
        if args.models == "small" and model != SMALL:
            continue
        params = [(name, torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02))
                  for name, shape in shapes.items()]
        for base in args.bases:
            opt = DeMo(params, lr=1e-3, base=base, chunk_policy="pad")
            for width in args.widths:
                gemm, exact = _time_both(opt, aggregate_of(opt, width, gen), args)
                ratios.append(exact / gemm)
                print(f"{model:<36}{base:<6}{width:>5}{gemm:>14.1f}{exact:>10.1f}{exact / gemm:>7.2f}x", flush=True)
    print(f"goal: exact apply <= {GOAL}x the float32-GEMM apply: {'met' if max(ratios) <= GOAL else 'NOT met'} "
          f"(worst {max(ratios):.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
