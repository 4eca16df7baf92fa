"""DHT mode: the parts an owner decodes as they arrive (`RoundState.decode_early`), before its merge. The
merge takes such a decode only for the very bytes it holds and the slice it merges; anything else is
decoded again. Pure logic over real encoded parts; the exchange over real nodes is tested in
tests/integration/test_dht_ahead.py."""

from __future__ import annotations

import threading

import pytest
import torch

from demonet import wire
from demonet.dht import round_state, rules
from demonet.dht.round_state import RoundState, decode_part
from demonet.dht.streams import DhtOptions
from demonet.errors import InvalidPayload
from demonet.optim import Payload
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
