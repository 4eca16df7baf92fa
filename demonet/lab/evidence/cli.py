"""The `demonet bench` flags and entry point (also `python bench/evidence.py`).

An entry point: parses flags, checks that namespaces can be made, runs `run_bench`, writes the report.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from demonet.lab import netlab

from . import SYSTEMS, BenchSetup, Swarm
from .sweep import load_runs, run_bench

__all__ = ["add_arguments", "main", "run"]

MAX_PEERS = 16
"""Peers a run may have: each is a namespace with its processes on this one machine."""


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _names(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown system(s) {unknown}; expected some of {sorted(SYSTEMS)}")
    return names


def _swarms(args: argparse.Namespace) -> list[Swarm]:
    """The swarms the flags ask for: one per `--mbit` speed, or the one of `--peer-mbit`; each with `--slowdown`.

    Raises:
        ValueError: both `--mbit` and `--peer-mbit`, a list without one value per peer, a slowdown below 1, or a
            fast-only system on a swarm without a fast peer.
    """
    if args.mbit is not None and args.peer_mbit is not None:
        raise ValueError("--mbit (every peer alike) and --peer-mbit (one speed per peer) exclude each other")
    if args.peer_mbit is not None:
        swarms = [Swarm.of(args.peers, args.peer_mbit, args.slowdown)]
    else:
        swarms = [Swarm.of(args.peers, None, args.slowdown, sweep=m) for m in args.mbit or [1000.0, 100.0, 10.0]]
    if any(SYSTEMS[name].fast_only for name in args.systems):
        for swarm in swarms:
            swarm.fast()
    return swarms


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchSetup()
    parser.add_argument("--out", default="runs/bench", help="folder for the runs, results.json and plots")
    parser.add_argument("--mbit", type=_floats,
                        help="link speeds in Mbit/s, comma-separated: one run per speed, every peer's link at it "
                             "(1000,100,10)")
    parser.add_argument("--peer-mbit", type=_floats, metavar="MBIT,...",
                        help="one link speed per peer instead (e.g. 100,100,100,5): one mixed swarm")
    parser.add_argument("--slowdown", type=_floats, metavar="FACTOR,...",
                        help="one compute slowdown per peer, each >= 1 (e.g. 1,1,1,2: the fourth peer's forward "
                             "and backward take twice as long); default none")
    parser.add_argument("--systems", type=_names, default=list(SYSTEMS),
                        help=f"comma-separated, of {','.join(SYSTEMS)} (all)")
    parser.add_argument("--peers", type=int, default=d.peers, help=f"training peers, each in its own namespace "
                                                                 f"({d.peers})")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"steps per run ({d.steps})")
    parser.add_argument("--max-time-s", type=float, default=d.max_time_s,
                        help=f"stop a run after this long; its figures cover the steps done ({d.max_time_s:g})")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help=f"sequences per peer per step "
                                                                               f"({d.batch_size})")
    parser.add_argument("--adamw-lr", type=float, default=d.adamw_lr, help=f"AdamW-DDP and hivemind ({d.adamw_lr:g})")
    parser.add_argument("--demo-lr", type=float, default=d.demo_lr, help=f"demonet's DeMo lr ({d.demo_lr:g})")
    parser.add_argument("--target-loss", type=float,
                        help="time-to-loss target (default: 3%% above AdamW-DDP's smoothed loss at half the steps)")
    parser.add_argument("--plots", help="also copy the PNG plots into this folder (e.g. docs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--report-only", action="store_true",
                        help="make the report again from the runs saved under --out (no training)")


def run(args: argparse.Namespace) -> int:
    """Run the comparison; 0 when every run did at least one step and the report was written."""
    from . import report

    if args.steps < 2 or args.max_time_s <= 0 or args.batch_size < 1 or not 2 <= args.peers <= MAX_PEERS:
        print(f"demonet bench: --steps should be >= 2, --max-time-s > 0, --batch-size >= 1, --peers 2 to "
              f"{MAX_PEERS}", file=sys.stderr)
        return 2
    try:
        swarms = _swarms(args)
    except ValueError as e:
        print(f"demonet bench: {e}", file=sys.stderr)
        return 2
    setup = BenchSetup(peers=args.peers, steps=args.steps, max_time_s=args.max_time_s, batch_size=args.batch_size,
                       adamw_lr=args.adamw_lr, demo_lr=args.demo_lr)
    out = Path(args.out)
    load = os.getloadavg()
    started = time.time()
    if args.report_only:
        runs = load_runs(out)
        if not runs:
            print(f"demonet bench: no saved runs under {out}", file=sys.stderr)
            return 2
    else:
        ok, why = netlab.available()
        if not ok:
            print(f"demonet bench: {why}", file=sys.stderr)
            return 2
        out.mkdir(parents=True, exist_ok=True)
        runs = run_bench(setup, args.systems, swarms, out, progress=not args.no_progress and sys.stderr.isatty())
    summary = report.summarize(runs, setup, args.target_loss)
    summary.update(setup={k: str(v) for k, v in vars(setup).items()}, load_before=load, load_after=os.getloadavg(),
                   wall_s=time.time() - started, cpus=os.cpu_count())
    (out / "results.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    tables = report.table(summary) + "\n" + report.pipeline_table(summary)
    if mixed := report.mixed_table(summary):
        tables += "\n" + mixed
    (out / "results.md").write_text(tables)
    paths = report.plot(runs, summary["target_loss"], out)
    if args.plots:
        Path(args.plots).mkdir(parents=True, exist_ok=True)
        for path in paths:
            shutil.copy(path, Path(args.plots) / path.name)
    print(tables)
    print(f"load average before {load[0]:.2f}, after {summary['load_after'][0]:.2f}; results in {out}")
    failed = [f"{r['system']} on {r['swarm']}" for r in summary["runs"] if r["steps"] == 0]
    if failed:
        print(f"demonet bench: no steps from {', '.join(failed)}; see the logs under {out}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="demonet bench", description="demonet vs AdamW-DDP and hivemind.Optimizer, "
                                     "peers in network namespaces over tbf-shaped links.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
