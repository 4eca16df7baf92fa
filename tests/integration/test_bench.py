"""`demonet bench`, shortened: every system trains a few steps with 2 peers over 100 Mbit/s links and the report
is written.

The performance goals are read from the full run (docs/evidence.md), not asserted here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from demonet.lab import netlab
from demonet.lab.evidence import SYSTEMS

ok, why = netlab.available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not ok, reason=why)]


@pytest.mark.timeout(420)
def test_every_system_runs_and_the_report_is_written(tmp_path: Path) -> None:
    out, plots = tmp_path / "bench", tmp_path / "docs"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-m", "demonet", "bench", "--out", str(out), "--plots", str(plots),
                           "--mbit", "100", "--steps", "2", "--peers", "2", "--max-time-s", "150",
                           "--no-progress"],
                          capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    runs = {r["system"]: r for r in results["runs"]}
    assert set(runs) == set(SYSTEMS)
    for name, r in runs.items():
        assert r["finished"] and r["steps"] == 2, (name, r)
        assert math.isfinite(r["loss_last"]) and r["sent_per_step"] > 0 and r["recv_per_step"] > 0, (name, r)
    # The evidence model's payloads and aggregates travel with deflated values (tests/unit/test_wire.py): every
    # demonet system's peers end each round on the same parameters.
    for name in (n for n in SYSTEMS if n.startswith("demonet")):
        digests: dict[int, set[str]] = {}
        for path in (out / f"{name}-100mbit").glob("metrics-peer-*.jsonl"):
            for row in map(json.loads, path.read_text().splitlines()):
                digests.setdefault(row["round"], set()).add(row["param_digest"])
        assert sorted(digests) == [0, 1] and all(len(d) == 1 for d in digests.values()), (name, digests)
    for name in ("loss_vs_step.png", "loss_vs_time.png"):
        assert (plots / name).read_bytes().startswith(b"\x89PNG"), name
    assert "| 100 Mbit/s | adamw-ddp | 2 | 8 |" in (out / "results.md").read_text()  # 2 peers x 4 sequences


def test_bad_arguments_are_refused_before_anything_starts(tmp_path: Path) -> None:
    bad = subprocess.run([sys.executable, "-m", "demonet", "bench", "--out", str(tmp_path / "b"),
                          "--systems", "adamw-ddp,nosuch"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "nosuch" in bad.stderr
    assert not (tmp_path / "b").exists()
    for peers in ("1", "17"):
        bad = subprocess.run([sys.executable, "-m", "demonet", "bench", "--out", str(tmp_path / "b"), "--peers", peers],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "--peers 2 to 16" in bad.stderr, bad.stderr
        assert not (tmp_path / "b").exists()
