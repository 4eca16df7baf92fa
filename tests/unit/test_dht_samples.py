"""DHT mode, mixed-speed peers: a slice owner weights each part by its sender's samples as the coordinator does.

The owner's merge of a slice is the samples-weighted mean of its senders' coefficients (each over the senders
that sent it), computed here densely and independently of the merge; a part claiming 10^9 samples weighs
`max_sample_ratio` times the median of the others' and is counted once a round; a part whose count is 0 or
above `max_samples_per_round` is refused by the message check, and the count is covered by the message's
signature. No sockets.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.dht import rules
from demonet.dht.deadlines import now
from demonet.dht.exchange import SliceExchange
from demonet.dht.keys import KeyBook
from demonet.dht.options import DhtOptions
from demonet.dht.streams import Streams
from demonet.optim import Payload
from demonet.wire.identity import Identity
from demonet.wire.merge import MergeRules
from tests.payloads import random_payload

SPECS = {"w": ((32, 32), (8, 8)), "b": ((32,), (1, 32))}
MEMBERS = ["a", "b", "c"]
RULES = MergeRules(topk=64, encoding="fp32", clip=False, max_sample_ratio=16.0)
"""Every merged coefficient kept (64 >= the union of three senders' 4 a chunk) in fp32, unclipped: the merge is
then the weighted mean itself."""


def _owner(claims: dict[str, int]) -> tuple[SliceExchange, object, rules.SlicePlan, dict[str, Payload]]:
    """Peer "a", owner of both slices of round 4, holding every member's parts with their `claims`."""
    node = SimpleNamespace(opts=DhtOptions(run="r", token="t", rules=RULES), peer_id="a",
                           streams=SimpleNamespace(serve=lambda *_: None))
    ex = SliceExchange(node)  # type: ignore[arg-type]
    plan = rules.SlicePlan(SPECS, 2)
    st = ex._round(4, mine=True)
    st.plan, st.owners, st.members, st.mdigest = plan, ["a", "a"], list(MEMBERS), rules.members_digest(MEMBERS)
    st.rs_deadline = now() + 5.0
    parts = {}
    for i, p in enumerate(MEMBERS):
        payload = random_payload(SPECS, i, k=4)
        for s in range(plan.n):
            data = wire.encode(plan.cut(payload, s), step=4)
            st.parts.setdefault(s, {})[p] = (st.mdigest, data)
            st.claims.setdefault(s, {})[p] = claims[p]
            if s == 0:
                parts[p] = wire.decode(data, expected=plan.slice_specs(0))[1]
    return ex, st, plan, parts


def _dense(c: object, chunk_elems: int) -> torch.Tensor:
    """A sparse row set as a dense (rows, chunk_elems) tensor, in float64 (added: a merged row shorter than its
    width is padded with zero values at indices it holds already)."""
    idx, val = c.idx.long(), c.val.float()  # type: ignore[attr-defined]
    out = torch.zeros(idx.shape[0], chunk_elems, dtype=torch.float64)
    return out.scatter_add_(1, idx, val.double())


def _weighted_mean(parts: dict[str, Payload], weights: dict[str, float]) -> dict[str, torch.Tensor]:
    """Each coefficient's mean over the senders that sent it, each weighing `weights`, in float64."""
    means = {}
    for name in parts["a"].tensors:
        chunk_elems = parts["a"].tensors[name].chunk[0] * parts["a"].tensors[name].chunk[1]
        num = sum(weights[p] * _dense(parts[p].tensors[name], chunk_elems) for p in parts)
        den = sum(weights[p] * (_dense(parts[p].tensors[name], chunk_elems) != 0).double() for p in parts)
        means[name] = torch.where(den > 0, num / den.clamp(min=1e-300), 0.0)
    return means


def _merged_dense(merged: Payload) -> dict[str, torch.Tensor]:
    return {name: _dense(c, c.chunk[0] * c.chunk[1]) for name, c in merged.tensors.items()}


@pytest.mark.timeout(10)
async def test_a_slice_merge_is_the_samples_weighted_mean_of_its_senders() -> None:
    claims = {"a": 1, "b": 3, "c": 6}
    ex, st, _, parts = _owner(claims)
    await ex._merge(4, st, 0)
    senders, data, merged = st.merged[0]  # type: ignore[attr-defined]
    assert senders == tuple(MEMBERS)
    got = _merged_dense(merged)
    weighted = _weighted_mean(parts, {p: float(n) for p, n in claims.items()})
    plain = _weighted_mean(parts, dict.fromkeys(MEMBERS, 1.0))
    for name in got:
        torch.testing.assert_close(got[name], weighted[name], rtol=1e-6, atol=1e-7)
        assert not torch.allclose(got[name], plain[name], atol=1e-4), name  # the weights are in it
    assert ex.capped == 0 and not st.capped  # type: ignore[attr-defined]


@pytest.mark.timeout(10)
async def test_a_part_claiming_a_billion_samples_weighs_the_cap_and_is_counted_once_a_round() -> None:
    claims = {"a": 2, "b": 2, "c": 10**9}
    ex, st, _, parts = _owner(claims)
    await ex._merge(4, st, 0)
    await ex._merge(4, st, 1)  # c is capped in both slices this peer owns: one payload, counted once
    got = _merged_dense(st.merged[0][2])  # type: ignore[attr-defined]
    cap = RULES.max_sample_ratio * 2  # 16 times the median of the others' (2 and 2)
    weighted = _weighted_mean(parts, {"a": 2.0, "b": 2.0, "c": cap})
    for name in got:
        torch.testing.assert_close(got[name], weighted[name], rtol=1e-6, atol=1e-7)
    assert ex.capped == 1 and st.capped == {"c"}  # type: ignore[attr-defined]


def _streams(max_samples: int = 1 << 32) -> Streams:
    opts = DhtOptions(run="r", token="t", rules=MergeRules(topk=32, max_samples=max_samples))
    me = Identity.generate()
    return Streams(opts, "a", None, me, KeyBook(("a", me.public)))


@pytest.mark.parametrize("samples", [0, 1001])
def test_a_part_claiming_no_samples_or_more_than_the_bound_is_refused_by_the_message_check(samples: int) -> None:
    streams = _streams(max_samples=1000)
    bad = streams._message(pb.DHT_KIND_PART, 4, slice=0, members_digest="m", samples=samples)
    assert "samples should be between 1 and the run's max_samples_per_round (1000)" in streams._check(bad)
    assert streams._check(streams._message(pb.DHT_KIND_PART, 4, slice=0, members_digest="m", samples=1000)) == ""
    assert streams._check(streams._message(pb.DHT_KIND_FETCH, 4, slice=0)) == ""  # only a part claims samples


async def test_a_parts_sample_count_is_covered_by_its_signature() -> None:
    streams = _streams()
    msg = streams._message(pb.DHT_KIND_PART, 4, slice=0, members_digest="m", samples=3)
    assert await streams._check_sender(msg, unknown_ok=False) == ""
    msg.samples = 10**9  # another count than the one signed
    assert (await streams._check_sender(msg, unknown_ok=False)).startswith("bad signature")


def test_a_dht_peers_dashboard_counts_the_claims_it_capped() -> None:
    from demonet.dht.view import DhtView

    view = DhtView("a", total_rounds=10, window_s=5.0)
    assert view.document()["run"]["capped"] == 0
    view.verified(4, disagreed=[], excluded=[], capped=["c"], max_ratio=16.0)
    doc = view.document()
    assert doc["run"]["capped"] == 1
    assert [(r["peer"], r["kind"]) for r in doc["refusals"]] == [("c", "samples_capped")], doc["refusals"]
