"""A short run of the local cluster on the embedded corpus: the loss must clearly fall."""

from pathlib import Path

import pytest
import torch

from demonet.config import load_config
from demonet.train.local import run_local

pytestmark = pytest.mark.slow


def test_tiny_model_learns_the_default_corpus(tmp_path: Path) -> None:
    torch.set_num_threads(2)
    cfg = load_config(None, {}, {"train": {"peers": 2, "steps": 60, "out": str(tmp_path), "eval_every": 60}})
    summary = run_local(cfg, progress=False)
    # ln(256) = 5.55 is a uniform guess over bytes; a byte model that learned nothing stays near it.
    assert summary["first_loss"] > 3.9
    assert summary["last_loss"] < summary["first_loss"] - 0.6
    assert summary["val_loss"][60] < 3.6
    assert summary["bytes_up_per_round"] < summary["dense_fp32_bytes"] / 20
