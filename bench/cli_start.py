"""Benchmark: how long the `demonet` command takes to answer `--help`, and whether it imported torch.

Runs `python -m demonet ARGS --help` as a fresh process for each command line below, round-robin, and prints the
median wall time of each and whether torch was loaded (a light command line should not load it). Goal: `demonet
--help` and `demonet up --help` answer in under 1 s (torch's import alone took about 2 s on 2 CPU cores).
Run from the repo root: `python bench/cli_start.py`. `--smoke`: 2 reps: checks that it runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL_S = 1.0
COMMANDS = [[], ["up"], ["status"], ["peer"]]
"""Command lines asked for --help; `peer` imports its transports (and torch) to list its flags."""
# Prints "torch" when the command loaded it: the help is printed by then, and SystemExit runs this.
_PROBE = ("import sys, atexit; atexit.register(lambda: print('torch' if 'torch' in sys.modules else '-', "
          "file=sys.stderr)); sys.argv = ['demonet', *sys.argv[1:]]; from demonet.cli import main; main()")


def _once(args: list[str]) -> tuple[float, bool]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args, "--help"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"demonet {' '.join(args)} --help exited {proc.returncode}: {proc.stderr[-2000:]}")
    return seconds, proc.stderr.strip().splitlines()[-1] == "torch"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="2 reps: checks that it runs")
    args = parser.parse_args()
    reps = 2 if args.smoke else args.reps
    times: dict[str, list[float]] = {" ".join(c): [] for c in COMMANDS}
    torch_loaded: dict[str, bool] = {}
    for _ in range(reps):
        for command in COMMANDS:
            seconds, loaded = _once(command)
            times[" ".join(command)].append(seconds)
            torch_loaded[" ".join(command)] = loaded
    print(f"| command | median s | torch loaded | goal <= {GOAL_S} s |\n|---|---|---|---|")
    for name, samples in times.items():
        median = statistics.median(samples)
        goal = "met" if median <= GOAL_S else "NOT met"
        light = name in ("", "up")
        print(f"| demonet {name + ' ' if name else ''}--help | {median:.2f} | {'yes' if torch_loaded[name] else 'no'} "
              f"| {goal if light else 'n/a'} |")


if __name__ == "__main__":
    main()
