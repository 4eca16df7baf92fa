"""Benchmark: loss at an equal number of rounds with overlapped rounds, against plain rounds.

Runs the in-process local cluster (`demonet train`: N peers, the coordinator's merge, no sockets) on
the embedded corpus for each seed, three ways: plain rounds (`overlap = 0`), overlapped with the
lookahead (`overlap = 1`), and a plain one-round delay (`overlap = 1, lookahead = false`). Prints, per
seed and as a mean over the seeds, the mean training loss of the last `--window` rounds and the
validation loss of the canonical parameters after the last round, and each against plain.

A 200-round run of this model is chaotic: a change of 1e-7 in the initial parameters moves its
final loss by several percent. One seed says little; compare the means, and the spread between seeds
of the plain runs themselves. Run from the repo root; not a test. `--smoke`: one seed, 2 peers, 4 rounds: a
check that the script runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from demonet.config import load_config
from demonet.loop.local import run_local

MODES = {"plain": (0, True), "overlap": (1, True), "delay": (1, False)}


def _last_loss(out: Path, window: int) -> float:
    by_round: dict[int, list[float]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_round.setdefault(int(row["round"]), []).append(float(row["loss"]))
    rounds = sorted(by_round)[-window:]
    return statistics.fmean(statistics.fmean(by_round[n]) for n in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=20, help="rounds at the end whose training loss is averaged")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    parser.add_argument("--smoke", action="store_true", help="one seed, 2 peers, 4 rounds: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.seeds, args.peers, args.steps, args.window = [0], 2, 4, 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    print(f"# {args.peers} peers, {args.steps} rounds, the built-in GPT on the embedded corpus, seeds {args.seeds}")
    print("| seed | mode | train loss, last rounds | val loss at the end | vs plain (train) | vs plain (val) | s |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for mode, (overlap, lookahead) in MODES.items():
                out = Path(tmp) / f"{mode}-{seed}"
                cfg = load_config(None, {}, {
                    "train": {"peers": args.peers, "steps": args.steps, "seed": seed, "out": str(out),
                              "eval_every": args.steps},
                    "net": {"overlap": overlap, "lookahead": lookahead}})
                t0 = time.perf_counter()
                summary = run_local(cfg, progress=False)
                wall = time.perf_counter() - t0
                train, val = _last_loss(out, args.window), float(summary["val_loss"][args.steps])
                results[mode].append((train, val))
                plain = results["plain"][-1]
                print(f"| {seed} | {mode} | {train:.4f} | {val:.4f} | {train / plain[0]:.3f}x | {val / plain[1]:.3f}x "
                      f"| {wall:.0f} |", flush=True)
    print()
    print("| mode | mean train loss | mean val loss | vs plain (train) | vs plain (val) | seeds |")
    print("|---|---|---|---|---|---|")
    base = [statistics.fmean(x[i] for x in results["plain"]) for i in (0, 1)]
    for mode, xs in results.items():
        train, val = (statistics.fmean(x[i] for x in xs) for i in (0, 1))
        print(f"| {mode} | {train:.4f} | {val:.4f} | {train / base[0]:.3f}x | {val / base[1]:.3f}x | {len(xs)} |")
    spread = [x[1] for x in results["plain"]]
    if len(spread) > 1:
        print(f"\nplain runs' val loss across seeds: min {min(spread):.4f}, max {max(spread):.4f} "
              f"(stdev {statistics.stdev(spread):.4f})")


if __name__ == "__main__":
    main()
