"""Peers and coordinators of another protocol version are refused at Join, over real sockets, with a message that
names both versions, and nothing changes: a real coordinator refuses a JoinRequest as protocol 1 sent it (no
`protocol`), and the peer's client refuses a coordinator that answers as protocol 1 did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from demonet._proto import demonet_pb2 as pb
from demonet._proto import demonet_pb2_grpc as pbg
from demonet.transport.grpc import GrpcClient
from demonet.wire.identity import Identity
from demonet.wire.params import PROTOCOL
from demonet.wire.signed import join_request
from tests.integration.common import coordinator_in_process
from tests.integration.test_coordinator import TOKEN

pytestmark = pytest.mark.slow

MD = (("authorization", f"Bearer {TOKEN}"),)


async def test_a_peer_of_protocol_1_is_refused_at_join(tmp_path: Path) -> None:
    async with coordinator_in_process(tmp_path, token=TOKEN, steps=2) as (address, _):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pbg.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
            key = Identity.generate()
            nonce = (await stub.Challenge(pb.ChallengeRequest(peer_id="old", public_key=key.public), metadata=MD,
                                          timeout=10)).nonce
            old = join_request(key, "old", nonce)
            old.ClearField("protocol")  # what a peer of protocol 1 sends
            for request in (old, pb.JoinRequest(peer_id="old", probe=True),
                            pb.JoinRequest(peer_id="old", probe=True, protocol=PROTOCOL + 1)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Join(request, metadata=MD, timeout=10)
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert (f"peer 'old' speaks demonet protocol {request.protocol or 1} and the coordinator protocol "
                        f"{PROTOCOL}") in (err.value.details() or "")
            status = await stub.Status(pb.StatusRequest(detail=True), metadata=MD, timeout=10)
            assert list(status.members) == []
            assert [r["kind"] for r in json.loads(status.detail_json)["refusals"]] == ["protocol"] * 3
            reply = await stub.Join(join_request(key, "old", (await stub.Challenge(pb.ChallengeRequest(
                peer_id="old", public_key=key.public), metadata=MD, timeout=10)).nonce), metadata=MD, timeout=10)
            assert reply.protocol == PROTOCOL and reply.session  # the same key, of this version: admitted


class _Protocol1(pbg.CoordinatorServicer):
    """A coordinator as protocol 1 answered a Join: no `protocol` in its reply."""

    def __init__(self) -> None:
        self.joins: list[pb.JoinRequest] = []

    async def Join(self, request: pb.JoinRequest, context: Any) -> pb.JoinReply:
        self.joins.append(request)
        return pb.JoinReply(peer_id=request.peer_id, run_config="{}", session=b"s" * 16)


async def test_a_coordinator_of_protocol_1_is_refused_by_the_peer() -> None:
    server = grpc.aio.server()
    old = _Protocol1()
    pbg.add_CoordinatorServicer_to_server(old, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = GrpcClient(f"127.0.0.1:{port}", token=TOKEN, peer_id="new", reconnect_timeout_s=5.0,
                        identity=Identity.generate())
    try:
        with pytest.raises(PermissionError, match=f"speaks demonet protocol 1 and this peer protocol {PROTOCOL}"):
            await client.join(probe=True)
        assert [(j.probe, j.protocol) for j in old.joins] == [(True, PROTOCOL)]
    finally:
        await client.close()
        await server.stop(None)
