"""DHT mode, the exchange's verifier: one merge per (slice, senders), shared by the verifier's own check
and the members' check requests. A request whose caller goes away (a killed peer drops its stream, and
the stream's handler is cancelled) must not cancel the merge the others wait for: it did, and the
verifier itself then died of the CancelledError (seen in the kill test). No sockets; the parts are
held back by a stand-in for `_merged` so that the cancel lands mid-merge.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from demonet.dht.exchange import SliceExchange
from demonet.dht.options import DhtOptions
from demonet.dht.round_state import RoundState


def _exchange() -> SliceExchange:
    streams = SimpleNamespace(serve=lambda *_: None)
    node = SimpleNamespace(opts=DhtOptions(run="r", token="t"), peer_id="a", streams=streams)
    return SliceExchange(node)  # type: ignore[arg-type]


@pytest.mark.timeout(10)
async def test_a_cancelled_check_request_leaves_the_shared_merge_to_the_others(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    ex, st = _exchange(), RoundState()
    started, release = asyncio.Event(), asyncio.Event()
    calls = []

    async def held_merge(r: int, st_: RoundState, s: int, senders: tuple[str, ...]) -> None:
        calls.append((r, s, senders))
        started.set()
        await release.wait()
        return None  # a part is missing: the digest is None

    monkeypatch.setattr(ex, "_merged", held_merge)
    senders = ("a", "b")
    request = asyncio.ensure_future(ex._digest_over(3, st, 0, senders))  # a member's check request
    own = asyncio.ensure_future(ex._digest_over(3, st, 0, senders))  # this peer's own check
    await started.wait()
    request.cancel()  # its caller went away
    await asyncio.sleep(0)
    release.set()
    assert await own is None  # the merge ran to its end for the own check
    with pytest.raises(asyncio.CancelledError):
        await request
    assert await ex._digest_over(3, st, 0, senders) is None  # kept: asked again, not merged again
    assert calls == [(3, 0, senders)]


@pytest.mark.timeout(10)
async def test_a_verified_slice_is_checked_with_the_verifiers_answer_to_the_part_when_the_merges_match() -> None:
    """The verifier answers a member's part with the digest of the merge over every member (`RoundState.early`):
    a slice its owner merged over the same members is checked with it, without a check call; over other
    senders, or with no early answer, the check call asks for the digest over the owner's senders."""
    import hashlib

    from demonet._proto import demonet_pb2 as pb

    calls: list[tuple[int, tuple[str, ...]]] = []
    ex = _exchange()

    async def call(address: str, kind: int, r: int, *, slice: int, contributors: list[str], timeout_s: float
                   ) -> tuple[pb.DhtMessage, bytes]:
        calls.append((kind, tuple(contributors)))
        return pb.DhtMessage(), hashlib.sha256(b"merged over " + ",".join(contributors).encode()).digest()

    ex._streams = SimpleNamespace(call=call)  # type: ignore[assignment]

    def round_with(senders: tuple[str, ...], early: tuple[tuple[str, ...], bytes] | None) -> RoundState:
        st = RoundState(owners=["o"], members=["a", "b", "c"], verifiers={0: "v"})
        st.merged[0] = (senders, b"merged over " + ",".join(senders).encode(), None)  # type: ignore[assignment]
        st.early[0] = asyncio.get_running_loop().create_future()
        st.early[0].set_result(early)
        return st

    every = ("a", "b", "c")
    right = hashlib.sha256(b"merged over a,b,c").digest()
    st = round_with(every, (every, right))  # the same merge: checked with the early answer alone
    await ex._check(3, st, 0, "addr")
    assert calls == [] and not st.disagreed and not st.unverified
    st = round_with(every, (every, hashlib.sha256(b"another merge").digest()))  # a lie: dropped, no call either
    await ex._check(3, st, 0, "addr")
    assert calls == [] and st.disagreed == {0}
    st = round_with(("a", "b"), (every, right))  # the owner merged without c: asked over its own senders
    await ex._check(3, st, 0, "addr")
    assert calls == [(pb.DHT_KIND_CHECK, ("a", "b"))] and not st.disagreed and not st.unverified
    st = round_with(every, None)  # no early answer (the verifier lacked a part, or did not answer): asked
    await ex._check(3, st, 0, "addr")
    assert calls[1:] == [(pb.DHT_KIND_CHECK, every)] and not st.disagreed


