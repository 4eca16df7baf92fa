"""Ids that join and never send a payload, against a real coordinator process on loopback while an honest peer
trains: at most `[net] max_newcomers` of them are bound at once (another new id is refused RESOURCE_EXHAUSTED),
and `[net] newcomer_s` after they joined they are let go: dropped from the membership, their ids free for
another key."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from demonet.wire.signed import heartbeat_request
from tests.integration.common import tiny_config
from tests.integration.test_attacks import _document
from tests.integration.test_coordinator import Coordinator, Peer
from tests.procs import Reaper

pytestmark = pytest.mark.slow

NEWCOMER_S = 6.0
MAX_NEWCOMERS = 3


async def _code(peer: Peer) -> grpc.StatusCode:
    """How `peer`'s join ends: OK, or the status code it was refused with."""
    try:
        await peer.join(load=False)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def _train(a: Peer, first: int, stop: asyncio.Event) -> list[int]:
    """a's rounds from `first` until `stop`: each one accepted, a the only contributor, on the canonical digest."""
    closed, r = [], first
    while not stop.is_set():
        reply, header = await a.step(r)
        assert reply.accepted and not header.aborted, (reply, header)
        assert header.contributors == ("a",) and a.digest() == header.param_digest, header
        closed.append(r)
        r += 1
    return closed


async def test_ids_that_never_submit_are_capped_then_let_go_and_their_ids_freed_while_a_peer_trains(
        tmp_path: Path, reap_children: Reaper) -> None:
    coordinator = Coordinator(tmp_path, reap_children)
    (tmp_path / "run.toml").write_text(tiny_config(  # no heartbeats needed: only the newcomer rule drops them
        round_timeout_s=1.0, steps=10_000, heartbeat_timeout_s=120.0, max_idle_rounds=1, newcomer_s=NEWCOMER_S,
        max_newcomers=MAX_NEWCOMERS))
    coordinator.start()
    a = Peer(coordinator.address, "a")
    assert await a.join() == 0
    await a.step(0)  # a's payload is in: it is no newcomer
    stop = asyncio.Event()
    training = asyncio.ensure_future(_train(a, 1, stop))

    sybils = [Peer(coordinator.address, f"s{i}") for i in range(MAX_NEWCOMERS)]
    assert [await _code(s) for s in sybils] == [grpc.StatusCode.OK] * MAX_NEWCOMERS
    joined_at = time.monotonic()  # each was bound before this
    # the cap: another new id waits, an honest newcomer too
    assert await _code(Peer(coordinator.address, "s3")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await _code(Peer(coordinator.address, "honest")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    # before newcomer_s, s0's id is bound to its key: another key is refused
    assert await _code(Peer(coordinator.address, "s0")) == grpc.StatusCode.PERMISSION_DENIED
    while not set((await a.status()).members) >= {"a", "s0", "s1", "s2"}:  # members from the next round on
        assert time.monotonic() < joined_at + NEWCOMER_S - 2.0, (await a.status()).members
        await asyncio.sleep(0.1)

    await asyncio.sleep(max(0.0, joined_at + NEWCOMER_S + 0.5 - time.monotonic()))
    if training.done():  # a trains all along: only an error ends it early
        await training
    taker = Peer(coordinator.address, "s0")  # another key takes s0: the join lets the three go first
    assert await _code(taker) == grpc.StatusCode.OK
    assert await _code(Peer(coordinator.address, "honest")) == grpc.StatusCode.OK  # room for newcomers again
    status = await a.status()
    assert not {"s1", "s2"} & set(status.members), status.members
    old = sybils[1]  # its key and session were forgotten: its heartbeat keeps nothing alive
    reply = await old.stub.Heartbeat(heartbeat_request(old.identity, old.session, "s1", status.round, old.next()),
                                     metadata=old.md, timeout=10)
    assert not reply.member

    rounds_before = status.round
    await asyncio.sleep(2.0)
    stop.set()
    closed = await asyncio.wait_for(training, 30)
    assert len(closed) >= 5 and closed[-1] >= rounds_before, closed  # it went on training after the let-go
    document = await _document(coordinator.address)
    kinds = [r["kind"] for r in document["refusals"]]
    assert kinds.count("newcomers") == 2, kinds
    states = {m["id"]: m["state"] for m in document["members"]}
    assert states["a"] in ("member", "submitted") and states.get("s1", "left") == "left", states

