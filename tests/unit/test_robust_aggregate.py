"""Median-norm clipping before the merge: poisoned updates are bounded, honest ones untouched."""

import pytest
import torch

from demonet.config import NetConfig
from demonet.optim import Compressed, Payload, aggregate, clip_to_median_norm, payload_norm


def _payload(g: torch.Generator, scale: float = 1.0) -> Payload:
    tensors = {}
    for name, rows, chunk in (("w", 6, (4, 4)), ("b", 2, (1, 8))):
        n = chunk[0] * chunk[1]
        idx = torch.stack([torch.randperm(n, generator=g)[:3] for _ in range(rows)])
        tensors[name] = Compressed(idx=idx, val=torch.randn(rows, 3, generator=g) * scale, shape=(rows * n,),
                                   chunk=chunk)
    return Payload(tensors=tensors)


def _dense(p: Payload) -> torch.Tensor:
    return torch.cat([torch.zeros(c.idx.shape[0], c.totalk).scatter_add_(1, c.idx, c.val).flatten()
                      for c in p.tensors.values()])


def test_norm_is_the_l2_of_all_values() -> None:
    p = Payload(tensors={"a": Compressed(idx=torch.tensor([[0, 1]]), val=torch.tensor([[3.0, 0.0]]), shape=(4,),
                                         chunk=(1, 4)),
                         "b": Compressed(idx=torch.tensor([[2]]), val=torch.tensor([[4.0]]), shape=(4,), chunk=(1, 4))})
    assert payload_norm(p) == 5.0


def test_payloads_above_the_median_are_scaled_to_it_the_rest_untouched() -> None:
    g = torch.Generator().manual_seed(0)
    honest = [_payload(g) for _ in range(4)]
    poisoned = _payload(g, scale=1000.0)
    payloads = [honest[0], poisoned, *honest[1:]]
    clipped, factors = clip_to_median_norm(payloads)
    norms = sorted(payload_norm(p) for p in payloads)
    median = norms[2]  # five payloads: the middle one
    for before, after, factor in zip(payloads, clipped, factors, strict=True):
        if payload_norm(before) <= median:
            assert after is before and factor == 1.0
        else:
            assert factor < 1.0
            assert payload_norm(after) == pytest.approx(median, rel=1e-5)
    assert factors[1] < 1e-2  # the poisoned one


def test_two_payloads_use_the_lower_norm() -> None:
    g = torch.Generator().manual_seed(1)
    a, b = _payload(g), _payload(g, scale=10.0)
    (ca, cb), _ = clip_to_median_norm([a, b])
    assert ca is a and payload_norm(cb) == pytest.approx(payload_norm(a), rel=1e-5)


def test_a_poisoned_payload_barely_moves_the_clipped_aggregate() -> None:
    g = torch.Generator().manual_seed(2)
    honest = [_payload(g) for _ in range(4)]
    reference = _dense(aggregate(honest))
    for poison in (_payload(g, scale=1000.0), _payload(g, scale=1e5)):
        with_poison = [*honest, poison]
        off = (_dense(aggregate(with_poison)) - reference).norm()
        on = (_dense(aggregate(with_poison, clip=True)) - reference).norm()
        assert on < 2 * reference.norm()  # bounded by the honest scale, whatever the poison's
        assert off > 50 * on
    assert torch.equal(_dense(aggregate(honest, clip=False)), reference)  # off: the plain merge


def test_clipping_is_deterministic_and_a_single_payload_passes() -> None:
    g = torch.Generator().manual_seed(3)
    payloads = [_payload(g, scale=s) for s in (1.0, 7.0, 0.5, 300.0)]
    a, b = aggregate(payloads, clip=True), aggregate(payloads, clip=True)
    for name in a.tensors:
        assert torch.equal(a.tensors[name].val, b.tensors[name].val)
        assert torch.equal(a.tensors[name].idx, b.tensors[name].idx)
    assert aggregate(payloads[:1], clip=True) is payloads[0]


def test_config_defaults_and_bounds() -> None:
    cfg = NetConfig()
    assert cfg.clip_to_median_norm and cfg.max_payload_norm > 0
    with pytest.raises(ValueError, match="max_payload_norm"):
        NetConfig(max_payload_norm=-1.0)
