"""Benchmark: the kernels one DeMo step launches (one `compress()` and one `apply()`), against the model's depth.

Counts the kernel-launching ATen ops (`tests/op_count.py` says what counts: views, aliases and metadata-only ops
do not) on stacks of identical transformer blocks (attention qkv and proj, MLP, two layer norms, plus the
embeddings), with the buckets an accelerator gets (`ACCELERATOR_BUCKET_CAP_MB`) and those a CPU gets
(`CPU_BUCKET_CAP_MB`). Counting runs on the CPU: the ops are the same on any device (a CUDA run adds none and
drops none). Exits 1 if, in an accelerator's buckets, the deepest stack's count exceeds the reference depth's by
more than `--bound` or the reference depth's exceeds `--max-ops`; a CPU's buckets are reported, not checked
(a CPU keeps a set of ops per cache-sized bucket: docs/optimizer.md, "Kernels a step launches").
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
from demonet.optim.buckets import ACCELERATOR_BUCKET_CAP_MB, CPU_BUCKET_CAP_MB  # noqa: E402
from tests.op_count import stack_model, step_ops  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class StepOps:
    """One row of the table: a stack's op counts."""

    blocks: int
    """Transformer blocks in the stack."""
    tensors: int
    """Parameter tensors."""
    buckets: int
    """DeMo's buckets for the stack, accelerator buckets."""
    compress_ops: int
    """Kernel-launching ops of one `compress()`, accelerator buckets."""
    apply_ops: int
    """Kernel-launching ops of one `apply()`, accelerator buckets."""
    cpu_buckets: int
    """DeMo's buckets with a CPU's cap."""
    cpu_total: int
    """compress + apply with a CPU's buckets."""

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
    parser.add_argument("--smoke", action="store_true", help="depths 2, 6 and 8 of width 64: checks that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.depths, args.d_model = [2, 6, 8], 64
    if args.reference not in args.depths:
        parser.error(f"--reference {args.reference} should be one of --depths {args.depths}")
    return args


def _measure(blocks: int, args: argparse.Namespace) -> tuple[StepOps, Counter[str]]:
    options = {"base": args.base, "encoding": args.encoding}
    model = stack_model(blocks, args.d_model)
    compress, apply = step_ops(model, bucket_cap_mb=ACCELERATOR_BUCKET_CAP_MB, **options)
    cpu_compress, cpu_apply = step_ops(stack_model(blocks, args.d_model), bucket_cap_mb=CPU_BUCKET_CAP_MB, **options)
    buckets = {cap: len(DeMo(model.parameters(), bucket_cap_mb=cap)._buckets)
               for cap in (ACCELERATOR_BUCKET_CAP_MB, CPU_BUCKET_CAP_MB)}
    row = StepOps(blocks=blocks, tensors=sum(1 for _ in model.parameters()), buckets=buckets[ACCELERATOR_BUCKET_CAP_MB],
                  compress_ops=compress.total(), apply_ops=apply.total(), cpu_buckets=buckets[CPU_BUCKET_CAP_MB],
                  cpu_total=cpu_compress.total() + cpu_apply.total())
    return row, compress + apply


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    print(f"DeMo base={args.base} encoding={args.encoding}, d_model={args.d_model}, one compress + one apply; "
          f"accelerator buckets of {ACCELERATOR_BUCKET_CAP_MB:g} MiB, CPU buckets of {CPU_BUCKET_CAP_MB:g} MiB")
    print("| blocks | tensors | buckets | compress ops | apply ops | total | CPU: buckets | CPU: total |")
    print("|---|---|---|---|---|---|---|---|")
    rows: dict[int, StepOps] = {}
    ops: dict[int, Counter[str]] = {}
    for blocks in args.depths:
        row, ops[blocks] = _measure(blocks, args)
        rows[blocks] = row
        cells = (row.blocks, row.tensors, row.buckets, row.compress_ops, row.apply_ops, row.total, row.cpu_buckets,
                 row.cpu_total)
        print("| " + " | ".join(map(str, cells)) + " |")
    deepest, ref = max(args.depths), args.reference
    print(f"ops of the {deepest}-block step: " + ", ".join(f"{name} {n}" for name, n in ops[deepest].most_common(8)))
    print(f"CPU buckets, not checked: ratio {deepest} blocks / {ref} blocks "
          f"{rows[deepest].cpu_total / rows[ref].cpu_total:.2f}, {rows[ref].cpu_total} ops at {ref} blocks")
    ratio = rows[deepest].total / rows[ref].total
    met = ratio <= args.bound and rows[ref].total <= args.max_ops
    print(f"ratio {deepest} blocks / {ref} blocks: {ratio:.2f} (bound {args.bound:.2f}); "
          f"{rows[ref].total} ops at {ref} blocks (bound {args.max_ops}): {'met' if met else 'NOT met'}")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
