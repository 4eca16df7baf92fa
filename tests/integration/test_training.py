"""A short run of the local cluster on the embedded corpus: the loss must clearly fall."""

import json
from pathlib import Path

import pytest
import torch

from demonet.config import load_config
from demonet.loop.local import run_local

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


def _tiny(tmp_path: Path, optim: dict[str, object], train: dict[str, object]) -> dict[str, object]:
    cfg = load_config(None, {}, {
        "model": {"seq_len": 32, "d_model": 32, "n_layers": 1, "n_heads": 2},
        "optim": {"compression_chunk": 16, "compression_topk": 4, **optim},
        "train": {"peers": 2, "steps": 12, "batch_size": 2, "seq_len": 32, "eval_every": 0, "out": str(tmp_path),
                  **train}})
    return run_local(cfg, progress=False)


def test_peers_and_coordinator_stay_bit_identical_under_a_schedule(tmp_path: Path) -> None:
    """Every round's apply uses lr(round) at the coordinator and at every peer: no peer's digest ever differs
    from the canonical one (it would resync). bf16 and clipping change each peer's payload, not the apply."""
    torch.set_num_threads(2)
    scheduled = _tiny(tmp_path / "a", {"warmup_rounds": 3, "schedule": "cosine", "lr_min": 1e-4},
                      {"precision": "bf16", "max_grad_norm": 0.5})
    plain = _tiny(tmp_path / "b", {"warmup_rounds": 0}, {})
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 12
    # a peer that applied another lr than the coordinator would download the parameters (a resync)
    assert all(r["param_digest"] == r["canonical_digest"] and r["resyncs"] == 0 for r in rows)
    assert scheduled["param_digest"] != plain["param_digest"]
