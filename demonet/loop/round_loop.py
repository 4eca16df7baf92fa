"""The round loop: train, compress, gather, settle, round after round, over any transport.

`RoundLoop` drives a replica (`demonet.train.replica.Replica`: a `demonet.train.trainer.Trainer` or a FlexDeMo
rank) through a `demonet.transport.Membership` and a `demonet.transport.Gatherer`: the gRPC coordinator, the
in-process coordinator of `demonet train`, the DHT and a FlexDeMo node's rank 0 are all the same loop. The
plain pipeline is here; the overlapped one is `demonet.loop.overlapped`; both land and check their rounds
through the loop's `land` and `check`. Imports the transport protocols; no grpc, no hivemind, no coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from demonet.errors import DemonetError, PeerUnavailable
from demonet.optim import Payload, to_host
from demonet.train.replica import Replica
from demonet.transport import (
    Digest,
    EncodesAhead,
    Gatherer,
    JoinInfo,
    Membership,
    Pace,
    Parameters,
    Resync,
    RoundResult,
    StaleRound,
    keep_alive,
)

from .link import LinkPace
from .overlapped import overlapped_rounds
from .pacing import PeerPace
from .plain import apply_missed, caught_up_by_aggregates, plain_round
from .rows import MetricsRow
from .state import STOP_GRACE_S, InFlight, RoundLog, RoundOutcome, Unchecked, check_beats

__all__ = ["RoundLoop"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class RoundLoop:
    """One peer's rounds until the run's last one, `stop`, or an unreachable run.

    Args:
        replica: the model, optimizer and data of this peer.
        membership, gatherer: the transport.
        peer_id: this peer's id (its metrics rows and checkpoint carry it).
        metrics: the JSON-lines file every round appends a row to; None: no rows (a FlexDeMo rank > 0).
        checkpoint_every: save every this many rounds (and at the end); 0: only at the end.
        stop: set it (SIGTERM) to end after the open round.
        stop_grace_s: after `stop`, how long to wait for the open round before abandoning it; None:
            wait for its end (the ranks of a FlexDeMo node must all take the same steps).
        overlap: 1: train round r+1 while round r's exchange runs (the replica must be `Overlapping`);
            0: one round after the other.
        lookahead: with overlap, train round r+1 from the parameters after this peer's own round-r
            update (replaced by the aggregate when it arrives); False: from round r's parameters.
    """

    replica: Replica
    membership: Membership
    gatherer: Gatherer
    peer_id: str
    metrics: Path | None
    checkpoint_every: int = 10
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    stop_grace_s: float | None = STOP_GRACE_S
    overlap: int = 0
    lookahead: bool = True
    round_s: float = 0.0
    """Rounds by the clock: each round trains micro-batches until `cutoff`; 0: the replica's fixed
    micro-batches (lockstep). `[net] round_s` at the start; then what the coordinator announces with each
    aggregate (`RoundResult.next_round_s`: the fixed length, the automatic one, or 0)."""
    link: LinkPace | None = None
    """This peer's uplink and the k it sends (`[optim] adaptive_topk`); None: `compression_topk` always."""
    timing: PeerPace = field(default_factory=PeerPace)
    """This peer's micro-batch and exchange times (the cut-off and the report to the coordinator)."""
    _warned_slow: bool = field(default=False, init=False)
    round: int = 0
    digest: str = ""
    resyncs: int = 0
    """Whole-parameter downloads because this peer's digest differed from the canonical one (the
    `resyncs` field of every metrics row): each is the dense transfer the compressed rounds avoid."""
    total_rounds: int = 0
    row_extra: dict[str, Any] = field(default_factory=dict)
    """Fields added to every metrics row (a FlexDeMo node's rank count)."""
    unreachable: PeerUnavailable | None = None
    """Why `run` returned 1: the run could not be reached (None otherwise)."""
    log: RoundLog = field(init=False)
    unchecked: Unchecked | None = field(default=None, init=False)
    """A plain round whose canonical digest had not come when it was settled: checked after the next
    round's forward and backward, before its compress (`_check_before_compress`)."""
    encoder: EncodesAhead | None = field(default=None, init=False)
    """The gatherer, where it encodes a payload ahead in the training's thread."""

    def __post_init__(self) -> None:
        self.log = RoundLog(self.peer_id, lambda: self.round, logger)
        self.encoder = self.gatherer if isinstance(self.gatherer, EncodesAhead) else None

    async def run(self, info: JoinInfo) -> int:
        """Download the parameters to start from, resume the checkpoint, then run rounds.

        Returns:
            0 after the run's last round or a graceful stop; 1 if the run could not be reached.
        """
        self.round, self.total_rounds = info.round, info.total_rounds
        if self.total_rounds and self.round >= self.total_rounds:
            self.log.info("the run is over")
            return 0
        beats = None
        if info.heartbeat_interval_s > 0:  # alive from here on, the first download included
            beats = asyncio.create_task(keep_alive(self.membership, lambda: self.round, info.heartbeat_interval_s,
                                                   self.log))
        started = False
        try:
            first = await self.membership.first_parameters(info, self.replica.expected())
            if first is None:
                self.digest = await asyncio.to_thread(self.replica.digest)
                self.log.info("starting from the initial parameters (digest %s)", self.digest[:12])
            else:
                await self.load_parameters(first)
            await asyncio.to_thread(self._resume)
            started = True
            return await self._rounds(beats)
        except PeerUnavailable as e:
            self.log.error("%s", e)
            self.unreachable = e
            return 1
        finally:
            if beats is not None:  # first: a heartbeat after the leave would be told "no member" and join again
                beats.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beats
            if self.stop.is_set():  # a graceful stop (also a joined run closed mid-round): say so, then save
                await self.membership.leave(self.round)
            if started:
                await asyncio.to_thread(self._save)

    async def _rounds(self, beats: asyncio.Task[None] | None) -> int:
        if self.metrics is not None:
            self.metrics.parent.mkdir(parents=True, exist_ok=True)
        with open(self.metrics, "a") if self.metrics is not None else contextlib.nullcontext(None) as metrics:
            if self.overlap:
                await overlapped_rounds(self, metrics, beats)
            else:
                try:
                    while await self.membership.agree(self.go(self.round)):
                        if not await self.run_round(metrics):
                            break
                        check_beats(beats)
                    if self.unchecked is not None:  # the last round's digest
                        await self.check(self.unchecked, metrics)
                finally:
                    self._write_unchecked(metrics)
        self.log.info("stopping" if self.stop.is_set() else "the run is over")
        return 0

    def cutoff(self) -> float | None:
        """When the round starting now stops training (a `time.perf_counter()` time): `round_s` from now less
        the predicted exchange; None: lockstep. The replica trains at least one micro-batch anyway."""
        if not self.round_s:
            return None
        return time.perf_counter() + self.round_s - self.timing.exchange_s

    def pace(self) -> Pace | None:
        """This peer's speed for the coordinator's automatic round length: its own round and a round of one
        micro-batch, exchange included (None before its first round is measured)."""
        return self.timing.report(self.link)

    def _paced(self, flight: InFlight, exchange_s: float, next_round_s: float | None) -> None:
        """After a round: this peer's micro-batch and exchange times, and the next round's length."""
        least_s = self.timing.measured(flight.micro_batches, flight.train_s, exchange_s, lockstep=not self.round_s)
        if next_round_s is not None:
            self.round_s = next_round_s
        if self.round_s and least_s > self.round_s and not self._warned_slow:
            self._warned_slow = True
            self.log.warning("one micro-batch and the exchange take this peer %.2f s, over the round's %.2f s: it "
                             "trains one micro-batch a round and is late to rounds that do not wait for it "
                             "(docs/coordinator.md#mixed-speed-peers)", least_s, self.round_s)

    def go(self, next_round: int) -> bool:
        """Whether to train `next_round`: no stop asked, and the run has it."""
        return not self.stop.is_set() and (not self.total_rounds or next_round < self.total_rounds)

    # -- state ---------------------------------------------------------------------------------------

    async def load_parameters(self, params: Parameters) -> None:
        await asyncio.to_thread(self.replica.load, params.tensors)
        self.round, self.digest = params.round, await asyncio.to_thread(self.replica.digest)
        self.log.info("parameters of round %d loaded from %s (%d bytes, digest %s)", params.round, params.source,
                      params.size, self.digest[:12])

    def _save(self) -> None:
        self.replica.save({"peer_id": self.peer_id, "round": self.round, "param_digest": self.digest,
                           "resyncs": self.resyncs})

    def _resume(self) -> None:
        """Take the momentum from the checkpoint if it was saved at the round the parameters are at.

        Otherwise the momentum starts at zero, as a late joiner's does. The data stream continues
        where it stopped either way (same seed), so a restarted peer does not see its batches again,
        and so does the count of resyncs its metrics rows carry.
        """
        saved = self.replica.saved()
        if saved is None:
            return
        self.resyncs = int(saved.get("resyncs", 0))
        momentum = saved.get("peer_id") == self.peer_id and saved.get("round") == self.round
        self.replica.resume(momentum=momentum)
        if momentum:
            self.log.info("resumed the momentum from the checkpoint")
        else:
            self.log.info("checkpoint is from round %s: starting with zero momentum", saved.get("round"))

    # -- one round -----------------------------------------------------------------------------------

    async def _outcome(self, gather: asyncio.Task[RoundResult]) -> RoundResult | None:
        if self.stop_grace_s is None:
            return await gather
        stopped = asyncio.create_task(self.stop.wait())
        try:
            await asyncio.wait({gather, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if not gather.done():
            self.log.info("stopping: waiting up to %.0f s for the round to close", self.stop_grace_s)
            await asyncio.wait({gather}, timeout=self.stop_grace_s)
        if not gather.done():
            gather.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gather
            return None
        return gather.result()

    def submit(self, payload: Payload, staged: tuple[Payload, torch.cuda.Event | None], loss: float, *,
               started: float, compute_s: float, ahead: bool = False, samples: int = 1) -> InFlight:
        """Start the exchange of the open round's payload (a task: training may go on meanwhile).

        `staged`: the payload's host copy and the event that says it is there (`to_host`): the exchange
        sends that copy, and `payload` stays on the device for the settle or the restore. `ahead`: the
        payload of the round after the open one, sent before the open round is settled, its digest to
        follow (`InFlight.digest`; the gatherer must have `digest_follows`)."""
        sent, ready = staged
        round, digest = self.round + ahead, Digest.to_follow() if ahead else None
        gather = asyncio.create_task(self._gather(round, sent, ready, loss=loss, samples=samples, pace=self.pace(),
                                                  param_digest=Digest(self.digest) if digest is None else digest))
        return InFlight(round, payload, loss, gather, started, compute_s, digest, samples=samples)

    @staticmethod
    async def drop(flight: InFlight) -> None:
        """Cancel a round's exchange (the caller restores its payload, or undoes its compress). The exchange
        first, then a digest still to come: a stream sent ahead is cancelled, never ended without its
        digest (which the coordinator would count as an invalid submission)."""
        flight.gather.cancel()
        with contextlib.suppress(asyncio.CancelledError, DemonetError):
            await flight.gather
        if flight.digest is not None:
            flight.digest.cancel()

    async def _gather(self, round: int, payload: Payload, ready: torch.cuda.Event | None, *, loss: float,
                      param_digest: Digest, samples: int, pace: Pace | None) -> RoundResult:
        if ready is not None:  # the host copy is made on a side stream: wait for it, not for the training
            await asyncio.to_thread(ready.synchronize)
        return await self.gatherer.gather(round, payload, loss=loss, param_digest=param_digest, samples=samples,
                                          pace=pace)

    def _settle(self, payload: Payload, result: RoundResult) -> str:
        """Restore and apply by the outcome, then the new digest (one trip to a worker thread)."""
        self.replica.settle(payload, result, self.peer_id in result.contributors)
        return self.replica.digest()

    async def run_round(self, metrics: TextIO | None) -> bool:
        """Train, gather and settle one plain round (`demonet.loop.plain.plain_round`); False when the peer
        should stop (SIGTERM)."""
        return await plain_round(self, metrics)

    def compress(self, replica: Replica, undoable: bool) -> tuple[Payload, tuple[Payload, torch.cuda.Event | None]]:
        """The round's payload, at the k this peer's uplink carries in its share of the round (`LinkPace`), and
        its host copy on its way (`to_host`: on a GPU the exchange must not wait for the next round's kernels)."""
        topk = None
        if self.link is not None:
            k = self.link.choose(self.round_s)
            topk = k if k != self.link.max_k else None
        payload = replica.compress(undoable=undoable, topk=topk)
        return payload, to_host(payload)

    async def land(self, flight: InFlight, metrics: TextIO | None, *, defer: bool = False) -> RoundOutcome:
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
            result = await self._outcome(flight.gather)
        except DemonetError as e:  # the payload reached no aggregate this peer will apply
            await asyncio.to_thread(self.replica.restore, flight.payload)
            if isinstance(e, PeerUnavailable):
                raise
            if isinstance(e, Resync):  # the run holds other parameters
                self.resyncs += 1
            if isinstance(e, StaleRound) and self.total_rounds and e.open_round >= self.total_rounds:
                # Nothing left to catch up to: the coordinator serves the last parameters only while it lingers.
                self.log.warning("%s: %s; the run's %d rounds are done: this peer ends at round %d", type(e).__name__,
                                 e, self.total_rounds, self.round)
                return RoundOutcome.STOPPED
            if isinstance(e, StaleRound) and not self.overlap and await caught_up_by_aggregates(self, flight.payload):
                self.log.info("%s: %s; caught up by the aggregates since", type(e).__name__, e)
                return RoundOutcome.CAUGHT_UP
            self.log.warning("%s: %s; catching up", type(e).__name__, e)
            await self.load_parameters(await self.membership.catch_up(e, self.round, self.replica.expected()))
            return RoundOutcome.CAUGHT_UP
        wait_s = time.perf_counter() - t_wait
        if result is None:
            await asyncio.to_thread(self.replica.restore, flight.payload)
            self.log.info("abandoned the round")
            return RoundOutcome.STOPPED
        if result.before:  # a late payload, counted in a later round: the rounds between come first
            if not await apply_missed(self, list(result.before)):
                await asyncio.to_thread(self.replica.restore, flight.payload)  # the run's parameters are loaded
                return RoundOutcome.CAUGHT_UP
            flight.stale = len(result.before)
            self.log.info("its payload of round %d counted in round %d: applied the %d rounds between",
                          result.before[0].round, result.round, len(result.before))
        t1 = time.perf_counter()
        self.digest = await asyncio.to_thread(self._settle, flight.payload, result)
        settled = time.perf_counter()
        cost_s = flight.compute_s - flight.train_s + settled - t1  # this round's exchange: the cut-off leaves room
        if not self.overlap:  # an overlapped round's upload runs beside the next round's training
            cost_s += result.phases.get("encode", 0.0) + result.phases.get("submit", 0.0)
        sent_k = flight.payload.topk()
        if self.link is not None:
            self.link.sent(sent_k, result.bytes_up, result.phases.get("submit", 0.0))
        self._paced(flight, cost_s, result.next_round_s)
        row = MetricsRow(
            round=self.round, peer=self.peer_id, loss=flight.loss, bytes_up=result.bytes_up,
            bytes_down=result.bytes_down, param_digest=self.digest, round_time_s=settled - flight.started,
            compute_s=flight.compute_s + settled - t1, wait_s=wait_s + flight.checked_s,
            contributors=len(result.contributors), aborted=result.aborted, overlap=self.overlap, time=time.time(),
            phases=dict(result.phases), samples=flight.samples, micro_batches=flight.micro_batches, topk=sent_k,
            extra=dict(self.row_extra))
        if flight.checked_s:  # the wait, after this round's backward, for the round before's canonical digest
            row.phases["check"] = flight.checked_s
        if flight.encode_s:  # the gatherer's encode ahead, in the training's thread (`EncodesAhead`)
            row.phases["encode"] = flight.encode_s
        if flight.stale:  # a count: how many rounds old the gradient's parameters were (`plain.spanned`)
            row.phases["stale_rounds"] = flight.stale
        self.log.info("loss %.4f, up %d B, down %d B, %d contributors%s", flight.loss, result.bytes_up,
                      result.bytes_down, len(result.contributors), " (aborted)" if result.aborted else "")
        self.round += 1
        later = result.digest_later
        if (defer and self.gatherer.digest_follows and later is not None and not later.done()
                and not self._checkpoint_due()):
            self.unchecked = Unchecked(result, row)
            return RoundOutcome.APPLIED
        return await self.check(Unchecked(result, row), metrics, deferred=False)

    def _checkpoint_due(self) -> bool:
        return bool(self.checkpoint_every) and self.round % self.checkpoint_every == 0

    async def check(self, unchecked: Unchecked, metrics: TextIO | None, *, deferred: bool = True) -> RoundOutcome:
        """Compare a settled round's digest with the canonical one (waiting for it if it comes later), load
        the run's parameters if they differ, write the round's row, and save a checkpoint when one is due.
        Not `deferred` (right after the settle): the wait counts in the round's time.

        The one place a peer's digest is compared with the run's. Returns APPLIED (on the canonical parameters)
        or CAUGHT_UP (the run's were loaded)."""
        self.unchecked = None
        result, row = unchecked.result, unchecked.row
        t0 = time.perf_counter()
        try:  # the coordinator applies the round while this peer does: its digest may come only now
            canonical = await result.canonical_digest()
        except DemonetError as e:  # a coordinator that died after its publish: the next Submit's check stands in
            self.log.warning("%s; the coordinator checks the digest again at the next submit", e)
            canonical = ""
        row.canonical_digest = canonical
        if result.digest_later is not None and not deferred:  # the wait after this peer's settle
            waited = time.perf_counter() - t0
            row.phases["digest"] = waited
            row.round_time_s += waited
            row.wait_s += waited
            row.time = time.time()
        landed = RoundOutcome.APPLIED
        if await self.membership.agree(bool(canonical) and self.digest != canonical):
            self.log.warning("digest %s after applying round %d, the run has %s: downloading parameters",
                             self.digest[:12], row.round, canonical[:12])
            params = await self.membership.parameters(self.round, self.replica.expected(), resync=True)
            await self.load_parameters(params)
            self.resyncs += 1
            row.param_digest, row.resynced = self.digest, True
            landed = RoundOutcome.CAUGHT_UP
        self._write_row(row, metrics)
        if self._checkpoint_due():
            await asyncio.to_thread(self._save)
        return landed

    def _write_row(self, row: MetricsRow, metrics: TextIO | None) -> None:
        row.resyncs = self.resyncs
        if metrics is not None:
            metrics.write(row.to_json() + "\n")
            metrics.flush()

    def _write_unchecked(self, metrics: TextIO | None) -> None:
        """The row of a round whose check an error or a stop cut short: with its digest if it came."""
        unchecked, self.unchecked = self.unchecked, None
        if unchecked is None:
            return
        later = unchecked.result.digest_later
        assert later is not None
        if later.done() and not later.cancelled() and later.exception() is None:
            unchecked.row.canonical_digest = later.result()
        else:
            later.cancel()
        self._write_row(unchecked.row, metrics)

