"""Benchmark: the critical path of a coordinator's round close (what every peer waits for), and the
write of the coordinator's state.

It drives a `CoordinatorServicer` in one process, without sockets, with a state folder in a temp
directory (as `demonet coordinator --state-dir`): N members submit a payload each (one real training
step's, made once and reused), then the round closes as `tick_forever` closes it, holding the
condition. It times `_close_round` from its start to its return: the aggregate is published and the
waiters woken by then, so that is the round's critical path (merge, apply, and whatever else the code
does before it publishes). Where the code publishes before it applies, `_close_round` returns the apply,
which is timed apart (the canonical digest peers get at the end of the aggregate's stream). Between
closes it sleeps --gap-s, the peers' compute, when a background write has the machine to itself.
Also timed: one `CanonicalState.save` alone (the write of the state), and, where the code writes in
the background, the writes themselves (`demonet_persist_seconds`).
With `--baseline DIR` (a checkout of another commit, e.g. `git worktree add /tmp/base REV`) the same
measurement runs on DIR's code first, then on this tree's, and one table shows them side by side.
Run from the repo root: `python bench/close_path.py`. Prints a table; not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


async def _measure(peers: int, rounds: int, gap_s: float, config: str | None) -> dict[str, Any]:
    """Close `rounds` rounds of `peers` members on the demonet that is imported; times in seconds."""
    import torch

    from demonet import wire
    from demonet.config import load_config
    from demonet.coordinator.metrics import Metrics
    from demonet.coordinator.server import CoordinatorOptions, CoordinatorServicer
    from demonet.train.trainer import Trainer
    from demonet.wire.merge import decode_contribution

    torch.set_num_threads(1)
    cfg = load_config(config, {}, {"net": {"start_peers": peers}})  # all of them members of round 0
    with tempfile.TemporaryDirectory(prefix="close_path-") as tmp:
        metrics = Metrics()
        servicer = CoordinatorServicer(cfg, CoordinatorOptions(token="t", state_dir=Path(tmp) / "state"), metrics)
        state = servicer.state
        payloads = {}
        for i in range(peers):
            _, payload = Trainer.for_run(cfg, data_seed=i, device=torch.device("cpu")).train_step()
            data = wire.encode(payload, step=0)
            payloads[f"p{i}"] = decode_contribution(data, expected=state.specs, rules=state.rules)[1]
        for p in payloads:
            servicer.rounds.join(p, time.monotonic())
        close_s, apply_s = [], []
        for _ in range(rounds):
            async with servicer.cond:
                r = servicer.rounds.round
                for p, payload in payloads.items():
                    servicer.rounds.submit(p, r, time.monotonic())
                    servicer.payloads[p], servicer.losses[p] = payload, 1.0
                t0 = time.perf_counter()
                advance = await servicer._close_round()
                close_s.append(time.perf_counter() - t0)
            if advance is not None:  # code that publishes before it applies: the apply, off the critical path
                t0 = time.perf_counter()
                await advance
                apply_s.append(time.perf_counter() - t0)
            await asyncio.sleep(gap_s)
        persister = getattr(servicer, "persister", None)
        if persister is not None:
            await persister.flush()
        t0 = time.perf_counter()
        state.save(Path(tmp) / "alone", {"rounds": servicer.rounds.state_dict()})
        save_alone_s = time.perf_counter() - t0
        writes = metrics.registry.get_sample_value("demonet_persist_seconds_count")
        write_sum = metrics.registry.get_sample_value("demonet_persist_seconds_sum")
        coalesced = metrics.totals.get("persist_coalesced")
    timed = close_s[1:] or close_s  # the first close pays one-time costs
    return {"close_median_s": statistics.median(timed), "close_p90_s": statistics.quantiles(timed, n=10)[-1],
            "save_alone_s": save_alone_s, "writes": writes, "write_mean_s": write_sum / writes if writes else None,
            "coalesced": coalesced, "apply_median_s": statistics.median(apply_s[1:] or apply_s) if apply_s else None,
            "rounds": rounds, "params": sum(p.numel() for p in state.params.values())}


def _run_child(code: Path, args: argparse.Namespace) -> dict[str, Any]:
    """This script's measurement on the demonet in `code`, in a fresh process."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--peers", str(args.peers), "--rounds",
            str(args.rounds), "--gap-s", str(args.gap_s), *(["--config", args.config] if args.config else [])]
    env = {**os.environ, "PYTHONPATH": str(code.resolve())}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=code.resolve(), check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the measurement on {code} failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1e3 * value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4, help="members submitting every round (4)")
    parser.add_argument("--rounds", type=int, default=40, help="rounds closed (40)")
    parser.add_argument("--gap-s", type=float, default=0.2, help="sleep between closes: the peers' compute (0.2)")
    parser.add_argument("--config", help="TOML run config (default: the embedded default model)")
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit: measured first, side by side")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_measure(args.peers, args.rounds, args.gap_s, args.config))))
        return
    here = Path(__file__).resolve().parent.parent
    runs = ([("baseline", args.baseline)] if args.baseline is not None else []) + [("this tree", here)]
    print(f"# round close critical path: {args.peers} members, {args.rounds} rounds, {args.gap_s} s between "
          f"closes, {'config ' + args.config if args.config else 'the embedded default model'}, one torch thread")
    print()
    print("| code | close ms, median | close ms, p90 | apply after the publish ms, median | state write alone ms | "
          "background writes | background write ms, mean | snapshots coalesced |")
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for name, code in runs:
        m = results[name] = _run_child(code, args)
        print(f"| {name} ({code}) | {_ms(m['close_median_s'])} | {_ms(m['close_p90_s'])} "
              f"| {_ms(m.get('apply_median_s'))} | {_ms(m['save_alone_s'])} "
              f"| {'-' if m['writes'] is None else int(m['writes'])} | {_ms(m['write_mean_s'])} "
              f"| {'-' if m['coalesced'] is None else m['coalesced']} |")
    if "baseline" in results:
        b, t = results["baseline"], results["this tree"]
        print()
        print(f"close median: this tree / baseline = {t['close_median_s'] / b['close_median_s']:.2f} "
              f"({_ms(b['close_median_s'])} -> {_ms(t['close_median_s'])} ms; {b['params']:,} parameters)")


if __name__ == "__main__":
    main()
