"""The one merge of the coordinator and the DHT slice owners: rules, the norm bound, clipping, the bytes."""

from typing import Any

import pytest
import torch

from demonet import wire
from demonet.config import load_config
from demonet.errors import InvalidPayload
from demonet.optim import Compressed, Payload
from demonet.wire.merge import MergeRules, decode_contribution, merge

SPECS = {"w": ((8, 8), (4, 4)), "b": ((8,), (1, 8))}


def _payload(seed: int, scale: float = 1.0, specs: dict[str, Any] = SPECS) -> Payload:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (shape, chunk) in specs.items():
        rows = 4 if name.startswith("w") else 1
        n = chunk[0] * chunk[1]
        idx = torch.stack([torch.randperm(n, generator=g)[:3] for _ in range(rows)])
        tensors[name] = Compressed(idx=idx, val=torch.randn(rows, 3, generator=g) * scale, shape=shape, chunk=chunk)
    return Payload(tensors=tensors)


def test_rules_come_from_the_run_config_and_refuse_bad_values() -> None:
    cfg = load_config(None, {}, overrides={"optim": {"compression_topk": 7},
                                           "net": {"aggregate_encoding": "fp16", "clip_to_median_norm": False,
                                                   "max_payload_norm": 0.0}})
    assert MergeRules.from_config(cfg) == MergeRules(topk=7, encoding="fp16", clip=False, max_norm=None, min_k=1,
                                                     max_k=7)  # the floor: 7 / 8, rounded up
    with pytest.raises(ValueError, match="topk"):
        MergeRules(topk=0)
    with pytest.raises(ValueError, match="min_k"):
        MergeRules(topk=4, min_k=5, max_k=4)
    with pytest.raises(ValueError, match="encoding"):
        MergeRules(topk=4, encoding="int8")


def test_a_contribution_above_the_norm_bound_is_refused() -> None:
    data = wire.encode(_payload(0, scale=100.0), step=3)
    rules = MergeRules(topk=4, max_norm=10.0)
    with pytest.raises(InvalidPayload, match="exceeds the bound"):
        decode_contribution(data, expected=SPECS, rules=rules)
    step, payload = decode_contribution(data, expected=SPECS, rules=MergeRules(topk=4, max_norm=1e4))
    assert step == 3 and list(payload.tensors) == list(SPECS)


def test_merge_clips_a_poisoner_and_serves_what_it_applies() -> None:
    honest = [_payload(s) for s in (1, 2, 3)]
    poisoned = _payload(4, scale=1000.0)
    rules = MergeRules(topk=6, encoding="bf16")
    merged = merge([honest[0], poisoned, *honest[1:]], step=5, rules=rules, expected=SPECS)
    assert merged.factors[1] < 0.01  # the poisoner, scaled to the median (the lower middle of four)
    assert sorted(merged.factors)[-2:] == [1.0, 1.0] and min(merged.factors[i] for i in (0, 2, 3)) > 0.5
    # What the merger applies is exactly what a peer decodes from the bytes it serves.
    step, decoded = wire.decode(merged.data, expected=SPECS)
    assert step == 5
    for name in SPECS:
        assert torch.equal(decoded.tensors[name].val, merged.payload.tensors[name].val)
        assert torch.equal(decoded.tensors[name].idx, merged.payload.tensors[name].idx)
        assert merged.payload.tensors[name].k <= rules.topk
    # bf16 on the wire: every value is a bfloat16.
    vals = torch.cat([c.val.flatten() for c in merged.payload.tensors.values()])
    assert torch.equal(vals, vals.to(torch.bfloat16).float())
    # Without clipping the poisoner dominates the aggregate; with it, it weighs no more than the median.
    loud = merge([honest[0], poisoned, *honest[1:]], step=5, rules=MergeRules(topk=6, clip=False), expected=SPECS)
    norm = lambda p: float(torch.cat([c.val.flatten() for c in p.tensors.values()]).norm())  # noqa: E731
    assert norm(loud.payload) > 50 * norm(merged.payload)


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("topk", [2, 6, 16])
def test_what_the_merger_applies_is_bit_identical_to_what_peers_decode(encoding: str, topk: int) -> None:
    """`merge` does not decode its own bytes; its payload must still be what `wire.decode` gives, bit for bit.

    topk 16 exceeds the senders' distinct indices per row, so rows carry zero padding (repeated indices).
    """
    payloads = [_payload(s, scale=10.0 ** (s % 3 - 1)) for s in range(5)]
    payloads[2].tensors["w"].val[0, 0] = -0.0  # a signed zero travels as such
    merged = merge(payloads, step=9, rules=MergeRules(topk=topk, encoding=encoding), expected=SPECS)
    step, decoded = wire.decode(merged.data, expected=SPECS)
    assert step == 9 and decoded.encoding == merged.payload.encoding == encoding
    assert list(decoded.tensors) == list(merged.payload.tensors) == list(SPECS)
    for name, want in decoded.tensors.items():
        got = merged.payload.tensors[name]
        assert got.idx.dtype == want.idx.dtype == torch.int64 and torch.equal(got.idx, want.idx), name
        assert got.val.dtype == want.val.dtype == torch.float32
        assert torch.equal(got.val.view(torch.int32), want.val.view(torch.int32)), name
        assert (got.shape, got.chunk) == (want.shape, want.chunk)
        assert (got.scale is None) == (want.scale is None)
        if want.scale is not None:
            assert got.scale is not None and got.scale.shape == want.scale.shape
            assert torch.equal(got.scale.view(torch.int32), want.scale.view(torch.int32))


