"""Benchmark: one optimizer step of DeMo vs AdamW vs the per-parameter oracle, on BENCH_MODEL.

Prints a table; not a test. Run from the repo root: `python bench/optim_step.py --reps 5`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.reference_demo

from demonet.data import Batches, load_corpus  # noqa: E402
from demonet.model import BENCH_MODEL, GPT  # noqa: E402
from tests.reference_demo import ReferenceDeMo  # noqa: E402

GOAL_FRACTION = 0.06
"""The DeMo step should cost at most this share of a forward+backward."""


def _time_ms(fn: Callable[[], object], reps: int, warmup: int, device: torch.device) -> float:
    """Median wall time of `fn` in milliseconds, after `warmup` untimed calls."""
    times_ms: list[float] = []
    for i in range(warmup + reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times_ms.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times_ms)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in `opt.state_dict()["state"]`, each storage counted once."""
    seen: dict[int, int] = {}

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, list | tuple):
            for value in obj:
                walk(value)

    walk(opt.state_dict()["state"])
    return sum(seen.values())


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before timing")
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--skip-reference", action="store_true", help="do not time the slow oracle")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(BENCH_MODEL).to(device)
    num_params = model.num_params()
    batches = Batches(load_corpus(), batch_size=args.batch, seq_len=BENCH_MODEL.seq_len, seed=0)
    x_BT, y_BT = (t.to(device) for t in next(batches))

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        _, loss = model(x_BT, y_BT)
        assert loss is not None
        loss.backward()

    times_ms: dict[str, float] = {}
    state_bpp: dict[str, float] = {}
    times_ms["forward+backward"] = _time_ms(forward_backward, args.reps, args.warmup, device)
    forward_backward()  # every step below reuses these gradients

    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times_ms["AdamW step"] = _time_ms(adamw.step, args.reps, args.warmup, device)
    state_bpp["AdamW"] = _state_bytes(adamw) / num_params

    try:
        from demonet.optim import DeMo
    except ImportError as e:
        print(f"DeMo: not available ({e})")
    else:
        demo = DeMo(model.parameters(), lr=1e-3)
        times_ms["DeMo step"] = _time_ms(demo.step, args.reps, args.warmup, device)
        state_bpp["DeMo"] = _state_bytes(demo) / num_params

    if not args.skip_reference:
        reference = ReferenceDeMo(model.parameters(), lr=1e-3)
        times_ms["reference (per-param loop)"] = _time_ms(reference.step, args.reps, args.warmup, device)

    threads = torch.get_num_threads() if device.type == "cpu" else "-"
    print(
        f"device={device} threads={threads} model=BENCH_MODEL ({num_params / 1e6:.2f}M params) "
        f"batch={args.batch}x{BENCH_MODEL.seq_len} reps={args.reps} warmup={args.warmup}"
    )
    print(f"{'step':<28}{'median ms':>12}")
    for name, ms in times_ms.items():
        print(f"{name:<28}{ms:>12.1f}")
    fwd_bwd_ms = times_ms["forward+backward"]
    demo_ms = times_ms.get("DeMo step")
    if demo_ms is not None:
        print(f"ratio DeMo step / forward+backward: {demo_ms / fwd_bwd_ms:.1%}")
        if "reference (per-param loop)" in times_ms:
            print(f"ratio reference / DeMo: {times_ms['reference (per-param loop)'] / demo_ms:.1f}x")
    for name, bpp in state_bpp.items():
        print(f"optimizer state bytes/param, {name}: {bpp:.2f}")
    print(f"goal: DeMo step <= {GOAL_FRACTION:.0%} of forward+backward")
    if demo_ms is not None:
        print(f"  {'met' if demo_ms <= GOAL_FRACTION * fwd_bwd_ms else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
