"""How the round loop lands a round: wait for its outcome, settle it, check its digest against the canonical one,
and write its metrics row (`land`, `check`, `write_unchecked`). Functions of the loop (`Landing`), as the
pipelines are; `demonet.loop.round_loop.RoundLoop.land` and `check` call them. Imports asyncio, the replica and
transport protocols and the loop's state; never the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Protocol, TextIO

from demonet.errors import DemonetError, PeerUnavailable
from demonet.optim import Payload
from demonet.transport import Resync, RoundResult, StaleRound

from .link import LinkPace
from .plain import apply_missed, caught_up_by_aggregates
from .rows import MetricsRow
from .state import InFlight, LoopSteps, RoundOutcome, Unchecked

__all__ = ["Landing", "checkpoint_due", "check", "land", "write_unchecked"]


class Landing(LoopSteps, Protocol):
    """What landing a round reads and sets besides the pipeline's steps (`demonet.loop.round_loop.RoundLoop`)."""

    peer_id: str
    stop: asyncio.Event
    stop_grace_s: float | None
    overlap: int
    link: LinkPace | None
    checkpoint_every: int
    resyncs: int
    total_rounds: int
    row_extra: dict[str, Any]

    def paced(self, flight: InFlight, exchange_s: float, next_round_s: float | None) -> None: ...