def test_values_rounded_a_block_at_a_time_are_the_bits_of_rounding_each_merged_tensor() -> None:
    """`aggregate_clipped(rounding=...)` (what `merge` uses for bf16 and fp32) rounds each block of tensors
    merged together in one call: the same bits as rounding each merged tensor on its own."""
    from demonet.optim import aggregate_clipped, quantize

    specs = {**SPECS, "w2": ((8, 8), (4, 4)), "b2": ((8,), (1, 8))}  # two tensors for each chunk shape
    payloads = [_payload(s, specs=specs) for s in range(4)]
    plain, factors = aggregate_clipped(payloads, topk=4, clip=True)
    rounded, same = aggregate_clipped(payloads, topk=4, clip=True,
                                      rounding=lambda v: quantize(v.float(), "bf16")[0])
    assert same == factors and list(rounded.tensors) == list(specs)
    for name, c in plain.tensors.items():
        want = quantize(c.val.float(), "bf16")[0]
        got = rounded.tensors[name]
        assert torch.equal(got.idx, c.idx) and torch.equal(got.val.view(torch.int32), want.view(torch.int32)), name
        assert not torch.equal(want, c.val), name  # the rounding did something



def _dense(c: Compressed) -> torch.Tensor:
    """A tensor's coefficients as a dense (rows, n) matrix, 0 where none was sent (a padding entry adds 0)."""
    n = c.chunk[0] * c.chunk[1]
    return torch.zeros(c.idx.shape[0], n, dtype=torch.float64).scatter_add_(1, c.idx, c.val.double())  # padding: 0


def test_the_weighted_merge_is_the_samples_weighted_mean_of_each_coefficients_senders() -> None:
    """Against a dense weighted mean computed on its own: each coefficient is sum(w_i v_i) / sum(w_i) over the
    payloads that sent it (0 where none did), in float64."""
    from demonet.optim import aggregate_clipped

    payloads = [_payload(s) for s in (1, 2, 3)]
    weights = [4.0, 1.0, 2.0]
    merged, _ = aggregate_clipped(payloads, clip=False, weights=weights)
    for name in SPECS:
        sums = sum(w * _dense(p.tensors[name]) for p, w in zip(payloads, weights, strict=True))
        norms = sum(w * (_dense(p.tensors[name]) != 0).double() for p, w in zip(payloads, weights, strict=True))
        expected = torch.where(norms > 0, sums / norms.clamp(min=1e-300), torch.zeros_like(sums))
        got = _dense(merged.tensors[name])
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-7), name
    unweighted, _ = aggregate_clipped(payloads, clip=False)
    ones, _ = aggregate_clipped(payloads, clip=False, weights=[1.0, 1.0, 1.0])
    for name in SPECS:  # weights of 1 are the unweighted merge, to the bit
        assert torch.equal(ones.tensors[name].val, unweighted.tensors[name].val)
        assert torch.equal(ones.tensors[name].idx, unweighted.tensors[name].idx)
    with pytest.raises(ValueError, match="one positive number per payload"):
        aggregate_clipped(payloads, weights=[1.0, 0.0, 1.0])


def test_sample_weights_cap_a_claim_at_a_multiple_of_the_others_median() -> None:
    from demonet.wire.merge import sample_weights

    assert sample_weights([8, 8, 2], 16.0) == ([8.0, 8.0, 2.0], [False, False, False])
    weights, capped = sample_weights([10**9, 8, 8, 2], 16.0)
    assert weights == [128.0, 8.0, 8.0, 2.0] and capped == [True, False, False, False]  # 16 x median(8, 8, 2)
    assert sample_weights([5], 16.0) == ([5.0], [False])  # alone: no others to compare with


def test_a_payload_claiming_a_billion_samples_does_not_dominate_the_merge() -> None:
    """Four peers with similar payloads; one claims 10^9 samples and sends a payload of its own direction:
    capped at 16 times the median of the others' samples, it moves the mean by at most its capped share."""
    honest = [_payload(1, 1.0) for _ in range(3)]
    liar = _payload(9, 1.0)
    rules = MergeRules(topk=64, encoding="fp32", clip=False)
    expected = {n: (tuple(s), c) for n, (s, c) in SPECS.items()}
    merged = merge([*honest, liar], step=0, rules=rules, expected=expected, samples=[8, 8, 8, 10**9])
    assert merged.weights == (8.0, 8.0, 8.0, 128.0) and merged.capped == (False, False, False, True)
    equal = merge([*honest, liar], step=0, rules=rules, expected=expected, samples=[8, 8, 8, 8])
    unweighted = merge([*honest, liar], step=0, rules=rules, expected=expected)
    assert unweighted.weights == () and torch.equal(equal.payload.tensors["w"].val, unweighted.payload.tensors["w"].val)
    twelve = merge([*honest, liar], step=0, rules=rules, expected=expected, samples=[12, 12, 12, 12])
    assert twelve.data == unweighted.data  # equal samples merge as unweighted, whatever the count: the same bytes
    off = merge([*honest, liar], step=0, rules=MergeRules(topk=64, encoding="fp32", clip=False, max_sample_ratio=0),
                expected=expected, samples=[8, 8, 8, 10**9])
    assert off.weights == () and torch.equal(off.payload.tensors["w"].val, unweighted.payload.tensors["w"].val)
    liar_share = 128.0 / (3 * 8.0 + 128.0)  # where all four sent a coefficient: at most this much of the liar's
    assert liar_share < 0.85
    for name in SPECS:
        got, liar_dense = _dense(merged.payload.tensors[name]), _dense(liar.tensors[name])
        honest_dense = _dense(honest[0].tensors[name])
        both = (liar_dense != 0) & (honest_dense != 0)
        mix = liar_share * liar_dense + (1 - liar_share) * honest_dense
        assert torch.allclose(got[both], mix[both], rtol=1e-5, atol=1e-6), name
