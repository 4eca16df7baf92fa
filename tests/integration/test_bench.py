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


def _peak_mbit(samples: list[tuple[float, int, int]], window_s: float = 1.0) -> float:
    """The most Mbit/s a link received over any `window_s` or more between two of its counter samples."""
    rates = [(rx1 - rx0) * 8 / (t1 - t0) / 1e6 for i, (t0, _, rx0) in enumerate(samples)
             for t1, _, rx1 in samples[i + 1:] if t1 - t0 >= window_s]
    return max(rates, default=math.nan)


@pytest.mark.timeout(300)
def test_a_mixed_swarm_shapes_each_link_and_runs_lockstep_automatic_and_fast_only(tmp_path: Path) -> None:
    from demonet.lab.evidence import BenchSetup, Swarm, run_system
    from demonet.lab.evidence.report import mixed_table, summarize
    from demonet.train.model import ModelConfig

    # 0.82M parameters: the slow peer's 3.3 MB parameter download holds its 5 Mbit/s link for 5 s, the fast
    # one's takes a third of a second.
    setup = BenchSetup(model=ModelConfig(vocab_size=256, seq_len=32, d_model=128, n_layers=4, n_heads=4), peers=2,
                       steps=4, seq_len=32, max_time_s=120)
    swarm = Swarm.of(2, [100, 5], [1, 2])
    runs = [run_system(SYSTEMS[name], setup, swarm, tmp_path / name)
            for name in ("demonet", "demonet-lockstep", "demonet-fast-only")]
    for run in runs:
        assert run.finished, (run.system, sorted(p.name for p in (run.out / "logs").iterdir()))
    auto, lockstep, fast = runs
    for run in (auto, lockstep):
        assert len(run.peers) == 2 and run.peer_hosts == ["dn0", "dn1"]
        slow_mbit, fast_mbit = _peak_mbit(run.samples["dn1"]), _peak_mbit(run.samples["dn0"])
        assert slow_mbit <= 5 * 1.15, (run.system, slow_mbit)  # tbf holds the slow peer's link to 5 Mbit/s
        assert fast_mbit > 2 * 5, (run.system, fast_mbit)
    # lockstep: one micro-batch a round, every peer, every round
    assert all(r["micro_batches"] == 1 for rs in lockstep.peers for r in rs if r["step"] > 0)
    assert all(r["micro_batches"] >= 1 and r["samples"] >= 4 for rs in auto.peers for r in rs if r["step"] > 0)
    assert len(fast.peers) == 1 and fast.peer_hosts == ["dn0"] and fast.swarm == swarm  # the fast peer alone

    summary = summarize(runs, setup)
    assert [r["swarm"] for r in summary["runs"]] == ["100,5 Mbit/s, slowdown 1,2"] * 3
    for row in summary["runs"]:
        assert row["mixed"] and row["samples_per_s"] > 0, row
    table = mixed_table(summary)
    assert "| 100,5 Mbit/s, slowdown 1,2 | demonet-lockstep | 2 | 4 |" in table and "| 1, 1 |" in table