async def _outcome(loop: Landing, gather: asyncio.Task[RoundResult]) -> RoundResult | None:
    if loop.stop_grace_s is None:
        return await gather
    stopped = asyncio.create_task(loop.stop.wait())
    try:
        await asyncio.wait({gather, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not gather.done():
        loop.log.info("stopping: waiting up to %.0f s for the round to close", loop.stop_grace_s)
        await asyncio.wait({gather}, timeout=loop.stop_grace_s)
    if not gather.done():
        gather.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gather
        return None
    return gather.result()


def _settle(loop: Landing, payload: Payload, result: RoundResult) -> str:
    """Restore and apply by the outcome, then the new digest (one trip to a worker thread)."""
    loop.replica.settle(payload, result, loop.peer_id in result.contributors)
    return loop.replica.digest()


async def land(loop: Landing, flight: InFlight, metrics: TextIO | None, *, defer: bool = False) -> RoundOutcome:
    """Wait for an in-flight round's outcome and settle it; check its digest and write its metrics row.

    `defer` (plain rounds): a canonical digest that has not come by the settle (coordinator mode: the
    coordinator applies the round while this peer does) is checked after the next round's forward and
    backward (`run_round`), and the row written then, unless this round ends with a checkpoint. Only
    where the gatherer serves this process alone (`digest_follows`): a FlexDeMo node's ranks must
    agree at the same points.

    Returns:
        how the round ended for this peer (`RoundOutcome`).
    """
    t_wait = time.perf_counter()
    try:
        result = await _outcome(loop, flight.gather)
    except DemonetError as e:  # the payload reached no aggregate this peer will apply
        await asyncio.to_thread(loop.replica.restore, flight.payload)
        if isinstance(e, PeerUnavailable):
            raise
        if isinstance(e, Resync):  # the run holds other parameters
            loop.resyncs += 1
        if isinstance(e, StaleRound) and loop.total_rounds and e.open_round >= loop.total_rounds:
            # Nothing left to catch up to: the coordinator serves the last parameters only while it lingers.
            loop.log.warning("%s: %s; the run's %d rounds are done: this peer ends at round %d", type(e).__name__,
                             e, loop.total_rounds, loop.round)
            return RoundOutcome.STOPPED
        if isinstance(e, StaleRound) and not loop.overlap and await caught_up_by_aggregates(loop, flight.payload):
            loop.log.info("%s: %s; caught up by the aggregates since", type(e).__name__, e)
            return RoundOutcome.CAUGHT_UP
        loop.log.warning("%s: %s; catching up", type(e).__name__, e)
        await loop.load_parameters(await loop.membership.catch_up(e, loop.round, loop.replica.expected()))
        return RoundOutcome.CAUGHT_UP
    wait_s = time.perf_counter() - t_wait
    if result is None:
        await asyncio.to_thread(loop.replica.restore, flight.payload)
        loop.log.info("abandoned the round")
        return RoundOutcome.STOPPED
    if result.before:  # a late payload, counted in a later round: the rounds between come first
        if not await apply_missed(loop, list(result.before)):
            await asyncio.to_thread(loop.replica.restore, flight.payload)  # the run's parameters are loaded
            return RoundOutcome.CAUGHT_UP
        flight.stale = len(result.before)
        loop.log.info("its payload of round %d counted in round %d: applied the %d rounds between",
                      result.before[0].round, result.round, len(result.before))
    t1 = time.perf_counter()
    loop.digest = await asyncio.to_thread(_settle, loop, flight.payload, result)
    settled = time.perf_counter()
    cost_s = flight.compute_s - flight.train_s + settled - t1  # this round's exchange: the cut-off leaves room
    # Its upload: a Submit's, start to reply (coordinator mode), or its parts' until their receipts (DHT mode;
    # 0 where they were read too soon to time: then the one its uplink's rate predicts, if it has one).
    upload_s = result.phases.get("submit", result.phases.get("upload", 0.0))
    sent_k = flight.payload.topk()
    if not loop.overlap:  # an overlapped round's upload runs beside the next round's training
        predicted = loop.link.upload_s(sent_k) if loop.link is not None else 0.0
        cost_s += result.phases.get("encode", 0.0) + (upload_s or predicted)
    if loop.link is not None:
        loop.link.sent(sent_k, int(result.phases.get("upload_bytes", result.bytes_up)), upload_s)
    loop.paced(flight, cost_s, result.next_round_s)
    loop.spanning = result.spans
    if flight.micro_batches:
        loop.last_loss = flight.loss
    row = MetricsRow(
        round=loop.round, peer=loop.peer_id, loss=flight.loss, bytes_up=result.bytes_up,
        bytes_down=result.bytes_down, param_digest=loop.digest, round_time_s=settled - flight.started,
        compute_s=flight.compute_s + settled - t1, wait_s=wait_s + flight.checked_s,
        contributors=len(result.contributors), aborted=result.aborted, overlap=loop.overlap, time=time.time(),
        phases=dict(result.phases), samples=flight.samples, micro_batches=flight.micro_batches, topk=sent_k,
        extra=dict(loop.row_extra))
    if flight.checked_s:  # the wait, after this round's backward, for the round before's canonical digest
        row.phases["check"] = flight.checked_s
    if flight.encode_s:  # the gatherer's encode ahead, in the training's thread (`EncodesAhead`)
        row.phases["encode"] = flight.encode_s
    if flight.stale:  # a count: how many rounds old the gradient's parameters were (`plain.spanned`)
        row.phases["stale_rounds"] = flight.stale
    loop.log.info("loss %.4f, up %d B, down %d B, %d contributors%s", flight.loss, result.bytes_up,
                  result.bytes_down, len(result.contributors), " (aborted)" if result.aborted else "")
    loop.round += 1
    later = result.digest_later
    if (defer and loop.gatherer.digest_follows and later is not None and not later.done()
            and not checkpoint_due(loop)):
        loop.unchecked = Unchecked(result, row)
        return RoundOutcome.APPLIED
    return await loop.check(Unchecked(result, row), metrics, deferred=False)


async def check(loop: Landing, unchecked: Unchecked, metrics: TextIO | None, *, deferred: bool = True) -> RoundOutcome:
    """Compare a settled round's digest with the canonical one (waiting for it if it comes later), load
    the run's parameters if they differ, and write the round's row (`RoundLoop.check` then saves a checkpoint
    when one is due). Not `deferred` (right after the settle): the wait counts in the round's time.

    The one place a peer's digest is compared with the run's. Returns APPLIED (on the canonical parameters)
    or CAUGHT_UP (the run's were loaded)."""
    loop.unchecked = None
    result, row = unchecked.result, unchecked.row
    t0 = time.perf_counter()
    try:  # the coordinator applies the round while this peer does: its digest may come only now
        canonical = await result.canonical_digest()
    except DemonetError as e:  # a coordinator that died after its publish: the next Submit's check stands in
        loop.log.warning("%s; the coordinator checks the digest again at the next submit", e)
        canonical = ""
    row.canonical_digest = canonical
    if result.digest_later is not None and not deferred:  # the wait after this peer's settle
        waited = time.perf_counter() - t0
        row.phases["digest"] = waited
        row.round_time_s += waited
        row.wait_s += waited
        row.time = time.time()
    landed = RoundOutcome.APPLIED
    if await loop.membership.agree(bool(canonical) and loop.digest != canonical):
        loop.log.warning("digest %s after applying round %d, the run has %s: downloading parameters",
                         loop.digest[:12], row.round, canonical[:12])
        params = await loop.membership.parameters(loop.round, loop.replica.expected(), resync=True)
        await loop.load_parameters(params)
        loop.resyncs += 1
        row.param_digest, row.resynced = loop.digest, True
        landed = RoundOutcome.CAUGHT_UP
    _write_row(loop, row, metrics)
    return landed


def checkpoint_due(loop: Landing) -> bool:
    """Whether the round the loop is at starts with a checkpoint (every `checkpoint_every` rounds)."""
    return bool(loop.checkpoint_every) and loop.round % loop.checkpoint_every == 0


def _write_row(loop: Landing, row: MetricsRow, metrics: TextIO | None) -> None:
    row.resyncs = loop.resyncs
    if metrics is not None:
        metrics.write(row.to_json() + "\n")
        metrics.flush()


def write_unchecked(loop: Landing, metrics: TextIO | None) -> None:
    """The row of a round whose check an error or a stop cut short: with its digest if it came."""
    unchecked, loop.unchecked = loop.unchecked, None
    if unchecked is None:
        return
    later = unchecked.result.digest_later
    assert later is not None
    if later.done() and not later.cancelled() and later.exception() is None:
        unchecked.row.canonical_digest = later.result()
    else:
        later.cancel()
    _write_row(loop, unchecked.row, metrics)
