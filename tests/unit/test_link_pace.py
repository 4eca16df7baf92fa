"""A payload sized to the uplink (`demonet.loop.link.LinkPace`), and the k range the merge accepts."""

from __future__ import annotations

import pytest
import torch

from demonet import wire
from demonet.errors import InvalidPayload
from demonet.loop.link import UPLOAD_SHARE, LinkPace
from demonet.optim import DeMo
from demonet.wire.merge import MergeRules, decode_contribution


def test_a_slow_uplink_sends_a_smaller_k_and_a_fast_one_the_full_k() -> None:
    """1 Mbit/s (125 kB/s) and 50 kB at k=32: 0.4 s an upload. In a round of 0.8 s a quarter is 0.2 s: k 16."""
    slow, fast = LinkPace(max_k=32, min_k=4), LinkPace(max_k=32, min_k=4)
    slow.sent(32, 50_000, 0.4)
    fast.sent(32, 50_000, 0.004)
    assert slow.choose(0.8) == 16 == int(UPLOAD_SHARE * 0.8 * 125_000 / (50_000 / 32))
    assert slow.upload_s(16) == pytest.approx(0.2)
    assert fast.choose(0.8) == 32
    assert slow.choose(0.1) == 4  # never under the floor
    assert slow.choose(0.0) == 32  # lockstep: the full k


def test_without_a_measurement_or_with_adaptation_off_the_k_is_fixed() -> None:
    assert LinkPace(max_k=32, min_k=4).choose(1.0) == 32
    off = LinkPace(max_k=32, min_k=4, adaptive=False)
    off.sent(32, 50_000, 10.0)
    assert off.choose(1.0) == 32
    with pytest.raises(ValueError, match="min_k"):
        LinkPace(max_k=4, min_k=8)


def test_the_averages_follow_the_recent_submits() -> None:
    link = LinkPace(max_k=32, min_k=4)
    link.sent(32, 64_000, 1.0)
    link.sent(16, 32_000, 0.25)  # the link got faster
    assert 64_000 < link.bytes_per_s < 128_000 and link.bytes_per_k == pytest.approx(2000)
    assert link.last_s == 0.25
    link.sent(16, 0, 0.0)  # nothing measured (an in-process exchange): only k is noted
    assert link.k == 16 and link.bytes_per_k == pytest.approx(2000) and link.last_s == 0.25


def _payload_bytes(topk: int | None) -> bytes:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 16))
    opt = DeMo([("w", p)], lr=0.01, compression_topk=8, compression_chunk=8)
    p.grad = torch.randn(16, 16)
    return wire.encode(opt.compress(topk=topk), step=0)


def test_the_merge_takes_a_k_within_the_runs_range_and_refuses_one_outside() -> None:
    expected = {"w": ((16, 16), (8, 8))}
    rules = MergeRules(topk=8, min_k=2, max_k=8)
    for k in (2, 5, 8):
        _, payload = decode_contribution(_payload_bytes(k), expected=expected, rules=rules)
        assert payload.tensors["w"].idx.shape[-1] == k
    for k, why in ((1, "1 coefficients a chunk, outside the run's 2 to 8"),
                   (9, "9 coefficients a chunk, outside the run's 2 to 8")):
        with pytest.raises(InvalidPayload, match=why):
            decode_contribution(_payload_bytes(k), expected=expected, rules=rules)


def test_compress_refuses_a_k_below_one() -> None:
    p = torch.nn.Parameter(torch.randn(4, 4))
    p.grad = torch.randn(4, 4)
    with pytest.raises(ValueError, match="topk"):
        DeMo([("w", p)], lr=0.01, compression_topk=4, compression_chunk=4).compress(topk=0)
