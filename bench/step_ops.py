"""Benchmark: the kernels one DeMo step launches (one `compress()` and one `apply()`), against the model's depth.

Counts the kernel-launching ATen ops (`tests/op_count.py` says what counts: views, aliases and metadata-only ops
do not) on stacks of identical transformer blocks (attention qkv and proj, MLP, two layer norms, plus the
embeddings), with the buckets every device gets by default (`BUCKET_CAP_MB`) or `--bucket-cap-mb`. Counting
runs on the CPU, and its counts are a CPU run's: the ops are the same on any device (a CUDA run adds none and
drops none). Exits 1 if the deepest stack's count exceeds the reference depth's by more than `--bound`, or the
reference depth's exceeds `--max-ops`.
Run from the repo root: `python bench/step_ops.py`; `--smoke`: small stacks, a check that the script runs.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.op_count

from demonet.optim import DeMo  # noqa: E402
from demonet.optim.buckets import BUCKET_CAP_MB  # noqa: E402
from tests.op_count import stack_model, step_ops  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class StepOps:
    """One row of the table: a stack's op counts."""

    blocks: int
    """Transformer blocks in the stack."""
    tensors: int
    """Parameter tensors."""
    buckets: int
    """DeMo's buckets for the stack."""
    compress_ops: int
    """Kernel-launching ops of one `compress()`."""
    apply_ops: int
    """Kernel-launching ops of one `apply()`."""

    @property
    def total(self) -> int:
        return self.compress_ops + self.apply_ops


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 6, 24], help="blocks of each stack")
    parser.add_argument("--reference", type=int, default=6, help="the depth the deepest is compared with")
    parser.add_argument("--d-model", type=int, default=256, help="width of the blocks")
    parser.add_argument("--base", default="sign", help="DeMo's base optimizer")
    parser.add_argument("--encoding", default="fp32", help="DeMo's value encoding")
    parser.add_argument("--bound", type=float, default=1.05, help="largest deepest / reference ratio accepted")
    parser.add_argument("--max-ops", type=int, default=400, help="most ops accepted at the reference depth")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help=f"DeMo's bucket_cap_mb (default: {BUCKET_CAP_MB:g}, every device's)")
    parser.add_argument("--smoke", action="store_true", help="depths 2, 6 and 8 of width 64: checks that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.depths, args.d_model = [2, 6, 8], 64
    if args.reference not in args.depths:
        parser.error(f"--reference {args.reference} should be one of --depths {args.depths}")
    return args


def _measure(blocks: int, args: argparse.Namespace) -> tuple[StepOps, Counter[str]]:
    model = stack_model(blocks, args.d_model)
    options = {"base": args.base, "encoding": args.encoding, "bucket_cap_mb": args.bucket_cap_mb}
    compress, apply = step_ops(model, **options)
    row = StepOps(blocks=blocks, tensors=sum(1 for _ in model.parameters()),
                  buckets=len(DeMo(model.parameters(), **options)._buckets),
                  compress_ops=compress.total(), apply_ops=apply.total())
    return row, compress + apply


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    cap = BUCKET_CAP_MB if args.bucket_cap_mb is None else args.bucket_cap_mb
    print(f"DeMo base={args.base} encoding={args.encoding}, d_model={args.d_model}, one compress + one apply; "
          f"buckets of {cap:g} MiB, counted on the CPU")
    print("| blocks | tensors | buckets | compress ops | apply ops | total |")
    print("|---|---|---|---|---|---|")
    rows: dict[int, StepOps] = {}
    ops: dict[int, Counter[str]] = {}
    for blocks in args.depths:
        row, ops[blocks] = _measure(blocks, args)
        rows[blocks] = row
        cells = (row.blocks, row.tensors, row.buckets, row.compress_ops, row.apply_ops, row.total)
        print("| " + " | ".join(map(str, cells)) + " |")
    deepest = max(args.depths)
    print(f"ops of the {deepest}-block step: " + ", ".join(f"{name} {n}" for name, n in ops[deepest].most_common(8)))
    ratio = rows[deepest].total / rows[args.reference].total
    met = ratio <= args.bound and rows[args.reference].total <= args.max_ops
    print(f"ratio {deepest} blocks / {args.reference} blocks: {ratio:.2f} (bound {args.bound:.2f}); "
          f"{rows[args.reference].total} ops at {args.reference} blocks (bound {args.max_ops}): "
          f"{'met' if met else 'NOT met'}")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
