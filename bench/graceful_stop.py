"""Benchmark: what a graceful stop costs the peers that stay, on loopback.

A `demonet coordinator` and three `demonet peer` processes (a, b, c) train a tiny model with the default
`[net]` timeouts (a round's deadline 30 s, heartbeats every 2 s, a silent member dropped after 15 s); with
`--dht`, three `demonet peer --dht` processes and no coordinator (a round freezes without a member that
did not announce 30 s after the first announcement).
Once c has made 5 rounds it gets SIGTERM: it ends its open round and stops. Printed per run: the seconds
from the SIGTERM to a's first round after c's last one was over, and a's longest and median round from
then on. With `--baseline DIR` (a checkout of another commit, e.g. `git worktree add /tmp/base REV`) each
run is made on DIR's code too, alternating, on the same machine.
Run from the repo root: `python bench/graceful_stop.py`. Prints a table; not a test. `--smoke`: one run of this
tree, a check that the script runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demonet.lab.tiny import TINY_MODEL  # noqa: E402

WAIT_S = 120.0


def _rows(out: Path, peer: str) -> list[dict[str, Any]]:
    path = out / f"metrics-{peer}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _wait(cond: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"graceful_stop: timed out waiting for {what}")
        time.sleep(0.01)


def _coordinator_peers(code: Path, tmp: Path, out: Path, env: dict[str, str],
                       procs: list[subprocess.Popen[Any]]) -> dict[str, subprocess.Popen[Any]]:
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "demonet", "coordinator", "--listen", "127.0.0.1:0", "--steps", "40",
         "--start-peers", "3", "--config", str(tmp / "run.toml")], cwd=code, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    procs.append(coordinator)
    assert coordinator.stdout is not None
    address = coordinator.stdout.readline().split()[-1]
    peers = {p: subprocess.Popen([sys.executable, "-m", "demonet", "peer", "--coordinator", address, "--peer-id", p,
                                  "--out", str(out), "--threads", "1"], cwd=code, env=env, stderr=subprocess.DEVNULL)
             for p in "abc"}
    procs += peers.values()
    return peers


def _dht_peers(code: Path, tmp: Path, out: Path, env: dict[str, str],
               procs: list[subprocess.Popen[Any]]) -> dict[str, subprocess.Popen[Any]]:
    """a starts the DHT; b and c bootstrap from the multiaddr it logs."""
    argv = [sys.executable, "-m", "demonet", "peer", "--dht", "--run", "graceful", "--host-maddr",
            "/ip4/127.0.0.1/tcp/0", "--config", str(tmp / "run.toml"), "--steps", "60", "--start-peers", "3",
            "--out", str(out), "--threads", "1"]
    peers: dict[str, subprocess.Popen[Any]] = {}
    maddr: list[str] = []
    for p in "abc":
        with open(tmp / f"{p}.log", "w") as log:
            peers[p] = subprocess.Popen([*argv, "--peer-id", p, *maddr], cwd=code, env=env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(peers[p])
        if not maddr:
            _wait(lambda: "dht listening on " in (tmp / "a.log").read_text(), "a's DHT node")
            line = next(ln for ln in (tmp / "a.log").read_text().splitlines() if ln.startswith("dht listening on "))
            maddr = ["--initial-peers", line.removeprefix("dht listening on ").strip()]
    return peers


def run(code: Path, dht: bool) -> tuple[float, float, float]:
    """(seconds from c's SIGTERM to a's round after c's last, a's longest and median round after c's last)."""
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        out = tmp / "out"
        (tmp / "run.toml").write_text(TINY_MODEL)  # the default [net] timeouts
        env = {**os.environ, "PYTHONPATH": str(code), "DEMONET_TOKEN": "graceful-stop-bench"}
        procs: list[subprocess.Popen[Any]] = []
        try:
            peers = (_dht_peers if dht else _coordinator_peers)(code, tmp, out, env, procs)
            _wait(lambda: len(_rows(out, "c")) >= 5, "c's first 5 rounds")
            start = time.monotonic()
            peers["c"].send_signal(signal.SIGTERM)
            peers["c"].wait(timeout=WAIT_S)
            last = _rows(out, "c")[-1]["round"]
            _wait(lambda: any(r["round"] > last + 1 for r in _rows(out, "a")), "a's rounds after c's last")
            stall = time.monotonic() - start
            for p in "ab":
                peers[p].wait(timeout=WAIT_S)
            after = [r["round_time_s"] for r in _rows(out, "a") if r["round"] > last]
            return stall, max(after), statistics.median(after)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):  # a DHT peer's session: its DHT and p2pd too
                        os.killpg(proc.pid, signal.SIGKILL) if dht else proc.kill()
                    proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="runs per code (2)")
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit: run it too, alternating")
    parser.add_argument("--dht", action="store_true", help="DHT mode: three `demonet peer --dht`, no coordinator")
    parser.add_argument("--smoke", action="store_true", help="one run of this tree: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.baseline = 1, None
    here = Path(__file__).resolve().parent.parent
    codes = [("baseline", args.baseline.resolve()), ("this tree", here)] if args.baseline else [("this tree", here)]
    print("| code | run | SIGTERM to a's next round s | a's longest round after s | a's median round after s |")
    print("|---|---|---|---|---|")
    for n in range(args.runs):
        for name, code in codes:
            stall, longest, median = run(code, args.dht)
            print(f"| {name} | {n + 1} | {stall:.2f} | {longest:.2f} | {median:.3f} |", flush=True)


if __name__ == "__main__":
    main()
