"""Real rounds over gRPC on loopback: a `demonet coordinator` process and `demonet.peer` processes.

Every peer must end every round with the coordinator's parameters, losses must be finite, and the
aggregate a peer downloads must stay about the size of what it uploads. `demonet up` end to end.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.common import tiny_config
from tests.procs import Reaper

pytestmark = pytest.mark.slow

TOKEN = "grpc-round-test-token"
PROCESS_TIMEOUT_S = 180.0
STOP_STEPS = 200
"""The SIGTERM test's rounds: the peer that stays runs tens of them a second alone, and enough must be left
for the restart to join again on a loaded machine."""


def _peer_main(argv: list[str], gate: Any = None) -> None:
    """A peer process (spawned: a fresh interpreter, as on another machine); with `gate` (an Event), it
    imports torch and demonet first, then waits for the gate before it runs."""
    os.environ["DEMONET_TOKEN"] = TOKEN
    from demonet.peer import main

    if gate is not None:
        gate.wait()
    raise SystemExit(main(argv))


class _Coordinator:
    """A `demonet coordinator` child process; `address` once it listens."""

    def __init__(self, tmp: Path, steps: int, reaper: Reaper, timeout_s: float = 5.0, **net: float) -> None:
        (tmp / "tiny.toml").write_text(tiny_config(round_timeout_s=timeout_s, **net))
        self.reaper = reaper
        self.proc = reaper.add(subprocess.Popen(
            [sys.executable, "-m", "demonet", "coordinator", "--listen", "127.0.0.1:0", "--steps", str(steps),
             "--config", str(tmp / "tiny.toml"), "--state-dir", str(tmp / "state")],
            stdout=subprocess.PIPE, stderr=reaper.open(tmp / "coordinator.log", "w"), text=True,
            env={**os.environ, "DEMONET_TOKEN": TOKEN}))
        lines: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline() if self.proc.stdout else ""),
                         daemon=True).start()
        line = lines.get(timeout=60)  # bounded: a coordinator that hangs fails the test, not the suite
        assert line.startswith("listening on "), (tmp / "coordinator.log").read_text()
        self.address = line.split()[-1]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s."""
        self.reaper.stop([self.proc], 15.0)


@pytest.fixture
def spawn(reap_children: Reaper) -> Any:
    """Start peer processes with the spawn context; every one still alive at the end is killed."""
    ctx = mp.get_context("spawn")

    def start(argv: list[str], gate: Any = None) -> Any:
        proc = ctx.Process(target=_peer_main, args=(argv, gate))
        proc.start()
        return reap_children.add(proc)

    return start


def _metrics(out: Path) -> list[dict[str, Any]]:
    rows = []
    for path in out.glob("metrics-*.jsonl"):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


def _check_rounds(rows: list[dict[str, Any]], peers: set[str], steps: int, all_in: int | None = None) -> None:
    """Digests agree in every round; once every peer is in (from round `all_in`, by default the first
    round of the last peer to enter), each one is in every round to the last."""
    by_round: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_round.setdefault(r["round"], []).append(r)
        assert math.isfinite(r["loss"])
        assert r["bytes_down"] <= 1.5 * r["bytes_up"], r  # the coordinator bounds the aggregate
    for round_, rs in by_round.items():
        assert len({r["param_digest"] for r in rs}) == 1, f"round {round_}: {rs}"
    assert max(by_round) == steps - 1
    if all_in is None:  # joiners enter at boundaries
        all_in = max(min(r["round"] for r in rows if r["peer"] == p) for p in peers)
    for round_ in range(all_in, steps):
        assert {r["peer"] for r in by_round[round_]} == peers, f"round {round_}"


def test_three_peer_processes_agree_every_round(tmp_path: Path, spawn: Any, reap_children: Reaper) -> None:
    steps, out = 60, tmp_path / "out"  # tiny rounds take ~0.1 s: time for every peer to start and join
    coordinator = _Coordinator(tmp_path, steps, reap_children)
    try:
        peers = [spawn(["--coordinator", coordinator.address, "--peer-id", f"p{i}", "--out", str(out),
                        "--threads", "1", "--accumulate", str(i + 1)]) for i in range(3)]
        deadline = time.monotonic() + PROCESS_TIMEOUT_S
        for proc in peers:
            proc.join(timeout=max(1.0, deadline - time.monotonic()))
        assert [p.exitcode for p in peers] == [0, 0, 0], (tmp_path / "coordinator.log").read_text()
    finally:
        coordinator.stop()
    _check_rounds(_metrics(out), {"p0", "p1", "p2"}, steps)
    assert all((out / f"peer-p{i}.pt").exists() for i in range(3))


