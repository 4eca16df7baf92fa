"""The coordinator publishes a round, then writes its state in the background: kill -9 at any moment
leaves a state file of one closed round, and the peers that had gone ahead of it get back in step.

A real `demonet coordinator` process with --state-dir and two `demonet peer` processes on loopback
(the tiny model: rounds take about 0.1 s). The coordinator is killed with SIGKILL twice: once at
whatever moment the run is at, and once while its writes fail (a folder where its temp file goes, as
a full disk would), so that the file is rounds behind the peers when it dies. Each time it restarts
on its port from the same folder. Every wait is bounded; the reaper kills every process at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from demonet.coordinator.state import STATE_FILE
from demonet.loop.runfolder import final_rows
from demonet.wire.digest import param_digest
from tests.integration.common import listening_line, metrics_rows, tiny_config
from tests.procs import Reaper, free_port

pytestmark = pytest.mark.slow

TOKEN = "persist-test-token"
STEPS = 40
WAIT_S = 60.0
"""Bound of every wait for progress in the run (the whole run takes seconds)."""


class _Run:
    """A coordinator on a fixed port (restartable) and two peers, each logging into tmp."""

    def __init__(self, tmp: Path, reaper: Reaper) -> None:
        self.tmp, self.reaper = tmp, reaper
        self.out, self.state = tmp / "out", tmp / "state"
        self.listen = f"127.0.0.1:{free_port()}"
        (tmp / "run.toml").write_text(
            tiny_config(round_timeout_s=2.0, heartbeat_interval_s=0.5, heartbeat_timeout_s=4.0))
        self.env = {**os.environ, "DEMONET_TOKEN": TOKEN}
        self.coordinators = 0

    def coordinator(self) -> subprocess.Popen[bytes]:
        self.coordinators += 1
        log = self.reaper.open(self.tmp / f"coordinator-{self.coordinators}.log")
        proc = self.reaper.add(subprocess.Popen(
            [sys.executable, "-m", "demonet.coordinator", "--listen", self.listen, "--config",
             str(self.tmp / "run.toml"), "--steps", str(STEPS), "--start-peers", "2", "--state-dir", str(self.state)],
            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=self.env))
        assert listening_line(proc, WAIT_S).startswith("listening on "), self.logs()
        return proc

    def peer(self, peer_id: str) -> subprocess.Popen[bytes]:
        return self.reaper.add(subprocess.Popen(
            [sys.executable, "-m", "demonet", "peer", "--coordinator", self.listen, "--peer-id", peer_id,
             "--out", str(self.out), "--threads", "1", "--reconnect-timeout-s", "60"],
            stdin=subprocess.DEVNULL, stdout=self.reaper.open(self.tmp / f"{peer_id}.log"),
            stderr=subprocess.STDOUT, env=self.env))

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.tmp.glob("*.log")))

    def published(self) -> int:
        """The newest round whose aggregate a peer applied."""
        return max((int(r["round"]) for p in ("a", "b") for r in metrics_rows(self.out, p)), default=-1)

    def saved(self) -> dict[str, Any]:
        return dict(torch.load(self.state / STATE_FILE, map_location="cpu", weights_only=False))

    def wait_for(self, cond: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not cond():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {WAIT_S:.0f} s waiting for {what}\n{self.logs()}")
            time.sleep(0.02)


def _one_closed_round(saved: dict[str, Any]) -> int:
    """Check that a state file holds one closed round: its parameters match their digest, which is the
    digest its last aggregate published, and its counters count the rounds closed. Returns its round."""
    round_ = int(saved["rounds"]["round"])
    assert param_digest(saved["params"].items()) == saved["digest"]
    last = saved["aggregates"][-1]
    assert (last.round, last.param_digest) == (round_ - 1, saved["digest"])
    assert saved["counters"]["rounds_closed"] == round_
    return round_


def _block_writes(tmp_file: Path) -> None:
    """Make a folder where the coordinator writes its temp file, so that its writes fail (while a write
    holds the temp file, try again: the write renames it away in a moment)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            tmp_file.mkdir()
            return
        except FileExistsError:
            assert time.monotonic() < deadline, f"{tmp_file} stayed"
            time.sleep(0.001)


def test_the_coordinator_killed_at_any_moment_resumes_one_closed_round_and_peers_ahead_come_back(
        tmp_path: Path, reap_children: Reaper) -> None:
    run = _Run(tmp_path, reap_children)
    coordinator = run.coordinator()
    a, b = run.peer("a"), run.peer("b")
    run.wait_for(lambda: run.published() >= 4, "the first rounds")

    reap_children.kill(coordinator)  # 1: whatever the moment
    published = run.published()
    first = _one_closed_round(run.saved())
    assert published - 5 <= first <= published + 1, (first, published)  # never ahead; behind by a round or so
    coordinator = run.coordinator()
    run.wait_for(lambda: run.published() >= first + 3, "rounds after the first restart")

    blocker = run.state / (STATE_FILE + ".tmp")
    _block_writes(blocker)  # 2: every write fails from now on; the rounds go on
    run.wait_for(lambda: "could not write the state" in run.log("coordinator-2"), "a failed write")
    stuck = _one_closed_round(run.saved())
    run.wait_for(lambda: run.published() >= stuck + 3, "rounds published past the state on disk")
    reap_children.kill(coordinator)
    lost = run.published() + 1 - _one_closed_round(run.saved())
    assert lost >= 3, lost
    assert "ERROR" in run.log("coordinator-2")
    blocker.rmdir()
    coordinator = run.coordinator()

    for peer in (a, b):
        assert peer.wait(timeout=WAIT_S) == 0, run.logs()
    reap_children.stop([coordinator], 20.0)  # SIGTERM: it writes the newest state, then exits
    assert coordinator.returncode == 0, run.logs()
    assert f"resumed from {run.state / STATE_FILE}" in run.log("coordinator-3")
    final = run.saved()
    assert _one_closed_round(final) == STEPS
    for p in ("a", "b"):
        rows = metrics_rows(run.out, p)
        rounds = [r["round"] for r in rows]
        assert any(y < x for x, y in zip(rounds, rounds[1:], strict=False)), rounds  # it went back
        assert "catching up" in run.log(p), run.log(p)
        kept = final_rows(rows)
        assert [r["round"] for r in kept] == list(range(STEPS)), [r["round"] for r in kept]
        assert all(r["param_digest"] == r["canonical_digest"] for r in kept), p
        assert kept[-1]["param_digest"] == final["digest"]
