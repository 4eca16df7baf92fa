"""What a token holder can still try against a real coordinator process on loopback, while two honest peers
train: a flood of Submit streams that never complete their first message, a replayed Leave after a peer's
restart, and a flood of unsigned GetAggregate calls. Each checks the honest rounds and digests, and the
refusals the coordinator counted. The attackers are bench/attacks.py's."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from demonet._proto import demonet_pb2 as pb
from demonet.transport.grpc import GrpcClient
from demonet.wire.signed import heartbeat_request, leave_request
from tests.integration.test_coordinator import TOKEN, Peer
from tests.integration.test_limits import _start
from tests.procs import Reaper

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench" / "attacks.py"


async def _attacker(address: str, *args: str) -> dict[str, Any]:
    """bench/attacks.py as one attacker process against `address`; its JSON line."""
    proc = await asyncio.create_subprocess_exec(sys.executable, str(BENCH), *args, "--coordinator", address,
                                                "--token", TOKEN, stdout=subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0
    result: dict[str, Any] = json.loads(out)
    return result


async def _rounds(a: Peer, b: Peer, first: int, count: int) -> list[tuple[int, str]]:
    """`count` rounds of a and b from `first`: each one's contributors are both, on one digest."""
    closed = []
    for r in range(first, first + count):
        (ra, ha), (rb, hb) = await asyncio.gather(a.step(r), b.step(r))
        assert ra.accepted and rb.accepted, (ra, rb)
        assert sorted(ha.contributors) == ["a", "b"] and ha.param_digest == hb.param_digest
        assert a.digest() == b.digest() == ha.param_digest
        closed.append((r, ha.param_digest))
    return closed


async def _document(address: str) -> dict[str, Any]:
    client = GrpcClient(address, token=TOKEN)
    try:
        return await client.status_document()
    finally:
        await client.close()


async def _pair(address: str) -> tuple[Peer, Peer]:
    a, b = Peer(address, "a"), Peer(address, "b")
    assert await asyncio.gather(a.join(), b.join()) == [0, 0]
    return a, b


