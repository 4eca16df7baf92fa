"""A peer's GetAggregate goes out beside its Submit, so that the aggregate leaves the coordinator at the close.

A real `demonet.coordinator.serve` (grpc.aio on loopback) and the real client (`GrpcClient.gather`). The
servicer's GetAggregate is wrapped only to record the requests it gets; the coordinator serves them as
always.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from demonet.coordinator.server import CoordinatorServicer
from demonet.transport import Digest
from demonet.transport.grpc import GrpcClient
from tests.integration.common import coordinator_in_process
from tests.integration.test_coordinator import TOKEN, Peer

pytestmark = pytest.mark.slow


async def test_gather_asks_for_the_aggregate_beside_its_submit(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain rounds: the first GetAggregate says `submitting`, and the round's aggregate and canonical digest
    come back as a call after the Submit would get them."""
    asked: list[tuple[str, int, bool]] = []
    real = CoordinatorServicer.GetAggregate

    async def recorded(self: CoordinatorServicer, request: Any, context: Any) -> AsyncIterator[Any]:
        asked.append((request.peer_id, request.round, request.submitting))
        async for chunk in real(self, request, context):
            yield chunk

    monkeypatch.setattr(CoordinatorServicer, "GetAggregate", recorded)
    client = None
    async with coordinator_in_process(tmp_path, token=TOKEN, steps=2, state_dir=tmp_path / "state") as (address, _):
        try:
            peer = Peer(address, "a")
            assert await peer.join() == 0
            client = GrpcClient(address, token=TOKEN, peer_id="a", identity=peer.identity)
            await client.join()  # a again, with its key: a member's join changes nothing
            for round_ in range(2):
                x, y = next(peer.batches)
                peer.model(x, y)[1].backward()  # type: ignore[union-attr]
                payload = peer.opt.compress()
                result = await client.gather(round_, payload, loss=1.0, param_digest=Digest(peer.digest()))
                assert result.contributors == ("a",) and not result.aborted and result.aggregate is not None
                peer.opt.restore(payload, kept=result.aggregate)
                peer.opt.apply(result.aggregate, lr=peer.lr(round_))
                peer.opt.zero_grad()
                assert result.digest_later is not None
                assert await asyncio.wait_for(result.digest_later, 30) == peer.digest()
                assert result.phases["wait"] >= 0.0
            assert asked == [("a", 0, True), ("a", 1, True)]
        finally:
            if client is not None:
                await client.close()
