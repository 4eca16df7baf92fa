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
    assert MergeRules.from_config(cfg) == MergeRules(topk=7, encoding="fp16", clip=False, max_norm=None)
    with pytest.raises(ValueError, match="topk"):
        MergeRules(topk=0)
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

