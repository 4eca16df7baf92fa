"""The round loop: train, compress, gather, settle, round after round, over any transport.

`RoundLoop` drives a replica (`demonet.train.replica.Replica`: a `demonet.train.trainer.Trainer` or a FlexDeMo
rank) through a `demonet.transport.Membership` and a `demonet.transport.Gatherer`: the gRPC coordinator, the
in-process coordinator of `demonet train`, the DHT and a FlexDeMo node's rank 0 are all the same loop. The
plain pipeline is here; the overlapped one is `demonet.loop.overlapped`; both land and check their rounds
through the loop's `land` and `check` (`demonet.loop.landing`). Imports the transport protocols; no grpc, no
hivemind, no coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from demonet.errors import DemonetError, PeerUnavailable
from demonet.optim import Payload, to_host
from demonet.train.replica import Replica, Spanning
from demonet.transport import (
    Digest,
    EncodesAhead,
    Gatherer,
    JoinInfo,
    Membership,
    Pace,
    Parameters,
    RoundResult,
    keep_alive,
)

from . import landing
from .link import LinkPace
from .overlapped import overlapped_rounds
from .pacing import PeerPace
from .plain import plain_round
from .spanning import spanning_round
from .state import STOP_GRACE_S, InFlight, RoundLog, RoundOutcome, SpanJob, Unchecked, check_beats

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
    spanning: bool = field(default=False, init=False)
    """The last round's result said this peer's micro-batch spans rounds (DHT mode: `RoundResult.spans`)."""
    span: SpanJob | None = field(default=None, init=False)
    """The micro-batch running across rounds, if one is (`demonet.loop.spanning`)."""
    last_loss: float = field(default=0.0, init=False)
    """The loss of the last round that trained a micro-batch."""

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
                    landing.write_unchecked(self, metrics)
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

    def paced(self, flight: InFlight, exchange_s: float, next_round_s: float | None) -> None:
        """After a round (`demonet.loop.landing.land`): this peer's micro-batch and exchange times, and the next
        round's length."""
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

    def submit(self, payload: Payload, staged: tuple[Payload, torch.cuda.Event | None], loss: float, *,
               started: float, compute_s: float, ahead: bool = False, samples: int = 1, micro_batches: int = 1,
               train_s: float = 0.0) -> InFlight:
        """Start the exchange of the open round's payload (a task: training may go on meanwhile).

        `staged`: the payload's host copy and the event that says it is there (`to_host`): the exchange
        sends that copy, and `payload` stays on the device for the settle or the restore. `ahead`: the
        payload of the round after the open one, sent before the open round is settled, its digest to
        follow (`InFlight.digest`; the gatherer must have `digest_follows`). `micro_batches` and `train_s`: the
        payload's micro-batches and their forward and backward seconds (sent with its speed, for the dashboards)."""
        sent, ready = staged
        round, digest = self.round + ahead, Digest.to_follow() if ahead else None
        pace = dataclasses.replace(self.pace() or Pace(), micro_batches=micro_batches, compute_s=train_s,
                                   upload_s=self.link.last_s if self.link is not None else 0.0)
        gather = asyncio.create_task(self._gather(round, sent, ready, loss=loss, samples=samples, pace=pace,
                                                  param_digest=Digest(self.digest) if digest is None else digest))
        return InFlight(round, payload, loss, gather, started, compute_s, digest, samples=samples, train_s=train_s,
                        micro_batches=micro_batches)

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

    async def run_round(self, metrics: TextIO | None) -> bool:
        """Train, gather and settle one plain round (`demonet.loop.plain.plain_round`); False when the peer
        should stop (SIGTERM)."""
        if (self.spanning or self.span is not None) and isinstance(self.replica, Spanning):
            return await spanning_round(self, self.replica, metrics)
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
        """Wait for an in-flight round's outcome, settle it, check its digest and write its metrics row
        (`demonet.loop.landing.land`, which says what `defer` does).

        Returns:
            how the round ended for this peer (`RoundOutcome`).
        """
        return await landing.land(self, flight, metrics, defer=defer)

    async def check(self, unchecked: Unchecked, metrics: TextIO | None, *, deferred: bool = True) -> RoundOutcome:
        """Compare a settled round's digest with the canonical one and write its row (`demonet.loop.landing.check`),
        then save a checkpoint when one is due. Returns APPLIED (on the canonical parameters) or CAUGHT_UP (the
        run's were loaded)."""
        landed = await landing.check(self, unchecked, metrics, deferred=deferred)
        if landing.checkpoint_due(self):
            await asyncio.to_thread(self._save)
        return landed