def _kinds(document: dict[str, Any]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for refusal in document["refusals"]:
        kinds[refusal["kind"]] = kinds.get(refusal["kind"], 0) + 1
    return kinds


async def test_a_flood_of_unfinished_submit_streams_is_capped_and_ended_and_the_rounds_go_on(
        tmp_path: Path, reap_children: Reaper) -> None:
    # The peers submit nothing while the flood is held: with the default max_idle_rounds (3), both would be idle
    # after it, and the first round back would close on whichever payload came in first, refusing the other's.
    coordinator = _start(tmp_path, reap_children, round_timeout_s=3.0, start_peers=2, max_idle_rounds=0)
    a, b = await _pair(coordinator.address)
    # 12 streams from one address, each one byte short of a message the server would read: 8 (the most per
    # address) held until the first part's deadline, 4 refused BUSY at once; 16 MiB ones refused by gRPC.
    flood = asyncio.ensure_future(_attacker(coordinator.address, "--flood", "--streams", "12", "--declared", "4000",
                                            "--hold-s", "20"))
    huge = asyncio.ensure_future(_attacker(coordinator.address, "--flood", "--streams", "4", "--hold-s", "5"))
    await asyncio.sleep(1.0)
    await _rounds(a, b, 0, 4)
    held, refused = await flood, await huge
    assert held["ended"] == {"response": 12}, held  # every stream answered, none left open
    assert 9.0 <= held["last_ended_s"] <= 15.0, held  # the held ones at the first part's deadline (10 s)
    assert set(refused["ended"]) <= {"response", "reset"} and refused["last_ended_s"] < 3.0, refused
    kinds = _kinds(await _document(coordinator.address))
    assert kinds.get("busy", 0) >= 4 and kinds.get("invalid", 0) >= 8, kinds
    # The rounds without payloads meanwhile were aborted at their deadlines (3 s each). The open one may be near
    # its own: a payload that misses it would count late, in the next one. So wait for a round to open, then
    # submit to it at once, a full deadline ahead.
    first = (await a.status()).round
    while (fresh := (await a.status()).round) == first:
        await asyncio.sleep(0.05)
    await _rounds(a, b, fresh, 1)


async def test_a_replayed_leave_after_a_restart_and_a_replayed_heartbeat_are_refused(
        tmp_path: Path, reap_children: Reaper) -> None:
    coordinator = _start(tmp_path, reap_children, round_timeout_s=3.0, start_peers=2)
    a, b = await _pair(coordinator.address)
    await _rounds(a, b, 0, 2)
    captured = leave_request(a.identity, a.session, "a", 2, a.next())  # a's graceful stop, seen on the wire
    beat = heartbeat_request(a.identity, a.session, "a", 2, a.next())
    assert (await a.stub.Heartbeat(beat, metadata=a.md, timeout=10)).member
    assert (await a.stub.Leave(captured, metadata=a.md, timeout=10)).left
    for request in (beat, captured):  # the same session: each counter once
        call = (a.stub.Heartbeat if isinstance(request, pb.HeartbeatRequest) else a.stub.Leave)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(request, metadata=a.md, timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "used already" in str(err.value.details())
    restarted = Peer(coordinator.address, "a", identity=a.identity)  # a's restart: the same key, a new session
    first = await restarted.join(load=False)
    assert first == 3  # a joiner again, from the round after the open one
    with pytest.raises(grpc.aio.AioRpcError) as err:  # the Leave of the session before: void
        await restarted.stub.Leave(captured, metadata=a.md, timeout=10)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "does not verify" in str(err.value.details())
    await b.step(2)  # round 2 closes with b alone: a left it
    await restarted.load_parameters(first)
    closed = await _rounds(restarted, b, first, 3)  # a is a member and in every round
    assert len(closed) == 3
    kinds = _kinds(await _document(coordinator.address))
    assert kinds.get("replay", 0) == 2 and kinds.get("signature", 0) == 1, kinds


async def test_a_getaggregate_flood_is_held_to_the_public_rate_outside_every_peers_bytes(
        tmp_path: Path, reap_children: Reaper) -> None:
    coordinator = _start(tmp_path, reap_children, round_timeout_s=3.0, start_peers=2)
    a, b = await _pair(coordinator.address)
    await _rounds(a, b, 0, 1)
    flood = asyncio.ensure_future(_attacker(coordinator.address, "--aggregates", "--hold-s", "4"))
    await asyncio.sleep(0.5)
    await _rounds(a, b, 1, 4)
    got = await flood
    served = got["codes"].get("OK", 0)
    assert 1 <= served <= 4 + 5 and got["codes"].get("RESOURCE_EXHAUSTED", 0) > served, got  # burst 4, 1/s
    document = await _document(coordinator.address)
    assert "p1" not in {m["id"] for m in document["members"]}, document["members"]  # named, never counted as p1
    assert document["run"]["bytes_down"] > 0
    kinds = _kinds(document)
    assert kinds == {"rate": len(document["refusals"])} and kinds["rate"] >= 1, kinds  # the bounded list: all rate


async def test_a_request_signed_before_the_peers_own_rejoin_is_signed_again_not_fatal(tmp_path: Path) -> None:
    """The heartbeats and a catch-up run beside each other: a join may land while a heartbeat signed in the
    session before it is on its way. The coordinator refuses that one (the old session is void, as against a
    replay); the client signs it again in its new session, instead of ending the peer as for a bad key."""
    from tests.integration.common import coordinator_in_process

    async with coordinator_in_process(tmp_path, token=TOKEN, steps=4) as (address, _):
        client = GrpcClient(address, token=TOKEN, peer_id="a")
        try:
            await client.join()
            beat, rejoined = client._stub.Heartbeat, []

            async def rejoin_first(request: pb.HeartbeatRequest, **kwargs: Any) -> Any:
                if not rejoined:  # the request is signed in the first session: the second replaces it
                    rejoined.append(await client.join())
                return await beat(request, **kwargs)

            client._stub.Heartbeat = rejoin_first
            round_, member = await client.heartbeat(0)
            assert rejoined and member and round_ == 0
            async with grpc.aio.insecure_channel(address) as channel:
                from demonet._proto import demonet_pb2_grpc as pbg
                stub = pbg.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
                status = await stub.Status(pb.StatusRequest(detail=True),
                                           metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)
            refusals = json.loads(status.detail_json)["refusals"]
            assert [r["kind"] for r in refusals if r["peer"] == "a"] == ["signature"], refusals
        finally:
            await client.close()
