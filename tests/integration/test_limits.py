"""The coordinator's limits as a real process on loopback, driven by raw gRPC clients: one Submit stream per
peer, the size bound, a stream ends with its round, and the download and join rates."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.errors import PeerUnavailable
from demonet.transport.grpc import GrpcClient
from demonet.wire.identity import submit_statement
from demonet.wire.params import PROTOCOL
from demonet.wire.signed import submit_parts
from tests.integration.common import tiny_config
from tests.integration.test_coordinator import TOKEN, Coordinator, Peer
from tests.procs import Reaper

pytestmark = pytest.mark.slow


def _start(tmp: Path, reaper: Reaper, round_timeout_s: float, start_peers: int = 1, **net: float) -> Coordinator:
    c = Coordinator(tmp, reaper, timeout_s=round_timeout_s)
    (tmp / "run.toml").write_text(tiny_config(round_timeout_s=round_timeout_s, steps=50, heartbeat_timeout_s=30.0,
                                              start_peers=start_peers, **net))
    c.start()
    return c


def _payload(peer: Peer, round_: int) -> bytes:
    x, y = next(peer.batches)
    peer.model(x, y)[1].backward()  # type: ignore[union-attr]
    return wire.encode(peer.opt.compress(), step=round_)


async def _held(peer: Peer, round_: int, data: bytes, go: asyncio.Event,
                part_bytes: int = 512) -> AsyncIterator[pb.SubmitPart]:
    """The parts of `data`: the first at once, the rest once `go` is set."""
    for i, part in enumerate(submit_parts(peer.identity, peer.session, peer.peer_id, round_, data,
                                          param_digest=peer.digest(), loss=1.0, part_bytes=part_bytes)):
        if i == 1:
            await go.wait()
        yield part


async def test_a_second_stream_of_a_peer_is_refused_busy_at_once_and_the_first_counts(
        tmp_path: Path, reap_children: Reaper) -> None:
    coordinator = _start(tmp_path, reap_children, round_timeout_s=10.0)
    a = Peer(coordinator.address, "a")
    assert await a.join() == 0
    data = _payload(a, 0)
    go = asyncio.Event()
    first = asyncio.ensure_future(a.stub.Submit(_held(a, 0, data, go), metadata=a.md, timeout=30))
    await asyncio.sleep(0.5)  # the first part is in: the slot is taken
    began = time.monotonic()
    second = await a.submit_bytes(0, data)
    assert second.refusal == pb.REFUSAL_BUSY and "stream open" in second.reason, second
    assert time.monotonic() - began < 2.0  # at once, not after reading the stream
    go.set()
    reply = await first
    assert reply.accepted, reply
    header, _ = await a.aggregate(0)
    assert list(header.contributors) == ["a"] and not header.aborted
    again = await a.submit_bytes(0, data)  # the first stream has ended: refused for the round, not BUSY
    assert not again.accepted and again.refusal == pb.REFUSAL_STALE, again


async def test_a_declared_size_over_the_runs_bound_is_refused_at_the_first_part(
        tmp_path: Path, reap_children: Reaper) -> None:
    coordinator = _start(tmp_path, reap_children, round_timeout_s=10.0)
    a = Peer(coordinator.address, "a")
    await a.join()

    async def one_part() -> AsyncIterator[pb.SubmitPart]:
        digest = hashlib.sha256(b"").digest()
        yield pb.SubmitPart(peer_id="a", round=0, param_digest=a.digest(), loss=1.0, samples=1, part=pb.PayloadPart(
            payload_digest=digest, index=0, count=512, total_bytes=1 << 30, data=b"x" * 1024),
            signature=a.identity.sign(submit_statement(a.session, "a", 0, digest, a.digest(), 1.0)))
        await asyncio.sleep(30)  # never sends more: the refusal must not wait for it

    began = time.monotonic()
    reply = await a.stub.Submit(one_part(), metadata=a.md, timeout=30)
    assert reply.refusal == pb.REFUSAL_INVALID and "no valid payload of this run" in reply.reason, reply
    assert time.monotonic() - began < 2.0
    assert (await a.submit_bytes(0, _payload(a, 0))).accepted  # the slot was released


async def test_a_slow_drip_stream_ends_when_its_round_closes_and_the_round_closes_on_time(
        tmp_path: Path, reap_children: Reaper) -> None:
    coordinator = _start(tmp_path, reap_children, round_timeout_s=3.0, start_peers=2)
    honest, drip = Peer(coordinator.address, "honest"), Peer(coordinator.address, "drip")
    await asyncio.gather(honest.join(), drip.join())
    data = _payload(drip, 0)

    async def dripping() -> AsyncIterator[pb.SubmitPart]:
        for part in submit_parts(drip.identity, drip.session, "drip", 0, data, param_digest=drip.digest(), loss=1.0,
                                 part_bytes=64):
            yield part
            await asyncio.sleep(1.0)

    began = time.monotonic()
    dripped = asyncio.ensure_future(drip.stub.Submit(dripping(), metadata=drip.md, timeout=60))
    reply, header = await honest.step(0)
    closed_s = time.monotonic() - began
    assert reply.accepted and list(header.contributors) == ["honest"]
    assert closed_s < 3.0 + 2.0, closed_s  # the round's deadline, not the drip's
    refused = await dripped
    assert refused.refusal == pb.REFUSAL_STALE and "before the payload was complete" in refused.reason, refused
    assert time.monotonic() - began < 3.0 + 4.0  # ended with its round (plus the grace), not after 60+ parts


async def test_a_download_loop_is_limited_and_an_honest_peer_still_trains(
        tmp_path: Path, reap_children: Reaper) -> None:
    coordinator = _start(tmp_path, reap_children, round_timeout_s=5.0)  # the calls below take well under 1 s
    looper = Peer(coordinator.address, "looper")
    await looper.join()  # its first download
    codes = []
    for _ in range(6):
        try:
            await looper.load_parameters(0)
            codes.append(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as e:
            codes.append(e.code())
            details, trailing = e.details() or "", dict(e.trailing_metadata() or ())
    assert codes == [grpc.StatusCode.OK] * 3 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3, codes
    assert "try again in" in details and 0 < float(trailing["retry-after-s"]) <= 10.0, (details, trailing)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await Peer(coordinator.address, "stranger").load_parameters(0)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "join the run" in (err.value.details() or "")
    # The client: an advertised wait longer than it may wait fails clearly.
    client = GrpcClient(coordinator.address, token=TOKEN, peer_id="looper", reconnect_timeout_s=1.0,
                        identity=looper.identity)
    await client.join()  # looper again, with its key
    expected = {n: (tuple(p.shape), p.dtype) for n, p in looper.model.named_parameters()}
    with pytest.raises(PeerUnavailable, match="limits this peer's calls"):
        await client.get_parameters(0, expected)
    await client.close()
    # Probes: a burst of 32 from one address (whatever id they name), then RESOURCE_EXHAUSTED.
    for i in range(33):
        probe = pb.JoinRequest(peer_id=f"churn{i % 2}", probe=True, protocol=PROTOCOL)
        call = looper.stub.Join(probe, metadata=looper.md, timeout=10)
        if i < 32:
            await call
        else:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    honest = Peer(coordinator.address, "honest")
    first = await honest.join()
    await looper.channel.close()
    reply, header = await honest.step(first)  # the looper is a member that stopped: the round waits for it
    assert reply.accepted and list(header.contributors) == ["honest"]
    assert honest.digest() == header.param_digest
    assert torch.isfinite(torch.tensor([p.sum().item() for p in honest.model.parameters()])).all()
