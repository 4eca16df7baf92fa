"""A demonet run spread over a network lab: the coordinator and every peer are real processes, each in
its own namespace, linked by tbf-shaped veths; every peer reaches the coordinator through a delay
proxy in its own namespace (latency added in user space).

`CoordinatorCluster` is the coordinator-mode launcher. The scenarios in this folder use only its
public methods (start, peer, kill, rows, digests, logs), so another mode (a DHT launcher with the
same methods) can be added by parametrizing the `cluster` fixture in conftest.py. Its processes and
logs are registered with the test's `Reaper` (the `reap_children` fixture), which ends them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

from demonet.lab import netlab
from demonet.loop.runfolder import final_rows
from tests.integration.common import GATE, listening_line, metrics_rows, rows_by_round
from tests.procs import Reaper

TOKEN = "chaos-test-token"
PORT = 7450
PROXY_PORT = 7000
WAIT_S = 90.0
"""Bound of every wait for progress (a scenario's run takes tens of seconds)."""
# A peer process spends seconds importing torch; one held at this gate enters the run at once.


def run_config(*, round_timeout_s: float, model: str = "tiny", topk: int = 32, **net: Any) -> str:
    """A TOML run config: the `tiny` model (22k parameters, rounds of milliseconds) or `small` (119k)."""
    d_model, n_layers = {"tiny": (32, 1), "small": (64, 2)}[model]
    lines = ["[model]", f"d_model = {d_model}", f"n_layers = {n_layers}", "n_heads = 2", "seq_len = 32",
             "[optim]", f"compression_topk = {topk}",
             "[train]", "seq_len = 32", "batch_size = 2",
             "[net]", f"round_timeout_s = {round_timeout_s}"]
    lines += [f"{k} = {json.dumps(v) if isinstance(v, bool) else v}" for k, v in net.items()]
    return "\n".join(lines) + "\n"


@dataclass
class PeerHandle:
    """One peer id: its namespace (kept across restarts) and its processes, newest last."""

    name: str
    host: netlab.Host
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.procs[-1]


class CoordinatorCluster:
    """One run in coordinator mode over a lab; `reaper` ends its processes (the fixture's teardown)."""

    mode = "coordinator"
    group_kill = False
    """Whether `kill` and the teardown signal a process's whole group (every popen makes one)."""

    def __init__(self, lab: netlab.Lab, tmp: Path, reaper: Reaper, *, prefix: str = "") -> None:
        self.lab, self.tmp, self.prefix = lab, tmp, prefix  # prefix: of host names, for two runs on one lab
        self.reaper = reaper
        tmp.mkdir(parents=True, exist_ok=True)
        self.out = tmp / "out"
        self.env = {**os.environ, "DEMONET_TOKEN": TOKEN}
        self.peers: dict[str, PeerHandle] = {}
        self.coordinators: list[subprocess.Popen[bytes]] = []
        self.coord: netlab.Host | None = None
        self.steps = 0
        self.delay_ms = 0.0

    # -- processes -------------------------------------------------------------------------------------

    def _logfile(self, name: str) -> IO[bytes]:
        return self.reaper.open(self.tmp / f"{name}.log", "ab")

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        """Every log's tail, for failure messages."""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in sorted(self.tmp.glob("*.log")))

    def start(self, config: str, *, steps: int, start_peers: int, delay_ms: float = 5.0,
              coord_mbit: float | None = 1000.0) -> None:
        """Write the run config and start the coordinator in its own namespace."""
        (self.tmp / "run.toml").write_text(config)
        self.steps, self.delay_ms, self.start_peers = steps, delay_ms, start_peers
        self.coord = self.lab.add_host(f"{self.prefix}coord", mbit=coord_mbit)
        self.start_coordinator()

    def start_coordinator(self) -> subprocess.Popen[bytes]:
        """(Re)start the coordinator on its address and port with its state folder; waits until it listens."""
        assert self.coord is not None
        name = f"coordinator-{len(self.coordinators) + 1}"
        proc = self.coord.popen(
            [sys.executable, "-m", "demonet.coordinator", "--listen", f"{self.coord.addr}:{PORT}",
             "--config", str(self.tmp / "run.toml"), "--steps", str(self.steps),
             "--start-peers", str(self.start_peers), "--state-dir", str(self.tmp / "state")],
            stdout=subprocess.PIPE, stderr=self._logfile(name), stdin=subprocess.DEVNULL, env=self.env)
        self.coordinators.append(self.reaper.add(proc))
        line = listening_line(proc, WAIT_S)
        assert line.startswith("listening on "), self.log(name)
        return proc

    @property
    def coordinator(self) -> subprocess.Popen[bytes]:
        return self.coordinators[-1]

    def host(self, name: str, mbit: float | None) -> netlab.Host:
        """The peer's namespace with its delay proxy to the coordinator (made once per peer id)."""
        if name in self.peers:
            return self.peers[name].host
        assert self.coord is not None
        host = self.lab.add_host(f"{self.prefix}{name}", mbit=mbit)
        proxy = host.popen([sys.executable, "-m", "demonet.lab.netlab", "proxy", "--listen", f"127.0.0.1:{PROXY_PORT}",
                            "--target", f"{self.coord.addr}:{PORT}", "--delay-ms", str(self.delay_ms)],
                           stdout=subprocess.PIPE, stderr=self._logfile(f"proxy-{name}"), stdin=subprocess.DEVNULL)
        assert proxy.stdout is not None and "listening" in proxy.stdout.readline().decode()
        self.peers[name] = PeerHandle(name, host)
        return host

    def peer(self, name: str, *, mbit: float | None = None, gated: bool = False, extra: Sequence[str] = (),
             script: str | None = None, script_args: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        """Start `demonet peer --peer-id name` in the peer's namespace (log <name>[-n].log).

        A gated peer imports torch, then waits for `release`; `script` replaces the gate (e.g. a poisoner).
        """
        host = self.host(name, mbit)
        handle = self.peers[name]
        argv = ["peer", "--coordinator", f"127.0.0.1:{PROXY_PORT}", "--peer-id", name, "--out", str(self.out),
                "--threads", "1", "--reconnect-timeout-s", "60", *extra]
        log = name if not handle.procs else f"{name}-{len(handle.procs) + 1}"
        if script is not None:
            cmd = [sys.executable, "-c", script, *script_args, *argv]
        elif gated:
            cmd = [sys.executable, "-c", GATE, *argv]
        else:
            cmd = [sys.executable, "-m", "demonet", *argv]
        proc = host.popen(cmd, stdin=subprocess.PIPE if gated else subprocess.DEVNULL,
                          stdout=self._logfile(log), stderr=subprocess.STDOUT, env=self.env)
        proc.log_name = log  # type: ignore[attr-defined]
        handle.procs.append(self.reaper.add(proc, group=self.group_kill))
        return proc

    def release_ready(self, proc: subprocess.Popen[bytes]) -> None:
        """Wait until a gated peer has warmed up."""
        name = proc.log_name  # type: ignore[attr-defined]
        self.wait_for(lambda: "gate: ready" in self.log(name), f"{name} to warm up")

    def release(self, proc: subprocess.Popen[bytes]) -> None:
        """Let a gated peer run `demonet peer`, once it is ready."""
        self.release_ready(proc)
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.close()

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL (nothing is flushed on the way out) and reap."""
        self.reaper.kill(proc)

    def stop(self, proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after timeout_s."""
        self.reaper.stop([proc], timeout_s)

    def wait_exit(self, procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = WAIT_S) -> list[int | None]:
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [proc.poll() for proc in procs]

    def finish(self, procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = WAIT_S) -> None:
        """Wait for the peers to end the run (exit 0), then stop the coordinator."""
        codes = self.wait_exit(procs, timeout_s)
        assert codes == [0] * len(procs), f"exit codes {codes}\n{self.logs()}"
        self.stop(self.coordinator)

    def wait_for(self, cond: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> float:
        """Poll until cond(); returns the seconds it took; fails the test with the logs after timeout_s."""
        t0 = time.monotonic()
        while not cond():
            if time.monotonic() - t0 > timeout_s:
                pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{self.logs()}")
            time.sleep(0.05)
        return time.monotonic() - t0

    # -- what the run did ------------------------------------------------------------------------------

    def rows(self, peer: str) -> list[dict[str, Any]]:
        """The peer's metrics.jsonl rows (one per round it completed), across restarts."""
        return metrics_rows(self.out, peer)

    def last_round(self, peer: str) -> int:
        rows = self.rows(peer)
        return int(rows[-1]["round"]) if rows else -1

    def coordinator_log(self) -> str:
        return "".join(self.log(f"coordinator-{i + 1}") for i in range(len(self.coordinators)))

    def canonical(self) -> dict[int, tuple[str, int, bool]]:
        """round -> (digest prefix after it, payloads merged, aborted), from the coordinators' logs."""
        out = {}
        for m in re.finditer(r"round=(\d+)\] (applied|aborted) with (\d+) payloads \(.*?\); digest (\w+)",
                             self.coordinator_log()):
            out[int(m[1])] = (m[4], int(m[3]), m[2] == "aborted")
        return out

    def by_round(self, peers: Sequence[str]) -> dict[int, dict[str, dict[str, Any]]]:
        """round -> peer -> row, checking what must hold in every scenario: one row per peer and round,
        finite losses, no resync, and every peer's digest after a round equal to the coordinator's. A
        round a peer did again (its coordinator restarted from a state written before that round was)
        counts once, its last row (`final_rows`), as the coordinator's last log line of it does."""
        canonical = self.canonical()
        by_round = rows_by_round(lambda p: final_rows(self.rows(p)), peers)
        for round_, rows in sorted(by_round.items()):
            digests = {p: r["param_digest"][:12] for p, r in rows.items()}
            assert set(digests.values()) == {canonical[round_][0]}, f"round {round_}: {digests} vs {canonical[round_]}"
        return by_round

    def loaded(self, peer: str) -> list[tuple[int, str]]:
        """(round, digest prefix) of every parameter download the peer logged, across restarts."""
        text = "".join(self.log(p.log_name) for p in self.peers[peer].procs)  # type: ignore[attr-defined]
        found = re.finditer(r"parameters of round (\d+) loaded from \S+ \(\d+ bytes, digest (\w+)\)", text)
        return [(int(m[1]), m[2]) for m in found]

    def mean_losses(self, by_round: dict[int, dict[str, dict[str, Any]]], peers: Sequence[str]) -> list[float]:
        return [sum(r["loss"] for p, r in rows.items() if p in peers) / max(1, sum(p in rows for p in peers))
                for _, rows in sorted(by_round.items()) if any(p in rows for p in peers)]


def loss_fell(losses: Sequence[float], margin: float = 0.3) -> bool:
    """The mean of the last 5 losses is below the mean of the first 5 by `margin` (nats)."""
    return sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - margin


def report(name: str, figures: dict[str, Any]) -> None:
    """Print a scenario's figures and, if DEMONET_CHAOS_REPORT names a folder, write <name>.json there."""
    print(f"chaos {name}: {json.dumps(figures)}")
    folder = os.environ.get("DEMONET_CHAOS_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.json").write_text(json.dumps(figures, indent=1) + "\n")
