"""`demonet coordinator --steps`: 0 means a run without end (it used to fall back to train.steps)."""

import argparse

import pytest

from demonet.config import load_config
from demonet.coordinator import add_arguments, total_rounds


def _steps(*argv: str) -> int | None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv)).steps


def test_steps_zero_is_no_end_and_absent_is_train_steps() -> None:
    cfg = load_config(None, {}, {"train": {"steps": 37}})
    assert total_rounds(_steps("--steps", "0"), cfg) == 0
    assert total_rounds(_steps(), cfg) == 37
    assert total_rounds(_steps("--steps", "5"), cfg) == 5
    with pytest.raises(ValueError, match="steps"):
        total_rounds(-1, cfg)
