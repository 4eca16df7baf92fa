"""Unit tests for demonet.train.model: shapes, initial loss, determinism, config validation."""

from __future__ import annotations

import math

import pytest
import torch

from demonet.train.model import BENCH_MODEL, GPT, TINY_MODEL, ModelConfig

SMALL = ModelConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4)


def test_forward_shapes_and_loss() -> None:
    torch.manual_seed(0)
    model = GPT(SMALL)
    idx_BT = torch.randint(0, 256, (3, 16))
    logits_BTV, loss = model(idx_BT)
    assert logits_BTV.shape == (3, 16, 256)
    assert loss is None
    _, loss = model(idx_BT[:, :10], torch.randint(0, 256, (3, 10)))
    assert loss is not None and loss.shape == ()


def test_initial_loss_is_near_uniform() -> None:
    torch.manual_seed(0)
    model = GPT(TINY_MODEL)
    idx_BT = torch.randint(0, 256, (4, TINY_MODEL.seq_len))
    targets_BT = torch.randint(0, 256, (4, TINY_MODEL.seq_len))
    _, loss = model(idx_BT, targets_BT)
    assert loss is not None
    assert abs(loss.item() - math.log(256)) < 0.15


def test_init_is_deterministic_from_global_seed() -> None:
    torch.manual_seed(123)
    a = GPT(SMALL)
    torch.manual_seed(123)
    b = GPT(SMALL)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_init_std_and_residual_scaling() -> None:
    torch.manual_seed(0)
    model = GPT(TINY_MODEL)
    fc_std = model.get_parameter("blocks.0.mlp.fc.weight").std().item()
    proj_std = model.get_parameter("blocks.0.mlp.proj.weight").std().item()
    assert fc_std == pytest.approx(0.02, rel=0.05)
    assert proj_std == pytest.approx(0.02 / math.sqrt(2 * TINY_MODEL.n_layers), rel=0.05)
    assert torch.count_nonzero(model.get_parameter("blocks.0.attn.qkv.bias")) == 0


def test_weight_tying_and_param_count() -> None:
    tied = GPT(SMALL)
    untied = GPT(ModelConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4, tie_weights=False))
    assert tied.head.weight is tied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == 256 * 32
    assert tied.num_params() == sum(p.numel() for p in tied.parameters())


def test_backward_reaches_every_parameter() -> None:
    model = GPT(SMALL)
    _, loss = model(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    assert loss is not None
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def _expected_num_params(cfg: ModelConfig) -> int:
    d = cfg.d_model
    per_block = (4 + 2 * cfg.mlp_ratio) * d * d + (9 + cfg.mlp_ratio) * d  # weights, biases, 2 LayerNorms
    head = 0 if cfg.tie_weights else cfg.vocab_size * d
    return (cfg.vocab_size + cfg.seq_len) * d + cfg.n_layers * per_block + 2 * d + head


def test_param_count_formula_and_bench_size() -> None:
    assert GPT(TINY_MODEL).num_params() == _expected_num_params(TINY_MODEL)
    # The bench model's size from the same formula, without building it (~11M as advertised).
    assert 10_000_000 < _expected_num_params(BENCH_MODEL) < 12_000_000


def test_too_long_sequence_raises() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        GPT(SMALL)(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"seq_len": -1}, "seq_len"),
        ({"d_model": 30, "n_heads": 4}, "d_model"),
        ({"n_layers": 0}, "n_layers"),
        ({"mlp_ratio": 1.5}, "mlp_ratio"),
        ({"tie_weights": 1}, "tie_weights"),
    ],
)
def test_config_validation(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} should be"):
        ModelConfig(**kwargs)  # type: ignore[arg-type]
