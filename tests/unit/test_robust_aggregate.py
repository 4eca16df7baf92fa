"""Median-norm clipping in the merge the coordinator runs (`aggregate_clipped`, `aggregate(..., clip=True)`):
poisoned updates are bounded, honest ones untouched."""

import pytest
import torch

from demonet.config import NetConfig
from demonet.optim import Compressed, Payload, aggregate, aggregate_clipped, payload_norm


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
    _, factors = aggregate_clipped(payloads, topk=3, clip=True)
    norms = [payload_norm(p) for p in payloads]
    median = sorted(norms)[2]  # five payloads: the middle one
    for norm, factor in zip(norms, factors, strict=True):
        if norm <= median:
            assert factor == 1.0
        else:
            assert factor * norm == pytest.approx(median, rel=1e-6)  # its norm scaled to the median
    assert factors[1] < 1e-2  # the poisoned one
    assert sum(f < 1.0 for f in factors) == 2  # the two above the median
    _, unclipped = aggregate_clipped(payloads, topk=3, clip=False)
    assert unclipped == [1.0] * 5


def _one_chunk(w: tuple[int, float], b: tuple[int, float]) -> Payload:
    """One entry (index, value) in each of two tensors of other chunk shapes (merged in separate blocks)."""
    return Payload(tensors={
        "w": Compressed(idx=torch.tensor([[w[0]]]), val=torch.tensor([[w[1]]]), shape=(4,), chunk=(1, 4)),
        "b": Compressed(idx=torch.tensor([[b[0]]]), val=torch.tensor([[b[1]]]), shape=(8,), chunk=(1, 8))})


def test_the_clipped_aggregate_by_hand() -> None:
    # Norms over both tensors together: 5 (3, 4), 10 (8, 6) and 40 (24, 32). The median is 10, so the
    # third is scaled by 1/4 to (6, 8); the first two are untouched. Each coefficient is then the mean
    # of the peers that sent it. (Over w alone the norms would be 3, 8, 24: another factor.)
    payloads = [_one_chunk((0, 3.0), (0, 4.0)), _one_chunk((1, 8.0), (1, 6.0)), _one_chunk((0, 24.0), (2, 32.0))]
    merged, factors = aggregate_clipped(payloads, clip=True)
    assert factors == [1.0, 1.0, 0.25]
    assert _dense(merged).tolist() == [4.5, 8.0, 0.0, 0.0] + [4.0, 6.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert _dense(aggregate(payloads, clip=True)).tolist() == _dense(merged).tolist()
    plain = [13.5, 8.0, 0.0, 0.0] + [4.0, 6.0, 32.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # without clipping
    assert _dense(aggregate_clipped(payloads, clip=False)[0]).tolist() == plain


def test_two_payloads_use_the_lower_norm() -> None:
    # Norms 5 and 10: with an even count the median is the lower middle one, so the second is halved.
    payloads = [_one_chunk((0, 3.0), (0, 4.0)), _one_chunk((1, 8.0), (1, 6.0))]
    merged, factors = aggregate_clipped(payloads, clip=True)
    assert factors == [1.0, 0.5]
    assert _dense(merged).tolist() == [3.0, 4.0, 0.0, 0.0] + [4.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


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
