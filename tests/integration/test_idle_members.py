"""Membership by work, over real sockets: 200 members that join and only heartbeat, none of whose payloads was ever
accepted, are never waited on (docs/coordinator.md#who-a-round-waits-for), and they stay connected."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.common import listening_line, metrics_rows, tiny_config
from tests.procs import Reaper

pytestmark = pytest.mark.slow

TOKEN = "idle-token"
TIMEOUT_S = 3.0
FAKES = 200
TIMED = 10
"""Honest rounds timed once the fakes are members."""
BENCH = Path(__file__).resolve().parents[2] / "bench" / "idle_members.py"
"""Its `--fakes-only` mode is the attacker: joins ids with the run token, heartbeats them, never submits."""


def _wait_for(check: object, timeout_s: float, what: str, logs: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"no {what} in {timeout_s} s\n" + (logs / "coordinator.log").read_text()
        time.sleep(0.1)


@pytest.mark.timeout(90)
def test_members_that_never_submit_stop_delaying_rounds_and_stay_connected(tmp_path: Path,
                                                                           reap_children: Reaper) -> None:
    (tmp_path / "run.toml").write_text(tiny_config(round_timeout_s=TIMEOUT_S, start_peers=2, heartbeat_interval_s=0.5,
                                                   heartbeat_timeout_s=10.0))
    env = {**os.environ, "DEMONET_TOKEN": TOKEN}

    def start(args: list[str], name: str) -> subprocess.Popen[bytes]:
        return reap_children.add(subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, env=env,
                                                  stderr=reap_children.open(tmp_path / f"{name}.log")))

    coordinator = start(["-m", "demonet.coordinator", "--listen", "127.0.0.1:0", "--config",
                         str(tmp_path / "run.toml"), "--steps", "0"], "coordinator")
    line = listening_line(coordinator, 60.0)
    assert line.startswith("listening on "), (tmp_path / "coordinator.log").read_text()
    address = line.split()[-1]
    out = tmp_path / "out"
    for name in ("h0", "h1"):
        start(["-m", "demonet", "peer", "--coordinator", address, "--peer-id", name, "--out", str(out),
               "--threads", "1"], name)
    _wait_for(lambda: all(metrics_rows(out, p) for p in ("h0", "h1")), 60.0, "honest round", tmp_path)

    attacker = start([str(BENCH), "--fakes-only", address, "--fakes", str(FAKES)], "fakes")
    joined = listening_line(attacker, 30.0)  # "joined 200, member from round R"
    assert joined.startswith(f"joined {FAKES}"), (tmp_path / "fakes.log").read_text()
    first = int(joined.split()[-1])
    last = first + TIMED - 1
    _wait_for(lambda: all(any(r["round"] >= last for r in metrics_rows(out, p)) for p in ("h0", "h1")),
              4 * TIMEOUT_S + 30.0, f"honest rounds up to {last}", tmp_path)

    # The fakes held no round: from their first as members, every round closed once the two were in.
    rows = {p: {r["round"]: r for r in metrics_rows(out, p)} for p in ("h0", "h1")}
    for p, by_round in rows.items():
        assert all(r["contributors"] == 2 for r in by_round.values()), by_round
        timed = [by_round[n]["round_time_s"] for n in range(first, last + 1)]
        assert len(timed) == TIMED and max(timed) < TIMEOUT_S - 0.5, (p, timed)
        assert statistics.median(timed) < TIMEOUT_S / 4, (p, timed)

    # Still connected: members, each "new" (no payload accepted) in the status document, no heartbeat refused.
    done = subprocess.run([sys.executable, "-m", "demonet", "status", "--coordinator", address, "--json"],
                          capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["run"]["members"] == FAKES + 2 and doc["run"]["idle"] == 0, doc["run"]
    states = {m["id"]: m["state"] for m in doc["members"]}
    # The document lists at most 200 members, the contributors first, and counts the rest by state.
    listed_new = sum(s == "new" for p, s in states.items() if p.startswith("fake-"))
    assert listed_new + doc["members_omitted"].get("new", 0) == FAKES, (listed_new, doc["members_omitted"])
    assert all(states[p] in ("member", "submitted") for p in ("h0", "h1")), states
    assert attacker.poll() is None
    log = (tmp_path / "coordinator.log").read_text()
    assert "dropped fake" not in log and "idle (no payload in" not in log
    attacker.kill()
    assert attacker.stdout is not None
    assert b"not member" not in attacker.stdout.read()
