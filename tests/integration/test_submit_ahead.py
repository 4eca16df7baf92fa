"""A payload sent ahead (`SubmitPart.digest_follows`): an overlapped peer's payload for round r+1 streams
while round r is open, and its parameter digest follows once the peer has applied round r. A real
coordinator process on loopback, driven by raw gRPC clients written against the protocol."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.wire.identity import Identity
from demonet.wire.signed import digest_part, submit_parts
from tests.integration.test_coordinator import Coordinator, Peer
from tests.procs import Reaper

pytestmark = pytest.mark.slow


@pytest.fixture
def rounds(tmp_path: Path, reap_children: Reaper) -> Coordinator:
    """Rounds long enough for every call of a test inside one round on a busy machine."""
    c = Coordinator(tmp_path, reap_children, timeout_s=30.0, extra=("--start-peers", "2"))
    c.start()
    return c


class Ahead:
    """One Submit stream of `peer`'s payload for `round_`, digest to follow: its parts at once, then the
    digest once `digest` is set ("": the stream ends without it), signed with `key` (the peer's by default)."""

    def __init__(self, peer: Peer, round_: int, data: bytes, key: Identity | None = None) -> None:
        self.parts = submit_parts(peer.identity, peer.session, peer.peer_id, round_, data, param_digest="",
                                  loss=1.0, digest_follows=True)
        self.digest: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.sent = asyncio.Event()

        async def stream():  # type: ignore[no-untyped-def]
            for part in self.parts:
                yield part
            self.sent.set()
            digest = await self.digest
            if digest:
                yield digest_part(key or peer.identity, peer.session, self.parts[0], digest)

        self.call = asyncio.ensure_future(peer.stub.Submit(stream(), metadata=peer.md, timeout=60))

    async def reply(self, digest: str | None = None) -> pb.SubmitReply:
        if digest is not None:
            self.digest.set_result(digest)
        try:
            return await asyncio.wait_for(self.call, 30)
        finally:  # a reply before the digest (a refusal): the stream ends without it
            if not self.digest.done():
                self.digest.set_result("")


def gradient(peer: Peer, round_: int) -> tuple[object, bytes]:
    """`peer`'s payload for `round_` from one batch: the payload and its wire bytes."""
    peer.opt.zero_grad()
    x, y = next(peer.batches)
    peer.model(x, y)[1].backward()  # type: ignore[union-attr]
    payload = peer.opt.compress()
    return payload, wire.encode(payload, step=round_)


async def two_members(coordinator: Coordinator) -> tuple[Peer, Peer]:
    """"a" and "b", both members of round 1 that the rounds wait for (the run started with both, and both closed
    round 0: a member with no payload accepted would not be waited on)."""
    a, b = Peer(coordinator.address, "a"), Peer(coordinator.address, "b")
    assert await a.join(load=False) == 0
    assert await b.join(load=False) == 0
    assert await a.load_parameters(0) == 0 and await b.load_parameters(0) == 0
    await asyncio.gather(a.step(0), b.step(0))
    return a, b


async def test_a_payload_sent_ahead_counts_in_its_round_once_its_digest_follows(rounds: Coordinator) -> None:
    a, b = await two_members(rounds)
    sent, data = gradient(a, 1)
    assert (await a.submit_bytes(1, data)).accepted  # round 1 stays open: b's payload is missing
    _, ahead_data = gradient(a, 2)
    ahead = Ahead(a, 2, ahead_data)
    await ahead.sent.wait()
    status = await a.status()
    assert (status.round, status.submitted) == (1, 1)  # the payload of round 2 is not counted in round 1
    assert not ahead.call.done()  # it waits for its digest
    (reply, closed), (a_closed, aggregate) = await asyncio.gather(b.step(1), a.aggregate(1))
    assert reply.accepted and sorted(closed.contributors) == ["a", "b"] and a_closed == closed
    a.opt.restore(sent, kept=aggregate)  # a applies round 1 as a plain peer would
    a.opt.apply(aggregate, lr=a.lr(1))
    assert a.digest() == closed.param_digest
    assert not ahead.call.done()
    reply = await ahead.reply(a.digest())
    assert reply.accepted and reply.open_round == 2, reply
    status = await a.status()
    assert (status.round, status.submitted) == (2, 1)
    (reply, closed), (a_closed, _) = await asyncio.gather(b.step(2), a.aggregate(2))
    assert reply.accepted and sorted(closed.contributors) == ["a", "b"] and a_closed == closed
    assert b.digest() == closed.param_digest


async def test_a_bad_stream_sent_ahead_is_refused_and_changes_nothing(rounds: Coordinator) -> None:
    a, b = await two_members(rounds)
    _, data = gradient(a, 1)
    assert (await a.submit_bytes(1, data)).accepted
    before = await a.status()
    _, ahead_data = gradient(a, 2)

    # Refused at its first part, before any digest: a round beyond the next one, and a non-member.
    reply = await Ahead(a, 3, wire.encode(a.opt.compress(), step=3)).reply()
    assert not reply.accepted and reply.refusal == pb.REFUSAL_FUTURE, reply
    reply = await Ahead(b, 2, ahead_data).reply()  # b's payload for round 1 is not in
    assert not reply.accepted and reply.refusal == pb.REFUSAL_FUTURE and "not in" in reply.reason, reply
    stranger = Peer(rounds.address, "stranger")
    assert await stranger.join(load=False) == 2  # a joiner: a member from round 2 on, not of round 1
    reply = await Ahead(stranger, 2, ahead_data).reply()
    assert not reply.accepted and reply.refusal == pb.REFUSAL_NOT_MEMBER, reply
    # A payload that fails validation is refused once it is whole, without waiting for its digest.
    reply = await Ahead(a, 2, wire.encode(a.opt.compress(), step=7)).reply()
    assert not reply.accepted and reply.refusal == pb.REFUSAL_INVALID and "round 7" in reply.reason, reply
    # A stream that ends without the digest it announced.
    reply = await Ahead(a, 2, ahead_data).reply("")
    assert not reply.accepted and reply.refusal == pb.REFUSAL_INVALID and "parameter digest" in reply.reason
    # A first part that carries a digest and announces one to follow.
    parts = submit_parts(a.identity, a.session, "a", 2, ahead_data, param_digest=a.digest(), loss=1.0)
    parts[0].digest_follows = True
    reply = await a.stub.Submit(iter(parts), metadata=a.md, timeout=30)
    assert not reply.accepted and reply.refusal == pb.REFUSAL_INVALID and "to follow" in reply.reason
    # A digest signed by another key.
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        await Ahead(a, 2, ahead_data, key=Identity.generate()).reply(a.digest())
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    after = await a.status()
    assert (after.round, after.submitted, after.param_digest) == (before.round, 1, before.param_digest)
    assert after.rejected == before.rejected + 3

    # A digest that is not the canonical one after round 1: a resync, once round 2 has opened.
    wrong = Ahead(a, 2, ahead_data)
    await wrong.sent.wait()
    _, closed = await b.step(1)
    reply = await wrong.reply("0" * 32)
    assert not reply.accepted and reply.resync and reply.refusal == pb.REFUSAL_RESYNC, reply
    status = await a.status()
    assert (status.round, status.submitted, status.param_digest) == (2, 0, closed.param_digest)
