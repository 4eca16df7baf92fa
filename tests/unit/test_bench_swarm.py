"""`demonet bench`'s mixed swarms without a lab: the flags and their checks, the slowdown, the swarm figures.

No namespaces and no processes: the flags are refused before anything starts, and the report reads hand-made runs.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from demonet.lab.evidence import Run, Swarm, slowdown
from demonet.lab.evidence.cli import main
from demonet.lab.evidence.report import _samples_per_step, mixed_table, swarm_figures
from demonet.lab.evidence.slowdown import ENV, gpt, slow_down


def test_a_swarm_has_one_link_and_one_slowdown_per_peer() -> None:
    swarm = Swarm.of(4, [100, 100, 100, 5], [1, 1, 1, 2])
    assert swarm.mixed and swarm.fastest == 100 and swarm.peers == 4
    assert swarm.fast() == Swarm((100.0,) * 3, (1.0,) * 3)
    assert swarm.label == "100,100,100,5 Mbit/s, slowdown 1,1,1,2"
    assert swarm.folder == "100-100-100-5mbit-1-1-1-2x"
    alike = Swarm.of(3, sweep=10)
    assert not alike.mixed and alike == Swarm.alike(10, 3) and alike.fast() == alike
    assert (alike.label, alike.folder) == ("10 Mbit/s", "10mbit")
    # a slow link alone, or a slowdown alone, makes a swarm mixed; the fast peers are those with neither
    assert Swarm.of(2, [100, 5]).fast() == Swarm((100.0,), (1.0,))
    assert Swarm.of(3, None, [1, 2, 1], sweep=50).fast() == Swarm((50.0, 50.0), (1.0, 1.0))


@pytest.mark.parametrize(("mbit", "slowdown", "message"), [
    ([100, 5], None, "--peer-mbit should have one value per peer (3), got 2"),
    (None, [1, 2, 1, 1], "--slowdown should have one value per peer (3), got 4"),
    ([100, 100, 0], None, "link speeds should be > 0"),
    (None, [1, 0.5, 1], "slowdowns should be >= 1"),
])
def test_a_bad_swarm_is_refused(mbit: list[float] | None, slowdown: list[float] | None, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Swarm.of(3, mbit, slowdown)


def test_a_swarm_without_a_fast_peer_has_no_fast_part() -> None:
    with pytest.raises(ValueError, match="no peer is both unslowed and on the fastest link"):
        Swarm.of(2, [100, 5], [2, 1]).fast()


@pytest.mark.parametrize(("argv", "message"), [
    (["--peers", "4", "--peer-mbit", "100,100,5"], "--peer-mbit should have one value per peer (4), got 3"),
    (["--peers", "2", "--slowdown", "1,2,2"], "--slowdown should have one value per peer (2), got 3"),
    (["--peers", "2", "--slowdown", "1,0.5"], "slowdowns should be >= 1"),
    (["--peers", "2", "--mbit", "100", "--peer-mbit", "100,5"], "--mbit (every peer alike) and --peer-mbit"),
    (["--peers", "2", "--peer-mbit", "100,5", "--slowdown", "2,1", "--systems", "demonet-fast-only"],
     "no peer is both unslowed and on the fastest link"),
])
def test_bad_swarm_flags_are_refused_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            argv: list[str], message: str) -> None:
    out = tmp_path / "bench"
    assert main(["--out", str(out), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--peer-mbit", "--slowdown"])
@pytest.mark.parametrize("value", ["100,-5", "1,x", ""])
def test_values_that_are_not_positive_numbers_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          flag: str, value: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(tmp_path / "bench"), "--peers", "2", flag, value])
    assert exited.value.code == 2 and "expected" in capsys.readouterr().err
    assert not (tmp_path / "bench").exists()


class _Sleepy(torch.nn.Module):
    """A forward that takes at least 30 ms (and a backward that takes next to nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03)
        return (self.w * x).sum()


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every `time.sleep` the slowdown asks for, in seconds (each still sleeps)."""
    calls: list[float] = []
    real = time.sleep

    def sleep(seconds: float) -> None:
        calls.append(seconds)
        real(seconds)

    monkeypatch.setattr(slowdown.time, "sleep", sleep)
    return calls


def test_a_slowdown_makes_each_forward_and_backward_take_that_many_times_as_long(slept: list[float]) -> None:
    plain, slowed = _Sleepy(), _Sleepy()
    slow_down(plain, 1.0)
    slow_down(slowed, 3.0)
    for _ in range(2):  # every backward, not the first only
        slept.clear()
        plain(torch.ones(3)).backward()
        assert slept == [0.03]  # the forward's own sleep, none added
        slept.clear()
        t0 = time.perf_counter()
        slowed(torch.ones(3)).backward()
        took_s = time.perf_counter() - t0
        assert slept[0] == 0.03 and len(slept) == 2 and slept[1] >= 2 * 0.03  # twice the forward and backward
        assert took_s >= 3 * 0.03
    assert slowed.w.grad is not None and torch.equal(slowed.w.grad, torch.full((3,), 2.0))  # gradients untouched
    with pytest.raises(ValueError, match="a slowdown should be >= 1, got 0.5"):
        slow_down(_Sleepy(), 0.5)


def test_the_slowdown_task_is_the_builtin_gpt_slowed_by_its_process_factor(monkeypatch: pytest.MonkeyPatch,
                                                                           slept: list[float]) -> None:
    model = {"vocab_size": 256, "seq_len": 16, "d_model": 32, "n_layers": 1, "n_heads": 2}
    monkeypatch.setenv(ENV, "4")
    task = gpt(batch_size=2, batch_seq_len=16, **model)
    x_BT, y_BT = next(task.batches(0))
    assert x_BT.shape == (2, 16)
    t0 = time.perf_counter()
    task.loss(task.model, (x_BT, y_BT)).backward()
    took_s = time.perf_counter() - t0
    # the sleep is 3x the forward and backward before it: the whole took at least 4/3 of the sleep
    assert len(slept) == 1 and 0 < slept[0] and took_s >= slept[0] * 4 / 3
    monkeypatch.delenv(ENV)
    slept.clear()
    plain = gpt(batch_size=2, batch_seq_len=16, **model)
    plain.loss(plain.model, (x_BT, y_BT)).backward()
    assert slept == []


def _records(times: list[float], **fields: Any) -> list[dict[str, Any]]:
    return [{"step": 0, "time": 0.0, "loss": math.nan}] + [
        {"step": i + 1, "time": t, "loss": 3.0, **fields} for i, t in enumerate(times)]


def test_swarm_figures_count_the_samples_and_each_peers_micro_batches(tmp_path: Path) -> None:
    fast = _records([1.0, 2.0, 4.0], samples=32, micro_batches=8)
    slow = _records([1.0, 2.0, 4.0], samples=8, micro_batches=2)
    slow[2]["aborted"] = True  # an aborted round's samples count for nothing
    run = Run("demonet", 100.0, tmp_path, peers=[fast, slow], peer_mbit=[100.0, 5.0], slowdown=[1.0, 2.0])
    assert _samples_per_step(run, batch_size=4) == 32 + 8  # a step's samples, the aborted one's among them
    figures = swarm_figures(run, batch_size=4)
    assert figures == {"samples_per_s": (3 * 32 + 2 * 8) / 4.0, "micro_batches": [8, 2]}
    # the baselines' records: one batch of batch_size a step, or the batches a hivemind step took
    ddp = Run("adamw-ddp", 100.0, tmp_path, peers=[_records([2.0]), _records([2.0], batches=3)])
    assert swarm_figures(ddp, batch_size=4) == {"samples_per_s": (4 + 12) / 2.0, "micro_batches": [1, 3]}


def test_the_mixed_table_shows_only_mixed_swarms() -> None:
    row = {"swarm": "100,5 Mbit/s, slowdown 1,2", "system": "demonet-lockstep", "peers": 2, "steps": 10,
           "samples_per_s": 12.34, "time_to_target_s": 20.5, "projected_time_to_target_s": 20.5, "loss_last": 3.1,
           "micro_batches": [1, 1], "mixed": True}
    table = mixed_table({"runs": [row, {**row, "swarm": "100 Mbit/s", "mixed": False}]})
    assert "| 100,5 Mbit/s, slowdown 1,2 | demonet-lockstep | 2 | 10 | 12.3 | 20.5 | 3.1000 | 1, 1 |" in table
    assert "| 100 Mbit/s |" not in table
    assert mixed_table({"runs": [{**row, "mixed": False}]}) == ""


def test_a_slowed_swarms_run_config_trains_the_builtin_model_from_the_same_weights(tmp_path: Path) -> None:
    from demonet.config import load_config
    from demonet.lab.evidence import BenchSetup, _run_toml
    from demonet.train.model import ModelConfig
    from demonet.train.task import build_task

    setup = BenchSetup(model=ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_layers=1, n_heads=2), peers=2,
                       seq_len=16)
    slowed, plain = tmp_path / "slowed", tmp_path / "plain"
    for out, swarm in ((slowed, Swarm.of(2, [100, 5], [1, 2])), (plain, Swarm.of(2, [100, 5]))):
        out.mkdir()
        _run_toml(out, setup, swarm, "fp32", ["lockstep = true"])
    cfg, base = load_config(slowed / "run.toml"), load_config(plain / "run.toml")
    assert cfg.train.task == "demonet.lab.evidence.slowdown:gpt" and not base.train.task and cfg.net.lockstep
    task, builtin = build_task(cfg), build_task(base)
    assert all(torch.equal(a, b) for a, b in zip(task.model.parameters(), builtin.model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(next(task.batches(3)), next(builtin.batches(3)), strict=True))
