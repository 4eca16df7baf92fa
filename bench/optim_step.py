"""Benchmark: one optimizer step of DeMo vs AdamW vs the reference, against a forward+backward, on BENCH_MODEL.

Prints a table; not a test. Run from the repo root: `python bench/optim_step.py`. Every timed call
runs round-robin with the others, so a noisy machine slows all of them alike; medians are reported.
`--smoke`: 2 timed reps of a batch of 1 on one thread, a check that the script runs, not a measurement.
`--cpu-time`: one thread, each call timed in the process's CPU time: on a machine that other work shares, the
figure that work changes least.
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

from demonet.train.data import Batches, load_corpus  # noqa: E402
from demonet.train.model import BENCH_MODEL, GPT  # noqa: E402
from tests.reference_demo import ReferenceDeMo  # noqa: E402

GOAL_FRACTION = 0.06
"""The DeMo step should cost at most this share of a forward+backward."""


def _interleaved_ms(fns: dict[str, Callable[[], object]], reps: int, warmup: int, device: torch.device,
                    clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Times in ms of each function by `clock` (wall time by default), run round-robin so that all of them see
    the same noise."""
    times_ms: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + reps):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = clock()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times_ms[name].append((clock() - start) * 1e3)
    return times_ms


def _load_bloc97(path: str) -> Any:
    """The DeMo class of an external copy of bloc97/DeMo's demo.py (it needs einops and a process group)."""
    import importlib.util
    import os

    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("gloo", rank=0, world_size=1)
    spec = importlib.util.spec_from_file_location("bloc97_demo", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DeMo


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
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before timing")
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--skip-reference", action="store_true", help="do not time the slow oracle")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time in the process's CPU time, on one thread: on a machine other work shares, "
                             "what that work changes least")
    parser.add_argument("--bloc97", metavar="DEMO_PY", help="also time bloc97/DeMo's demo.py from this path")
    parser.add_argument("--smoke", action="store_true", help="2 reps of a batch of 1, one thread: checks that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.reps, args.warmup, args.batch, args.threads = 2, 1, 1, 1
    if args.cpu_time and (args.device != "cpu" or args.threads not in (None, 1)):
        parser.error("--cpu-time times the CPU on one thread: it takes neither --device cuda nor --threads > 1")
    if args.cpu_time:
        args.threads = 1
    return args


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

    forward_backward()  # the optimizers step on these gradients, round-robin with new forward+backwards
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    def with_grads(step: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:  # forward_backward() replaced the gradients: restore the fixed ones
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g
            return step()

        return run

    from demonet.optim import DeMo

    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    demo = DeMo(model.parameters(), lr=1e-3)
    fns: dict[str, Callable[[], object]] = {
        "forward+backward": forward_backward,
        "AdamW step": with_grads(adamw.step),
        "DeMo step": with_grads(demo.step),
    }
    if args.bloc97:
        bloc97 = _load_bloc97(args.bloc97)(model.parameters(), lr=1e-3)
        fns["bloc97 DeMo step"] = with_grads(bloc97.step)
    if not args.skip_reference:
        fns["reference (per-param loop)"] = with_grads(ReferenceDeMo(model.parameters(), lr=1e-3).step)
    clock = time.process_time if args.cpu_time else time.perf_counter
    samples = _interleaved_ms(fns, args.reps, args.warmup, device, clock)
    times_ms = {name: statistics.median(ts) for name, ts in samples.items()}
    state_bpp = {"AdamW": _state_bytes(adamw) / num_params, "DeMo": _state_bytes(demo) / num_params}

    threads = torch.get_num_threads() if device.type == "cpu" else "-"
    print(
        f"device={device} threads={threads} model=BENCH_MODEL ({num_params / 1e6:.2f}M params) "
        f"batch={args.batch}x{BENCH_MODEL.seq_len} reps={args.reps} warmup={args.warmup} "
        f"clock={'CPU time' if args.cpu_time else 'wall'}"
    )
    print(f"{'step':<28}{'median ms':>12}{'min ms':>10}")
    for name, ms in times_ms.items():
        print(f"{name:<28}{ms:>12.1f}{min(samples[name]):>10.1f}")
    fwd_bwd_ms = times_ms["forward+backward"]
    demo_ms = times_ms.get("DeMo step")
    if demo_ms is not None:
        print(f"ratio DeMo step / forward+backward: {demo_ms / fwd_bwd_ms:.1%}")
        for name in ("bloc97 DeMo step", "reference (per-param loop)"):
            if name in times_ms:
                print(f"ratio {name} / DeMo step: {times_ms[name] / demo_ms:.1f}x")
    for name, bpp in state_bpp.items():
        print(f"optimizer state bytes/param, {name}: {bpp:.2f}")
    print(f"goal: DeMo step <= {GOAL_FRACTION:.0%} of forward+backward")
    if demo_ms is not None:
        print(f"  {'met' if demo_ms <= GOAL_FRACTION * fwd_bwd_ms else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
