"""The plain pipeline (`[net] overlap = 0`): one round after the other. A round whose canonical digest had not
come by its settle is checked after the next round's forward and backward, before its compress. It drives the
loop through its steps (`LoopSteps`), as the overlapped pipeline does; never imports the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TextIO

import torch

from demonet.errors import DemonetError, PeerUnavailable
from demonet.optim import Payload
from demonet.train.replica import Replica
from demonet.transport import RoundResult

from .state import LoopSteps, RoundOutcome

__all__ = ["CATCH_UP_ROUNDS", "apply_missed", "caught_up_by_aggregates", "plain_round"]

CATCH_UP_ROUNDS = 64
"""The most rounds a peer catches up by their aggregates (a coordinator keeps up to 64); beyond, it downloads the
parameters."""


async def plain_round(loop: LoopSteps, metrics: TextIO | None) -> bool:
    """Train, gather and settle one round; False when the peer should stop (SIGTERM).

    When the round before's canonical digest had not come by its settle (`unchecked`), it is checked
    after this round's forward and backward, before the compress: on the canonical parameters the
    round goes on; off them, its gradients are dropped (its compress never ran, so the momentum is as
    the check at the settle would have left it), the run's parameters are loaded, and the round is
    trained again from them."""
    await loop.membership.begin_round(loop.round, loop.digest, loop.replica.named_parameters)
    t0 = time.perf_counter()
    encode_s = 0.0
    until = loop.cutoff()
    checked_s = 0.0
    if loop.unchecked is None:
        encode = loop.encoder.encode_ahead(loop.round) if loop.encoder is not None else None
        loss, payload, staged, encode_s, train_s = await asyncio.to_thread(_train_step, loop, until, encode)
        compute_s = time.perf_counter() - t0 - encode_s
    else:
        loss = await asyncio.to_thread(loop.replica.forward_backward, until)
        compute_s = train_s = time.perf_counter() - t0
        if loop.unchecked is not None:
            on_canonical, checked_s = await _check_before_compress(loop, metrics)
            if not on_canonical:
                return True
        t1 = time.perf_counter()
        payload, staged = await asyncio.to_thread(loop.compress, loop.replica, False)
        compute_s += time.perf_counter() - t1
    flight = loop.submit(payload, staged, loss, started=t0, compute_s=compute_s, samples=loop.replica.samples(),
                         micro_batches=loop.replica.micro_batches(), train_s=train_s)
    flight.checked_s, flight.encode_s = checked_s, encode_s
    return await loop.land(flight, metrics, defer=True) != RoundOutcome.STOPPED


async def _check_before_compress(loop: LoopSteps, metrics: TextIO | None) -> tuple[bool, float]:
    """The deferred check of the round before (`plain_round`); returns (on the canonical parameters, the
    seconds this round waited for the digest)."""
    unchecked, t0 = loop.unchecked, time.perf_counter()
    assert unchecked is not None
    if await loop.check(unchecked, metrics) == RoundOutcome.APPLIED:
        return True, time.perf_counter() - t0
    await asyncio.to_thread(loop.replica.drop_gradients)
    return False, 0.0


async def apply_missed(loop: LoopSteps, missed: list[RoundResult]) -> bool:
    """Apply the aggregates of rounds this peer had nothing in, in order, each checked against its canonical
    digest. Returns False where a digest differed: the peer then has the run's parameters, downloaded (a resync)."""
    for result in missed:
        loop.digest = await asyncio.to_thread(_apply_one, loop.replica, result)
        loop.round = result.round + 1
        canonical = await result.canonical_digest()
        if loop.digest != canonical:
            loop.log.warning("digest %s after applying round %d, the run has %s: downloading parameters",
                             loop.digest[:12], result.round, canonical[:12])
            await loop.load_parameters(await loop.membership.parameters(loop.round, loop.replica.expected(),
                                                                        resync=True))
            return False
    return True


async def caught_up_by_aggregates(loop: LoopSteps, like: Payload) -> bool:
    """After a payload came too late for its round (and went back into the momentum): get back in step by the
    aggregates of the rounds it missed, not the parameters (a coordinator limits their downloads). False where
    that cannot be done (too many rounds, an aggregate gone, off the canonical digest): the caller downloads."""
    try:
        missed = await loop.membership.moved_on(loop.round, like, CATCH_UP_ROUNDS)
    except DemonetError as e:
        if isinstance(e, PeerUnavailable):
            raise
        return False
    return missed is not None and await apply_missed(loop, missed)


def _apply_one(replica: Replica, result: RoundResult) -> str:
    """Apply the aggregate of a round this peer had nothing in, and the digest after it (one worker thread)."""
    replica.settle(None, result, False)
    return replica.digest()


def _train_step(loop: LoopSteps, until: float | None, encode: Callable[[Payload], None] | None = None
                ) -> tuple[float, Payload, tuple[Payload, torch.cuda.Event | None], float, float]:
    """A plain round's training until `until` (`LoopSteps.cutoff`): its loss, its payload, the payload's host
    copy (`to_host`: the exchange always gets a host payload, on a GPU too), the seconds `encode` took on that
    copy (`EncodesAhead.encode_ahead`), which are not the round's compute, and the forward and backward's."""
    t0 = time.perf_counter()
    loss = loop.replica.forward_backward(until)
    train_s = time.perf_counter() - t0
    payload, staged = loop.compress(loop.replica, False)
    if encode is None:
        return loss, payload, staged, 0.0, train_s
    t0 = time.perf_counter()
    if staged[1] is not None:
        staged[1].synchronize()
    try:
        encode(staged[0])
    except Exception as e:  # noqa: BLE001 - only a head start: `gather` encodes again, and handles what fails there
        loop.log.warning("encoding the payload ahead failed (%s: %s); the exchange encodes it", type(e).__name__, e)
    return loss, payload, staged, time.perf_counter() - t0, train_s
