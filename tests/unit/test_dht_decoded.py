"""DHT mode: the parts an owner decodes as they arrive (`RoundState.decode_early`), before its merge. The
merge takes such a decode only for the very bytes it holds and the slice it merges; anything else is
decoded again. A small slice whose parts were all decoded so is merged on the event loop, the same bits
as in a worker thread. Pure logic over real encoded parts; the exchange over real nodes is tested in
tests/integration/test_dht_ahead.py."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.dht import exchange, round_state, rules
from demonet.dht.ahead import encode_parts
from demonet.dht.deadlines import now
from demonet.dht.exchange import SliceExchange
from demonet.dht.options import DhtOptions
from demonet.dht.round_state import RoundState, decode_part
from demonet.errors import InvalidPayload
from demonet.optim import Payload
from demonet.wire import merge as merging
from demonet.wire.merge import merge
from tests.payloads import random_payload

SPECS = {"w": ((32, 32), (8, 8)), "b": ((32,), (1, 32))}
RULES = DhtOptions(run="r", token="t").rules


def _payload(seed: int) -> Payload:
    return random_payload(SPECS, seed, k=4)


def _same(x: Payload, y: Payload) -> bool:
    return list(x.tensors) == list(y.tensors) and all(
        torch.equal(x.tensors[n].idx, y.tensors[n].idx) and torch.equal(x.tensors[n].val, y.tensors[n].val)
        for n in x.tensors)


@pytest.mark.parametrize("inline", [True, False])
async def test_a_part_is_decoded_on_arrival_for_the_plan_it_was_cut_for_and_taken_only_as_is(
        inline: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    if not inline:  # a large part goes to the decoder's own thread, not to the training step's workers
        monkeypatch.setattr(round_state.wire, "INLINE_DECODE_BYTES", 0)
    decode = round_state.decode_part

    def recorded(*args: object) -> object:
        threads.append(threading.current_thread().name)
        return decode(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(round_state, "decode_part", recorded)
    three, two = rules.SlicePlan(SPECS, 3), rules.SlicePlan(SPECS, 2)
    d3, d2 = rules.members_digest(["a", "b", "c"]), rules.members_digest(["a", "b"])
    parts = wire.encode_many([three.cut(_payload(1), s) for s in range(3)], step=5)
    st = RoundState(guess=(three, d3))

    st.decode_early(5, 1, "b", d2, parts[1], RULES)  # cut for another member list than the guess: not decoded
    assert st.decoded is None
    st.decode_early(5, 1, "b", d3, parts[1], RULES)
    st.decode_early(5, 1, "b", d3, parts[0], RULES)  # a second part of the same sender and slice: not decoded
    assert st.decoded is not None
    got = await st.decoded.take(1, "b", parts[1], three.slice_specs(1))
    expected = decode_part(parts[1], three.slice_specs(1), 5, RULES)
    assert isinstance(got, Payload) and isinstance(expected, Payload) and _same(got, expected)
    # Only for those very bytes and that slice's specs: a replaced part (equal bytes, another object), another
    # plan's slice, another sender or slice is decoded by the merge.
    assert await st.decoded.take(1, "b", bytes(bytearray(parts[1])), three.slice_specs(1)) is None
    assert await st.decoded.take(1, "b", parts[1], two.slice_specs(1)) is None
    assert await st.decoded.take(1, "c", parts[1], three.slice_specs(1)) is None
    assert await st.decoded.take(0, "b", parts[0], three.slice_specs(0)) is None

    # Once frozen, the round's plan counts, not the guess; a part of another round is refused as the merge would.
    st.plan, st.mdigest = two, d2
    cut2 = wire.encode_many([two.cut(_payload(2), s) for s in range(2)], step=5)
    st.decode_early(5, 0, "c", d3, parts[0], RULES)  # the guess's member list: no longer
    st.decode_early(5, 0, "a", d2, cut2[0], RULES)
    stale = wire.encode(two.cut(_payload(3), 1), step=4)
    st.decode_early(5, 1, "a", d2, stale, RULES)
    assert await st.decoded.take(0, "c", parts[0], two.slice_specs(0)) is None
    got = await st.decoded.take(0, "a", cut2[0], two.slice_specs(0))
    expected = decode_part(cut2[0], two.slice_specs(0), 5, RULES)
    assert isinstance(got, Payload) and isinstance(expected, Payload) and _same(got, expected)
    refused = await st.decoded.take(1, "a", stale, two.slice_specs(1))
    assert isinstance(refused, InvalidPayload) and "part says round 4" in str(refused)
    assert len(threads) == 3 and all(name.startswith("demonet-decode") != inline for name in threads), threads


def _exchange(sent: list[tuple[str, int, bytes]]) -> SliceExchange:
    async def call(address: str, kind: int, r: int, *, slice: int, data: bytes, **_: object
                   ) -> tuple[pb.DhtMessage, bytes]:
        sent.append((address, slice, data))
        return pb.DhtMessage(), b""

    streams = SimpleNamespace(serve=lambda *_: None, call=call)
    node = SimpleNamespace(opts=DhtOptions(run="r", token="t", verify_fraction=0.0), peer_id="a", streams=streams)
    return SliceExchange(node)  # type: ignore[arg-type]


async def test_the_parts_of_a_round_expected_like_the_one_before_are_decoded_as_they_arrive() -> None:
    """After a whole round, the next round's parts are expected cut for the same members (`expect`): a part
    that came already, and those that come while this peer still trains, are decoded on arrival; none is
    decoded for a round frozen meanwhile, or for another member list."""
    ex, members = _exchange([]), ["a", "b", "c"]
    three = ex.plan_for(SPECS, members)
    parts = wire.encode_many([three.cut(_payload(1), s) for s in range(3)], step=6)
    st = ex._round(6)
    st.parts[0] = {"b": (rules.members_digest(members), parts[0])}  # b went on first and sent its part
    ex.expect(6, specs=SPECS, members=members, owners=members)
    assert st.guess == (three, rules.members_digest(members)) and st.decoded is not None
    got = await st.decoded.take(0, "b", parts[0], three.slice_specs(0))
    assert isinstance(got, Payload) and _same(got, decode_part(parts[0], three.slice_specs(0), 6, RULES))  # type: ignore[arg-type]
    st.decode_early(6, 0, "c", rules.members_digest(["a", "c"]), parts[0], RULES)  # another list: not decoded
    assert await st.decoded.take(0, "c", parts[0], three.slice_specs(0)) is None
    frozen = ex._round(7)
    frozen.plan = rules.SlicePlan(SPECS, 2)
    ex.expect(7, specs=SPECS, members=members, owners=members)  # frozen already: its own plan counts
    assert frozen.guess == (None, "")


async def test_parts_encoded_ahead_are_sent_as_they_are_for_their_plan_and_cut_anew_for_another() -> None:
    """`send_ahead` sends the parts the training's thread encoded (`encode_parts`) where they were cut by the
    plan of the owners it sends to, and cuts and encodes the payload itself otherwise."""
    sent: list[tuple[str, int, bytes]] = []
    ex, members, payload = _exchange(sent), ["a", "b", "c"], _payload(2)
    three = ex.plan_for(SPECS, members)
    ready = encode_parts(4, three, payload)
    assert ready == wire.encode_many([three.cut(payload, s) for s in range(3)], step=4, index_coding="entropy")
    addresses = {p: f"addr-{p}" for p in members}
    marked = [b"encoded ahead " + bytes([s]) for s in range(3)]  # not a payload: sent as they are
    ex.send_ahead(4, payload, specs=SPECS, members=members, owners=members, addresses=addresses,
                  encoded=(three, marked))
    ahead, _ = await ex._ahead.take(4, rules.members_digest(members), members, {})
    assert ahead is not None and ahead.parts == marked
    await asyncio.gather(*ahead.to_owners.values())
    assert sorted(sent) == [("addr-b", 1, marked[1]), ("addr-c", 2, marked[2])]
    sent.clear()
    two = rules.SlicePlan(SPECS, 2)  # encoded for other owners: cut anew
    ex.send_ahead(5, payload, specs=SPECS, members=members, owners=members, addresses=addresses,
                  encoded=(two, marked[:2]))
    ahead, _ = await ex._ahead.take(5, rules.members_digest(members), members, {})
    assert ahead is not None and ahead.parts == encode_parts(5, three, payload)
    await asyncio.gather(*ahead.to_owners.values())
    assert sorted(sent) == [("addr-b", 1, ahead.parts[1]), ("addr-c", 2, ahead.parts[2])]


@pytest.mark.parametrize("limit", [merging.INLINE_MERGE_ENTRIES, 0])
async def test_a_small_slice_whose_parts_were_all_decoded_on_arrival_is_merged_on_the_event_loop(
        limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`merges_inline`: every part decoded as it came and at most `INLINE_MERGE_ENTRIES` entries in all: the
    merge runs on the event loop, else in a worker thread (as it does where a part is left to decode); the
    merged bytes are the same either way."""
    default = merging.INLINE_MERGE_ENTRIES
    monkeypatch.setattr(merging, "INLINE_MERGE_ENTRIES", limit)
    loop_thread, on_loop = threading.current_thread(), []

    def recorded(*args: object, **kwargs: object) -> object:
        on_loop.append(threading.current_thread() is loop_thread)
        return merge(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(exchange, "merge", recorded)
    ex, members = _exchange([]), ["a", "b", "c"]
    three = ex.plan_for(SPECS, members)
    st = ex._round(6)
    st.plan, st.members, st.mdigest, st.rs_deadline = three, members, rules.members_digest(members), now() + 30
    for s in range(2):
        for i, p in enumerate(members):
            data = wire.encode(three.cut(_payload(10 * s + i), s), step=6, index_coding="entropy")
            st.parts.setdefault(s, {})[p] = (st.mdigest, data)
            if s == 0 or p != "c":  # slice 1: c's part is left for the merge to decode
                st.decode_early(6, s, p, st.mdigest, data, RULES)
    entries = sum(three.cut(_payload(i), 0).numel() for i in range(3))
    assert 0 < entries <= default  # a small slice
    assert not round_state.merges_inline({"c"}, [])  # a part left to decode
    assert round_state.merges_inline((), [InvalidPayload("refused")])  # a refused part merges nothing
    for s in range(2):
        got = await ex._merged(6, st, s)
        parts = [decode_part(st.parts[s][p][1], three.slice_specs(s), 6, RULES) for p in members]
        reference = merge(parts, step=6, rules=RULES, expected=three.slice_specs(s))  # type: ignore[arg-type]
        assert got is not None and got[0] == tuple(members) and got[1].data == reference.data
    assert on_loop == [limit > 0, False], on_loop


def test_the_inline_merge_counts_the_entries_of_every_part_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """`round_state.merges_inline` counts the entries of every decoded part: on the event loop up to
    `INLINE_MERGE_ENTRIES`, in a worker thread above."""
    payloads = [_payload(seed) for seed in range(3)]
    entries = sum(p.numel() for p in payloads)
    assert entries == 3 * (16 * 4 + 4)  # 16 rows of 4 entries in w, one row of 4 in b
    assert round_state.merges_inline((), payloads) and round_state.merges_inline((), [])
    monkeypatch.setattr(merging, "INLINE_MERGE_ENTRIES", entries)
    assert round_state.merges_inline((), payloads)
    monkeypatch.setattr(merging, "INLINE_MERGE_ENTRIES", entries - 1)
    assert not round_state.merges_inline((), payloads) and round_state.merges_inline((), payloads[:2])
