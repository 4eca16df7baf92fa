"""Benchmark: where a round's CPU goes, by process, in coordinator mode and in DHT mode.

On a machine whose cores are shared by every process of a run (the loopback runs of
`bench/round_overhead.py` and `bench/dht_round.py`), a round lasts about as long as its CPU takes on the
cores, so the round overhead is mostly the CPU of the work that is not training. For each mode it
starts `demonet up [--dht] --peers N` (the embedded default model unless --config), waits for round
--skip, then reads every process's CPU time (user + system, from psutil) over --seconds and the rounds
peer-0 ended meanwhile, and prints the CPU milliseconds per round:
- each peer process (its training, codec, exchange and event loop), and of it its main thread, which runs
  its event loop (streams, the DHT node, signatures, the codecs of small messages);
- in DHT mode, each peer's p2pd daemon (and, on a --baseline from before the DHT node ran in the peer's
  own process, each peer's DHT process);
- in coordinator mode, the coordinator.
Then the total against the CPU the cores had (cores x round time), and the CPU that DHT mode adds.
With --baseline DIR (a checkout of another commit) every mode runs on that code too, right after.
Run from the repo root: `python bench/round_cpu.py`. Prints a table; not a test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil


def _kind(proc: psutil.Process, up: int) -> str:
    cmdline = " ".join(proc.cmdline())
    if "p2pd" in proc.name() or "p2pd" in cmdline:
        return "p2pd"
    if "demonet coordinator" in cmdline:
        return "coordinator"
    if "demonet peer" in cmdline:
        return "peer" if proc.ppid() == up else "dht process"  # a peer's DHT process (older code) is its fork
    return "other"


def _cpu(up: psutil.Process) -> dict[int, tuple[str, float, float]]:
    """Process id -> (its kind, its CPU seconds so far, those of its main thread), for every process under
    `demonet up`. A peer's main thread runs its event loop (streams, the DHT node, signatures, small codecs);
    its training, and the codecs of large messages, run in other threads."""
    out = {}
    for proc in up.children(recursive=True):
        try:
            times = proc.cpu_times()
            main = next((t.user_time + t.system_time for t in proc.threads() if t.id == proc.pid), 0.0)
            out[proc.pid] = (_kind(proc, up.pid), times.user + times.system, main)
        except psutil.Error:  # gone meanwhile
            continue
    return out


def measure(peers: int, dht: bool, config: str | None, skip: int, seconds: float, code: Path | None,
            out: Path, up_args: tuple[str, ...] = ()) -> dict[str, Any]:
    root = (code or Path(__file__).resolve().parent.parent).resolve()
    cmd = [sys.executable, "-m", "demonet", "up", "--peers", str(peers), "--steps", "100000", "--out", str(out),
           "--no-progress", *(["--dht"] if dht else []), *(["--config", config] if config else []), *up_args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root, env=env)
    rows = out / "metrics-peer-0.jsonl"
    ended = lambda: len(rows.read_text().splitlines()) if rows.exists() else 0  # noqa: E731
    try:
        deadline = time.monotonic() + 300
        while ended() < skip:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"demonet up {'--dht ' if dht else ''}ended or stalled before round {skip}")
            time.sleep(0.2)
        up = psutil.Process(proc.pid)
        before, r0, t0 = _cpu(up), ended(), time.perf_counter()
        time.sleep(seconds)
        after, r1, t1 = _cpu(up), ended(), time.perf_counter()
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    rounds = r1 - r0
    by_kind: dict[str, list[float]] = {}
    loops: list[float] = []
    for pid, (kind, cpu, main) in after.items():
        if pid in before:
            by_kind.setdefault(kind, []).append(cpu - before[pid][1])
            if kind == "peer":
                loops.append(main - before[pid][2])
    return {"rounds": rounds, "round_s": (t1 - t0) / max(rounds, 1),
            "kinds": {k: (len(v), 1000 * sum(v) / max(rounds, 1)) for k, v in by_kind.items()},
            "loop_ms": 1000 * sum(loops) / max(len(loops), 1) / max(rounds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4, help="peers (4)")
    parser.add_argument("--config", help="TOML run config (default: the embedded default model)")
    parser.add_argument("--skip", type=int, default=20, help="rounds before the reading starts (20)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long CPU is read (20)")
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit: run it too, side by side")
    parser.add_argument("--modes", default="coordinator,dht", help="modes, comma-separated (coordinator,dht)")
    parser.add_argument("--state-every-s", type=float, help="this tree's coordinator writes its state at most "
                        "this often (`demonet up --state-every-s`; not passed to --baseline)")
    args = parser.parse_args()
    mine = () if args.state_every_s is None else ("--state-every-s", str(args.state_every_s))
    cores = os.cpu_count() or 1
    print(f"# CPU per round by process: `demonet up [--dht] --peers {args.peers}`, "
          f"{'config ' + args.config if args.config else 'the embedded default model'}, read over {args.seconds:g} s "
          f"after round {args.skip}, on {cores} cores"
          + ("" if args.state_every_s is None else f"; this tree's coordinator writes its state at most every "
                                                   f"{args.state_every_s:g} s"))
    print()
    print("| mode | code | rounds read | round ms | peer process ms (each) | of it, its event loop's thread "
          "| DHT process ms (each) | p2pd ms (each) | coordinator ms | total ms | of the cores' ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    totals: dict[tuple[str, str], float] = {}
    codes = [("this tree", None)] + ([("baseline", args.baseline)] if args.baseline else [])
    with tempfile.TemporaryDirectory(prefix="round_cpu-") as tmp:
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            for label, code in codes:
                m = measure(args.peers, mode == "dht", args.config, args.skip, args.seconds, code,
                            Path(tmp) / f"{mode}-{label.replace(' ', '-')}",
                            up_args=mine if code is None and mode == "coordinator" else ())
                kinds = m["kinds"]
                each = {k: f"{ms / n:.1f}" for k, (n, ms) in kinds.items()}
                total = sum(ms for _, ms in kinds.values())
                totals[(mode, label)] = total
                print(f"| {mode} | {label} | {m['rounds']} | {1000 * m['round_s']:.0f} | {each.get('peer', '')} "
                      f"| {m['loop_ms']:.1f} | {each.get('dht process', '')} | {each.get('p2pd', '')} "
                      f"| {each.get('coordinator', '')} | {total:.0f} | {1000 * m['round_s'] * cores:.0f} |")
    print()
    for label, _ in codes:
        if ("coordinator", label) in totals and ("dht", label) in totals:
            extra = totals[("dht", label)] - totals[("coordinator", label)]
            print(f"{label}: DHT mode takes {extra:.0f} ms more CPU a round than coordinator mode "
                  f"({extra / cores:.0f} ms of a round's wall time on {cores} busy cores)")


if __name__ == "__main__":
    main()
