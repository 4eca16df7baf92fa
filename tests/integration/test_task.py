"""A user's task (`--task MODULE:FUNCTION`) in every mode, over real processes and sockets.

The task is `examples/custom_task.py`, a small convolutional network on generated images, so these
also run the example the README shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.common import listening_line
from tests.procs import Reaper

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TASK = "examples.custom_task:task"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "DEMONET_TOKEN": "task-test-token"}


def _demonet(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "demonet", *argv], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=ROOT)


def test_the_local_cluster_trains_a_user_task(tmp_path: Path) -> None:
    proc = _demonet("train", "--task", TASK, "--peers", "2", "--steps", "100", "--lr", "0.03", "--out",
                    str(tmp_path), "--no-progress", "--threads", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)  # run_local raises if a peer left the canonical digest
    assert summary["params"] == 1316 and summary["val_loss"] == {}
    assert summary["last_loss"] < summary["first_loss"] - 0.15, summary  # ln 4 = 1.386 knows nothing


@pytest.mark.parametrize("mode", ["coordinator", "dht"])
def test_demonet_up_runs_a_user_task(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "run"
    proc = _demonet("up", "--task", TASK, "--peers", "2", "--steps", "8", "--out", str(out), "--no-progress",
                    *(["--dht"] if mode == "dht" else []), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:] + "".join(
        p.read_text()[-2000:] for p in (out / "logs").glob("*.log"))
    summary = json.loads(proc.stdout)
    assert summary["digests_agree"] and summary["peers"] == 2 and summary["rounds"] >= 6, summary
    assert summary["bytes_up_per_round"] < 5264  # under the dense fp32 gradient of the 1316 parameters


def test_the_readmes_cnn_command_learns(tmp_path: Path) -> None:
    # The README's `demonet up` line for the example, at 2 peers and 100 rounds: it sets the lr the example needs
    # (at the default 3e-3 the loss stayed at ln 4 = 1.386).
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if f"demonet up --task {TASK}" in line)
    argv = line.split("#")[0].split()[1:]
    assert "--lr" in argv, line
    sizes = {"--peers": "2", "--steps": "100", "--out": str(tmp_path / "run")}
    argv = [sizes.get(prev, arg) for prev, arg in zip(["", *argv[:-1]], argv, strict=True)]
    proc = _demonet(*argv, "--no-progress", "--no-dashboard", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["digests_agree"] and summary["rounds"] == 100, summary
    assert summary["last_loss"] < summary["first_loss"] - 0.15, summary


def test_up_refuses_a_learning_rate_that_is_not_positive(tmp_path: Path) -> None:
    proc = _demonet("up", "--peers", "1", "--steps", "1", "--lr", "0", "--out", str(tmp_path / "run"), timeout=120)
    assert proc.returncode == 2 and "--lr should be > 0, got 0.0" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_a_peer_whose_model_differs_is_refused_before_it_is_admitted(tmp_path: Path,
                                                                     reap_children: Reaper) -> None:
    coordinator = reap_children.add(subprocess.Popen(
        [sys.executable, "-m", "demonet", "coordinator", "--listen", "127.0.0.1:0", "--task", TASK,
         "--steps", "5"], stdout=subprocess.PIPE, stderr=reap_children.open(tmp_path / "coordinator.log", "w"),
        env=ENV, cwd=ROOT))
    address = listening_line(coordinator, 60).split()[-1]
    peer = _demonet("peer", "--coordinator", address, "--peer-id", "odd", "--out", str(tmp_path / "odd"),
                    "--task", "tests.integration.tasks:five_classes")
    assert peer.returncode == 2, peer.stderr[-3000:]
    assert "parameter '7.weight' is [5, 16] float32 here, [4, 16] float32 in the run" in peer.stderr
    status = _demonet("status", "--coordinator", address, "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["members"] == [], status.stdout
    assert "odd" not in (tmp_path / "coordinator.log").read_text()  # never admitted, never waited for


def test_a_coordinator_whose_task_cannot_be_built_exits_with_the_reason(tmp_path: Path) -> None:
    proc = _demonet("coordinator", "--listen", "127.0.0.1:0", "--task", "tests.integration.tasks:broken",
                    timeout=120)
    assert proc.returncode == 2 and "failed: RuntimeError: no data here" in proc.stderr, proc.stderr[-2000:]
    assert "listening" not in proc.stdout


def test_up_says_why_its_coordinator_stopped(tmp_path: Path) -> None:
    """`demonet up` whose coordinator cannot build the task shows the coordinator's last lines itself."""
    proc = _demonet("up", "--task", "tests.integration.tasks:broken", "--peers", "1", "--steps", "1", "--out",
                    str(tmp_path / "out"), "--no-progress", timeout=120)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "coordinator exited with code 2" in proc.stderr and "no data here" in proc.stderr, proc.stderr[-2000:]
