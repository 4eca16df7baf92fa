"""examples/own_loop.py, a user's own training loop, as real peer processes of a real run.

Coordinator mode: a `demonet coordinator` process and two example processes; both end the run on
the coordinator's parameters (the canonical digest every metrics row carries), every round with
both contributing. DHT mode: two example processes meet on a loopback DHT and end on one digest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.common import listening_line, metrics_rows, rows_by_round, tiny_config
from tests.integration.test_grpc_round import TOKEN, _Coordinator
from tests.procs import Reaper

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "own_loop.py"
WAIT_S = 180.0


def _start(args: list[str], log: Path, reaper: Reaper) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DEMONET_TOKEN": TOKEN,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    return reaper.add(subprocess.Popen([sys.executable, str(EXAMPLE), "--threads", "1", *args],
                                       stdout=subprocess.PIPE, stderr=reaper.open(log, "wb"), env=env,
                                       start_new_session=True), group=True)


def _finish(procs: dict[str, subprocess.Popen[bytes]], tmp: Path) -> dict[str, dict[str, Any]]:
    """Each example's last stdout line (its JSON summary, with "lines": the lines before it), once all exited
    with 0."""
    deadline = time.monotonic() + WAIT_S
    summaries = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert proc.returncode == 0, (tmp / f"{name}.log").read_text()[-4000:]
        *lines, last = out.decode().strip().splitlines()
        summaries[name] = {**json.loads(last), "lines": lines}
    return summaries


@pytest.mark.parametrize(("args", "token", "words"), [
    ([], "t", "give either --coordinator HOST:PORT or --dht"),
    (["--coordinator", "127.0.0.1:1", "--dht"], "t", "give either --coordinator HOST:PORT or --dht"),
    (["--coordinator", "127.0.0.1:1"], None, "no token: pass --token-file FILE or set DEMONET_TOKEN"),
    (["--coordinator", "127.0.0.1:1", "--token-file", "/nonexistent/token"], None, "cannot read the token file"),
])
def test_own_loop_refuses_bad_arguments_with_a_message(args: list[str], token: str | None, words: str,
                                                       tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DEMONET_TOKEN"} | ({"DEMONET_TOKEN": token} if token else {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--peer-id", "a", *args], capture_output=True, env=env,
                          timeout=120, cwd=tmp_path)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and words in err and "Traceback" not in err, err
    assert proc.stdout == b""


def test_two_own_loops_end_on_the_coordinators_parameters(tmp_path: Path, reap_children: Reaper) -> None:
    steps, out = 8, tmp_path / "out"
    coordinator = _Coordinator(tmp_path, steps, reap_children, start_peers=2)
    try:
        procs = {name: _start(["--coordinator", coordinator.address, "--peer-id", name, "--out", str(out)],
                              tmp_path / f"{name}.log", reap_children) for name in ("alice", "bob")}
        summaries = _finish(procs, tmp_path)
    finally:
        coordinator.stop()
    by_round = rows_by_round(lambda p: metrics_rows(out, p), ["alice", "bob"])
    assert sorted(by_round) == list(range(steps))
    for round_, rows in by_round.items():
        assert set(rows) == {"alice", "bob"}, round_
        assert len({r["param_digest"] for r in rows.values()} | {r["canonical_digest"] for r in rows.values()}) == 1
        assert all(r["contributors"] == 2 for r in rows.values()), rows
    final = by_round[steps - 1]["alice"]["canonical_digest"]
    assert {s["digest"] for s in summaries.values()} == {final}
    assert all(s["round"] == steps and s["reason"] == "the run is over" for s in summaries.values()), summaries
    assert all((out / f"peer-{name}.pt").exists() for name in ("alice", "bob"))
    for name, summary in summaries.items():  # a line per round, as it goes
        rounds = [line.split(":")[0] for line in summary["lines"]]
        assert rounds == [f"round {r}" for r in range(steps)], (name, summary)


def test_two_own_loops_in_dht_mode_agree(tmp_path: Path, reap_children: Reaper) -> None:
    pytest.importorskip("hivemind")
    steps, out = 4, tmp_path / "out"
    (tmp_path / "run.toml").write_text(tiny_config(round_timeout_s=5.0, start_peers=2))
    base = ["--dht", "--config", str(tmp_path / "run.toml"), "--steps", str(steps), "--out", str(out),
            "--host-maddr", "/ip4/127.0.0.1/tcp/0"]
    first = _start([*base, "--peer-id", "first"], tmp_path / "first.log", reap_children)
    line = listening_line(first, WAIT_S)
    assert line.startswith("dht listening on "), (tmp_path / "first.log").read_text()[-4000:]
    second = _start([*base, "--peer-id", "second", "--initial-peers", line.split()[-1]], tmp_path / "second.log",
                    reap_children)
    summaries = _finish({"first": first, "second": second}, tmp_path)
    by_round = rows_by_round(lambda p: metrics_rows(out, p), ["first", "second"])
    assert sorted(by_round) == list(range(steps))
    for round_, rows in by_round.items():
        assert len({r["param_digest"] for r in rows.values()}) == 1, (round_, rows)
    assert all(r["contributors"] == 2 for r in by_round[steps - 1].values()), by_round[steps - 1]
    assert len({s["digest"] for s in summaries.values()}) == 1, summaries
    assert all(s["round"] == steps for s in summaries.values()), summaries
