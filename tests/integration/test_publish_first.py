"""The coordinator publishes a round's aggregate before it applies it to its own parameters.

A real `demonet.coordinator.serve` (grpc.aio on loopback) whose canonical apply is held at a gate: peers
get the whole aggregate while the coordinator has not applied it; the canonical digest, the open round's
Status and the next round's Submit wait for the apply, and nothing is refused meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.coordinator.state import STATE_FILE, CanonicalState
from tests.integration.common import coordinator_in_process
from tests.integration.test_coordinator import TOKEN, Peer

pytestmark = pytest.mark.slow


async def _submit(peer: Peer, round_: int) -> tuple[Any, Any]:
    """Train one step and submit it; returns the reply and the payload."""
    x, y = next(peer.batches)
    _, loss = peer.model(x, y)
    assert loss is not None
    loss.backward()
    payload = peer.opt.compress()
    return await peer.submit_bytes(round_, wire.encode(payload, step=round_)), payload


async def test_a_round_is_published_before_the_coordinator_applies_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    gate, applying = threading.Event(), threading.Event()
    real_advance = CanonicalState.advance

    def held(self: CanonicalState, round: int, applied: Any) -> str:
        if round == 0:  # the first apply waits for the test
            applying.set()
            assert gate.wait(60), "the test never opened the gate"
        return real_advance(self, round, applied)

    monkeypatch.setattr(CanonicalState, "advance", held)
    state_dir = tmp_path / "state"
    async with coordinator_in_process(tmp_path, token=TOKEN, steps=3, state_dir=state_dir) as (address, server):
        try:
            peer = Peer(address, "a")
            assert await peer.join() == 0
            before = (await peer.status()).param_digest
            reply, payload = await _submit(peer, 0)
            assert reply.accepted, reply.reason

            # The whole aggregate arrives while the coordinator's apply is held.
            stream = aiter(peer.stub.GetAggregate(pb.AggregateRequest(peer_id="a", round=0), metadata=peer.md,
                                                  timeout=60))
            header = (await anext(stream)).header
            assert (header.round, header.aborted, list(header.contributors)) == (0, False, ["a"])
            parts, data = wire.Reassembler(), None
            while data is None:
                data = parts.add((await anext(stream)).part)
            assert await asyncio.to_thread(applying.wait, 30), "the coordinator did not start its apply"
            agg = wire.decode(data, expected=peer.opt.param_specs())[1]
            peer.opt.restore(payload, kept=agg)
            peer.opt.apply(agg, lr=peer.lr(0))
            peer.opt.zero_grad()
            assert peer.digest() != before

            # What needs the applied parameters waits for them: the digest, the Status, the next Submit.
            trailer = asyncio.create_task(anext(stream))
            status = asyncio.create_task(peer.status())
            submitted = asyncio.create_task(_submit(peer, 1))
            await asyncio.sleep(0.5)
            assert not trailer.done() and not status.done() and not submitted.done()
            gate.set()
            assert (await trailer).trailer.param_digest == peer.digest()
            got = await status
            assert (got.round, got.param_digest) == (1, peer.digest())
            reply, payload = await submitted
            assert reply.accepted and reply.refusal == pb.REFUSAL_NONE, reply.reason  # no false resync

            closed, agg = await peer.aggregate(1)
            peer.opt.restore(payload, kept=agg)
            peer.opt.apply(agg, lr=peer.lr(1))
            peer.opt.zero_grad()
            assert closed.param_digest == peer.digest()
            _, closed = await peer.step(2)
            assert closed.param_digest == peer.digest()
            await asyncio.wait_for(server, 60)  # the run's last round: it stops after its apply and its state write
            saved = torch.load(tmp_path / "state" / STATE_FILE, weights_only=False)
            assert (saved["rounds"]["round"], saved["digest"]) == (3, peer.digest())
            await peer.channel.close()
        finally:
            gate.set()  # before the server stops: its shutdown awaits the held apply
