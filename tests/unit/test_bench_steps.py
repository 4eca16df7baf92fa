"""`demonet bench`'s time axis: step records from the peers' metrics rows, and the curve made of them.

No lab and no processes: hand-written metrics-<peer>.jsonl and steps-<rank>.jsonl files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from demonet.lab.evidence import Run, _demonet_steps, _read_steps
from demonet.lab.evidence.report import curve


def _row(round: int, time: float, loss: float, round_time_s: float = 1.0) -> dict[str, Any]:
    """A coordinator-mode peer's metrics row, with the fields the bench does not read too."""
    return {"round": round, "peer": "p", "loss": loss, "bytes_up": 10, "bytes_down": 12, "param_digest": "d",
            "round_time_s": round_time_s, "compute_s": 0.1, "wait_s": 0.0, "time": time, "contributors": 2,
            "aborted": False, "resyncs": 0}


def _write(path: Path, rows: list[dict[str, Any]], tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_demonet_rows_become_steps_and_the_curve_starts_when_the_last_peer_trains(tmp_path: Path) -> None:
    _write(tmp_path / "metrics-peer-0.jsonl",
           [_row(0, 1000.5, 5.0, round_time_s=0.5), _row(1, 1001.5, 4.0), _row(2, 1002.5, 3.0)])
    # peer 1 starts later (1000.1) and finishes last; its file ends in a row still being written
    _write(tmp_path / "metrics-peer-1.jsonl",
           [_row(0, 1000.7, 7.0, round_time_s=0.6), _row(1, 1001.6, 6.0), _row(2, 1002.9, 5.0)],
           tail='{"round": 3, "peer": "p", "lo')

    peers = _demonet_steps(tmp_path, 3)  # no file for peer 2 (yet)
    assert [[(r["step"], r["time"]) for r in records] for records in peers[:2]] == [
        [(0, pytest.approx(1000.0)), (1, 1000.5), (2, 1001.5), (3, 1002.5)],
        [(0, pytest.approx(1000.1)), (1, 1000.7), (2, 1001.6), (3, 1002.9)],
    ]
    assert peers[2] == [] and math.isnan(peers[0][0]["loss"]) and peers[1][3]["loss"] == 5.0

    steps, times, losses = curve(Run("demonet", 100.0, tmp_path, peers=peers[:2]))
    assert steps == [1, 2, 3]
    assert times == pytest.approx([0.6, 1.5, 2.8])  # the last peer done with each step, from 1000.1
    assert losses == [6.0, 5.0, 4.0]


def test_baseline_steps_carry_time_too(tmp_path: Path) -> None:
    for rank, start in enumerate((10.0, 10.5)):
        _write(tmp_path / f"steps-{rank}.jsonl", [{"step": 0, "time": start, "loss": math.nan, "batches": 1},
                                                  {"step": 1, "time": start + 2, "loss": 2.0 + rank, "batches": 1}])
    steps, times, losses = curve(Run("adamw-ddp", 100.0, tmp_path, peers=_read_steps(tmp_path, 2)))
    assert (steps, times, losses) == ([1], [pytest.approx(2.0)], [2.5])