@pytest.mark.timeout(10)
async def test_a_peer_that_let_a_call_time_out_is_not_asked_again_in_the_round() -> None:
    """A peer that did not answer a call of the exchange (`NoAnswer`: cut off, or stalled) is not asked
    again after it, which would wait `exchange_timeout_s` more each time: a missing slice is asked from the
    other owners only (its own owner last, if it answered), and a slice whose verifier let this peer's
    part time out is kept unverified without a check call. A peer whose stream broke (a dead one refuses
    at once) still is asked."""
    import hashlib

    from demonet.dht.deadlines import NoAnswer, now
    from demonet.errors import PeerUnavailable

    ex = _exchange()  # peer "a"
    st = RoundState(owners=["a", "b", "c", "d"], dialable=["a", "b", "c", "d"], members=["a", "b", "c", "d"],
                    verifiers={1: "d", 2: "b"}, ag_deadline=now() + 0.3)
    assert st.holders(1, "a") == ["c", "d", "b"] and st.holders(0, "a") == ["b", "c", "d"]
    calls: list[tuple[str, int]] = []

    async def call(address: str, kind: int, *_: object, **__: object) -> tuple[object, bytes]:
        calls.append((address, kind))
        if address == "addr-b":
            raise NoAnswer("no answer within 0.3 s")
        if address == "addr-c":
            raise PeerUnavailable("the link closed")
        return SimpleNamespace(contributors=[]), hashlib.sha256(b"merged").digest()

    ex._streams = SimpleNamespace(call=call)  # type: ignore[assignment]
    await ex._part_and_slice(4, st, 1, b"part", "addr-b")  # b owns slice 1: silent
    await ex._part_and_slice(4, st, 2, b"part", "addr-c")  # c owns slice 2: its link broke
    assert st.silent == {"b"} and not st.merged
    assert st.holders(1, "a") == ["c", "d"]  # not b, its silent owner
    assert st.holders(2, "a") == ["d", "c"] and st.holders(3, "a") == ["c", "d"]  # a silent b is asked for nothing

    for s in (1, 2):  # slice 1's verifier d answers the check; slice 2's verifier b is silent
        st.merged[s] = (("a", "b", "c", "d"), b"merged", None)  # type: ignore[assignment]
    calls.clear()
    await ex._check(4, st, 1, "addr-d")
    await ex._check(4, st, 2, "addr-b")
    assert [address for address, _ in calls] == ["addr-d"]  # no call to b
    assert st.unverified == {2} and not st.disagreed


@pytest.mark.timeout(10)
@pytest.mark.parametrize("c_is", ["silent", "of-another-list"])
async def test_the_verifiers_early_answer_names_the_parts_it_merged(c_is: str) -> None:
    """The verifier's answer to a part is its merge as the owner makes it: every member's part once it holds
    them all, else those held at the reduce-scatter's deadline, named (a slice its owner merged over the
    same parts is then checked without a call). c's part never comes: silent, the answer comes at the
    deadline, over a and b; of another member list (c froze otherwise), at once."""
    import hashlib
    import time

    from demonet import wire
    from demonet.dht import rules
    from demonet.dht.deadlines import now
    from tests.payloads import random_payload

    specs = {"w": ((32, 32), (8, 8)), "b": ((32,), (1, 32))}
    plan, members = rules.SlicePlan(specs, 3), ["a", "b", "c"]
    ex = _exchange()  # peer "a", the verifier of slice 0
    st = ex._round(4, mine=True)
    st.plan, st.owners, st.members, st.mdigest = plan, list(members), list(members), rules.members_digest(members)
    st.verifiers = {0: "a"}
    st.rs_deadline = now() + 0.5
    for i, p in enumerate(["a", "b"]):
        st.parts.setdefault(0, {})[p] = (st.mdigest, wire.encode(plan.cut(random_payload(specs, i, k=4), 0), step=4))
    if c_is == "of-another-list":
        st.other_lists.add("c")
    t0 = time.monotonic()
    reply = await ex._answer_early(4, st, 0, "b")
    waited = time.monotonic() - t0
    assert list(reply.fields["contributors"]) == ["a", "b"]
    merged = await ex._merged(4, st, 0, ("a", "b"))
    assert merged is not None and reply.data == hashlib.sha256(merged[1].data).digest()
    assert (waited >= 0.4) if c_is == "silent" else (waited < 0.3), waited