def test_a_peer_stopped_by_sigterm_saves_leaves_and_resumes(tmp_path: Path, spawn: Any,
                                                            reap_children: Reaper) -> None:
    out = tmp_path / "out"
    # A round would wait for a silent member until it is dropped, here 60 s: the peer that stops says it
    # leaves, so the other one goes on alone at once (tens of rounds a second), and the restart joins again
    # later.
    coordinator = _Coordinator(tmp_path, STOP_STEPS, reap_children, timeout_s=60.0, heartbeat_timeout_s=60.0)
    argv = ["--coordinator", coordinator.address, "--out", str(out), "--threads", "1", "--checkpoint-every", "0"]
    try:
        stays = spawn([*argv, "--peer-id", "stays"])
        leaves = spawn([*argv, "--peer-id", "leaves"])
        gate = mp.get_context("spawn").Event()
        back = spawn([*argv, "--peer-id", "leaves"], gate)  # the restart, held until the first one is gone
        deadline = time.monotonic() + PROCESS_TIMEOUT_S
        logs = [out / "metrics-leaves.jsonl", out / "metrics-stays.jsonl"]

        def rounds_in(f: Path) -> int:
            return len(f.read_text().splitlines()) if f.exists() else 0

        while min(map(rounds_in, logs)) < 3 and time.monotonic() < deadline:  # both peers in the run
            time.sleep(0.1)
        os.kill(leaves.pid, signal.SIGTERM)
        leaves.join(timeout=30)
        assert leaves.exitcode == 0
        assert (out / "peer-leaves.pt").exists()
        stopped = max(r["round"] for r in _metrics(out) if r["peer"] == "leaves")
        gate.set()
        for proc in (stays, back):
            proc.join(timeout=max(1.0, deadline - time.monotonic()))
        assert (stays.exitcode, back.exitcode) == (0, 0), (tmp_path / "coordinator.log").read_text()
    finally:
        coordinator.stop()
    assert "leaves left" in (tmp_path / "coordinator.log").read_text()
    rows = _metrics(out)
    rounds = sorted(r["round"] for r in rows if r["peer"] == "leaves")
    again = min(n for n in rounds if n > stopped)  # its first round after the restart
    assert rounds == [*range(rounds[0], stopped + 1), *range(again, STOP_STEPS)] and again < STOP_STEPS - 10, rounds
    kept = sorted(r["round"] for r in rows if r["peer"] == "stays")
    assert kept == list(range(kept[0], STOP_STEPS)) and kept[0] <= stopped, kept  # on alone, then with the restart
    _check_rounds(rows, {"stays", "leaves"}, STOP_STEPS, all_in=again)


def test_demonet_up_writes_the_run_folder(tmp_path: Path) -> None:
    (tmp_path / "tiny.toml").write_text(tiny_config(round_timeout_s=5.0))
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "demonet", "up", "--peers", "2", "--steps", "3", "--out", str(out),
         "--config", str(tmp_path / "tiny.toml"), "--no-progress"],
        capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S, env={**os.environ, "DEMONET_TOKEN": ""})
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    assert summary == json.loads((out / "summary.json").read_text())
    assert (summary["rounds"], summary["peers"], summary["digests_agree"]) == (3, 2, True)
    assert summary["failed"] == {} and summary["unfinished"] == []
    assert math.isfinite(summary["first_loss"]) and math.isfinite(summary["last_loss"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == sorted(rows, key=lambda r: (r["round"], r["peer"]))
    _check_rounds(rows, {"peer-0", "peer-1"}, 3)
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    token = out / "token"  # kept for `demonet status --coordinator ADDR --token-file OUT/token`, for its owner only
    assert len(token.read_text().strip()) >= 24 and token.stat().st_mode & 0o777 == 0o600
    assert (out / "compute_wait.png").read_bytes()[:4] == b"\x89PNG"
    assert all(r["wait_s"] >= 0 and r["compute_s"] > 0 for r in rows)
    # where each round's exchange went: the parts add up to no more than the peer's wait for the round
    # (and the wait for the canonical digest: right after the settle where it had come by then ("digest"), else
    # after the next round's backward, in that round's row ("check"))
    exchange = {"encode", "submit", "wait", "download", "decode"}
    assert all(exchange <= set(r["phases"]) <= exchange | {"digest", "check"} for r in rows), rows[0]
    assert all(min(r["phases"].values()) >= 0 and sum(r["phases"].values()) <= r["round_time_s"] for r in rows)
    assert math.isfinite(summary["s_per_round"]) and summary["s_per_round"] > 0
    assert {p.name for p in (out / "logs").iterdir()} == {"coordinator.log", "peer-0.log", "peer-1.log"}
