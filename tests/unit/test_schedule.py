"""The learning-rate schedule: warmup, constant, cosine; a pure function of the round, the same bits everywhere;
its `[optim]` settings and their validation."""

import math
import struct
from pathlib import Path

import pytest

from demonet.config import load_config
from demonet.optim import LrSchedule


def _f32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def test_warmup_is_linear_then_constant() -> None:
    s = LrSchedule(lr=1e-3, warmup_rounds=4)
    assert [s(r) for r in range(4)] == [_f32(1e-3 * (r + 1) / 4) for r in range(4)]
    assert s(0) == _f32(2.5e-4)  # a small fraction first
    assert s(3) == s(4) == s(1000) == _f32(1e-3)  # lr at the last warmup round, then constant


def test_no_warmup_constant_is_lr_in_float32() -> None:
    s = LrSchedule(lr=3e-3)
    assert {s(r) for r in range(50)} == {_f32(3e-3)}


def test_cosine_decays_to_lr_min_and_stays() -> None:
    lr, lr_min = 1e-3, 1e-4
    s = LrSchedule(lr=lr, warmup_rounds=2, schedule="cosine", lr_min=lr_min, decay_rounds=10)
    assert s(2) == _f32(lr)  # the cosine starts at lr
    assert s(12) == s(13) == s(10_000) == _f32(lr_min)  # ends at lr_min and stays
    assert s(7) == _f32((lr + lr_min) / 2)  # half way: cos(pi/2) = 0
    values = [s(r) for r in range(2, 13)]
    assert all(a > b for a, b in zip(values, values[1:], strict=False))  # strictly decreasing
    for r in range(2, 13):
        want = lr_min + (lr - lr_min) * (1 + math.cos(math.pi * (r - 2) / 10)) / 2
        assert s(r) == pytest.approx(want, rel=1e-7)


def test_a_pure_function_of_the_round() -> None:
    def make() -> LrSchedule:
        return LrSchedule(lr=3e-3, warmup_rounds=10, schedule="cosine", lr_min=3e-4, decay_rounds=190)

    forward = [make()(r) for r in range(200)]
    s = make()
    backward = [s(r) for r in reversed(range(200))][::-1]
    assert forward == backward == [s(r) for r in range(200)]  # no state: the order of calls does not matter
    assert all(_f32(x) == x for x in forward)  # float32 numbers: the apply multiplies by them exactly


def test_values_are_pinned_bits() -> None:
    """Computed in decimal arithmetic (no libm): these bits on every machine. A change of the formula or
    of its arithmetic (e.g. math.cos) must show here."""
    s = LrSchedule(lr=3e-3, warmup_rounds=10, schedule="cosine", lr_min=3e-4, decay_rounds=190)
    got = {r: s(r).hex() for r in (0, 4, 9, 10, 11, 57, 100, 150, 199, 200)}
    assert got == {
        0: "0x1.3a92a40000000p-12", 4: "0x1.89374c0000000p-10", 9: "0x1.89374c0000000p-9",
        10: "0x1.89374c0000000p-9", 11: "0x1.89311a0000000p-9", 57: "0x1.566b640000000p-9",
        100: "0x1.cdc3100000000p-10", 150: "0x1.81b3f00000000p-11", 199: "0x1.3ac42c0000000p-12",
        200: "0x1.3a92a40000000p-12",
    }


def test_from_settings_decays_over_the_rest_of_the_run() -> None:
    cfg = load_config(None, {}, {"optim": {"warmup_rounds": 5, "schedule": "cosine", "lr_min": 1e-4},
                                 "train": {"steps": 45}})
    s = LrSchedule.from_settings(cfg.optim, cfg.train.steps)
    assert s.decay_rounds == 40
    assert s(4) == _f32(cfg.optim.lr) and s(45) == _f32(1e-4) and s(44) > s(45)
    fixed = LrSchedule.from_settings(load_config(None, {}, {"optim": {"decay_rounds": 7}}).optim, 200)
    assert fixed.decay_rounds == 7


def test_the_default_is_the_constant_lr() -> None:
    """No warmup by default (docs/benchmarks.md, Learning-rate warmup): the lr of every round is lr."""
    cfg = load_config(None, {})
    s = LrSchedule.from_settings(cfg.optim, cfg.train.steps)
    assert {s(r) for r in range(cfg.train.steps + 5)} == {_f32(cfg.optim.lr)}


@pytest.mark.parametrize(("toml", "env", "message"), [
    ("[optim]\nwarmup_rounds = -1\n", {}, "warmup_rounds should be an int >= 0, got -1"),
    ("[optim]\nschedule = 'linear'\n", {}, r"schedule should be one of \('constant', 'cosine'\), got 'linear'"),
    ("[optim]\nlr = 1e-3\nlr_min = 2e-3\n", {}, r"lr_min should be in \[0, lr\]"),
    ("[optim]\nlr_min = -1e-5\n", {}, r"lr_min should be in \[0, lr\]"),
    ("[optim]\ndecay_rounds = -3\n", {}, "decay_rounds should be an int >= 0, got -3"),
    ("", {"DEMONET_OPTIM_WARMUP_ROUNDS": "ten"}, "optim.warmup_rounds should be a int"),
    ("[train]\nprecision = 'fp16'\n", {}, r"precision should be one of \('fp32', 'bf16'\), got 'fp16'"),
    ("[train]\nmax_grad_norm = -1.0\n", {}, "max_grad_norm should be >= 0"),
    ("", {"DEMONET_TRAIN_MAX_GRAD_NORM": "nan"}, "max_grad_norm should be >= 0"),
])
def test_bad_settings_are_clear_errors(tmp_path: Path, toml: str, env: dict[str, str], message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ValueError, match=message):
        load_config(path, env)


def test_settings_from_toml_and_env(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[optim]\nwarmup_rounds = 0\nschedule = 'cosine'\nlr_min = 1e-4\n[train]\nprecision = 'bf16'\n")
    cfg = load_config(path, {"DEMONET_OPTIM_DECAY_ROUNDS": "50", "DEMONET_TRAIN_MAX_GRAD_NORM": "1.5"})
    assert (cfg.optim.warmup_rounds, cfg.optim.schedule, cfg.optim.lr_min, cfg.optim.decay_rounds) == (
        0, "cosine", 1e-4, 50)
    assert (cfg.train.precision, cfg.train.max_grad_norm) == ("bf16", 1.5)


@pytest.mark.parametrize("kwargs", [
    {"lr": 0.0}, {"lr": 1e-3, "warmup_rounds": -1}, {"lr": 1e-3, "schedule": "step"},
    {"lr": 1e-3, "lr_min": 1.0}, {"lr": 1e-3, "decay_rounds": 0},
])
def test_bad_schedules_raise(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="should be"):
        LrSchedule(**kwargs)  # type: ignore[arg-type]


def test_negative_round_raises() -> None:
    with pytest.raises(ValueError, match="round should be >= 0"):
        LrSchedule(lr=1e-3)(-1)
