"""Soak test (not in CI): a coordinator and N peers in a network lab, peers SIGKILLed, restarted and
cut off at random for a given time, with a watchdog that fails when no round closes for too long.

    sudo PYTHONPATH=. python scripts/soak.py --minutes 5 --peers 4 --seed 0 --out runs/soak

Each peer is a `demonet peer` process in its own namespace with a tbf-shaped link (a random rate
between 5 and 100 Mbit/s) and reaches the coordinator through a delay proxy. At the end it checks,
from every peer's metrics.jsonl and the coordinator's log, that all peers that completed a round
hold the coordinator's digest after it, and prints a JSON summary. Exit status 1 on a watchdog or
digest failure. Needs root (network namespaces); every process and namespace is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from demonet.lab import netlab
from demonet.lab.tiny import TINY_MODEL

PORT, PROXY_PORT, TOKEN = 7450, 7000, "soak-token"
CONFIG = TINY_MODEL + """[net]
round_timeout_s = 2.0
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 4.0
"""


def _closed(log: Path) -> dict[int, tuple[str, bool]]:
    text = log.read_text(errors="replace") if log.exists() else ""
    return {int(m[1]): (m[3], m[2] == "aborted") for m in
            re.finditer(r"round=(\d+)\] (applied|aborted) with \d+ payloads \(.*?\); digest (\w+)", text)}


class Soak:
    def __init__(self, lab: netlab.Lab, out: Path, peers: int, rng: random.Random) -> None:
        self.lab, self.out, self.rng = lab, out, rng
        self.env = {**os.environ, "DEMONET_TOKEN": TOKEN}
        (out / "run.toml").write_text(CONFIG)
        self.coord = lab.add_host("coord", mbit=1000)
        self.files: list[Any] = []
        self.coordinator = self.coord.popen(
            [sys.executable, "-m", "demonet.coordinator", "--listen", f"{self.coord.addr}:{PORT}", "--config",
             str(out / "run.toml"), "--steps", "0", "--start-peers", str(peers), "--state-dir", str(out / "state")],
            stdout=subprocess.PIPE, stderr=self._log("coordinator"), env=self.env)
        assert self.coordinator.stdout is not None and "listening" in self.coordinator.stdout.readline().decode()
        self.hosts = {}
        self.procs: dict[str, subprocess.Popen[bytes] | None] = {}
        for n in range(peers):
            name = f"p{n}"
            host = lab.add_host(name, mbit=rng.choice([5, 20, 50, 100]))
            proxy = host.popen([sys.executable, "-m", "demonet.lab.netlab", "proxy",
                                "--listen", f"127.0.0.1:{PROXY_PORT}",
                                "--target", f"{self.coord.addr}:{PORT}", "--delay-ms", str(rng.choice([5, 20, 50]))],
                               stdout=subprocess.PIPE)
            assert proxy.stdout is not None and "listening" in proxy.stdout.readline().decode()
            self.hosts[name] = host
            self.start(name)
        self.counts = {"kills": 0, "restarts": 0, "partitions": 0}

    def _log(self, name: str) -> Any:
        f = open(self.out / f"{name}.log", "ab")
        self.files.append(f)
        return f

    def start(self, name: str) -> None:
        self.procs[name] = self.hosts[name].popen(
            [sys.executable, "-m", "demonet", "peer", "--coordinator", f"127.0.0.1:{PROXY_PORT}", "--peer-id",
             name, "--out", str(self.out / "metrics"), "--threads", "1", "--reconnect-timeout-s", "120"],
            stdout=self._log(name), stderr=subprocess.STDOUT, env=self.env)

    def chaos(self) -> str:
        """One random event: kill a live peer, restart a dead one, or cut a link for a few seconds."""
        live = [n for n, p in self.procs.items() if p is not None]
        dead = [n for n, p in self.procs.items() if p is None]
        roll = self.rng.random()
        if dead and (roll < 0.4 or len(live) <= 1):
            name = self.rng.choice(dead)
            self.start(name)
            self.counts["restarts"] += 1
            return f"restart {name}"
        if roll < 0.75 and len(live) > 1:
            name = self.rng.choice(live)
            proc = self.procs[name]
            assert proc is not None
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            self.procs[name] = None
            self.counts["kills"] += 1
            return f"kill {name}"
        name = self.rng.choice(live)
        self.hosts[name].set_link(up=False)
        time.sleep(self.rng.uniform(2, 8))
        self.hosts[name].set_link(up=True)
        self.counts["partitions"] += 1
        return f"partition {name}"

    def check(self) -> dict[str, Any]:
        closed = _closed(self.out / "coordinator.log")
        mismatches = []
        rows = 0
        for path in sorted((self.out / "metrics").glob("metrics-*.jsonl")):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                rows += 1
                want = closed.get(row["round"])
                if want is None or not row["param_digest"].startswith(want[0]):
                    mismatches.append((path.stem, row["round"]))
        return {"rounds_closed": len(closed), "rounds_aborted": sum(a for _, a in closed.values()),
                "peer_rounds": rows, "digest_mismatches": mismatches[:10], "num_mismatches": len(mismatches)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--watchdog-s", type=float, default=60.0, help="fail if no round closes for this long")
    parser.add_argument("--out", default="runs/soak")
    args = parser.parse_args()
    ok, why = netlab.available()
    if not ok:
        print(f"soak: {why}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    netlab.sweep()
    failed = ""
    t0 = time.monotonic()
    with netlab.Lab() as lab:
        soak = Soak(lab, out, args.peers, rng)
        last_count, last_progress, longest = 0, time.monotonic(), 0.0
        events = []
        try:
            while time.monotonic() - t0 < args.minutes * 60:
                time.sleep(rng.uniform(3, 10))
                events.append(soak.chaos())
                count = len(_closed(out / "coordinator.log"))
                now = time.monotonic()
                if count > last_count:
                    last_count, last_progress = count, now
                longest = max(longest, now - last_progress)
                print(f"[{now - t0:6.0f} s] {events[-1]:<16} rounds closed {count}", flush=True)
                if now - last_progress > args.watchdog_s:
                    failed = f"watchdog: no round closed for {now - last_progress:.0f} s"
                    break
            for name, proc in soak.procs.items():  # every peer back, then a last stretch of progress
                if proc is None:
                    soak.start(name)
            end = len(_closed(out / "coordinator.log"))
            deadline = time.monotonic() + args.watchdog_s
            while len(_closed(out / "coordinator.log")) < end + 5 and time.monotonic() < deadline:
                time.sleep(0.5)
            if not failed and len(_closed(out / "coordinator.log")) < end + 5:
                failed = "watchdog: no progress after every peer was restarted"
        finally:
            summary = {**soak.check(), **soak.counts, "minutes": round((time.monotonic() - t0) / 60, 2),
                       "longest_without_progress_s": round(longest, 1), "failed": failed}
            for f in soak.files:
                f.close()
    if summary["num_mismatches"]:
        summary["failed"] = summary["failed"] or "digest mismatch"
    print(json.dumps(summary, indent=1))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
