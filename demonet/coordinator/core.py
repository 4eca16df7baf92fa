"""The one round core of both coordinators: membership calls, the round clock, the close, publish before apply,
the aggregates kept for download, the digest check, the refusals, and the hand-off to the state writer.

The gRPC servicer (`demonet.coordinator.server`) and the in-process coordinator of `demonet train`
(`demonet.coordinator.local`) are adapters over one `RoundCore`: they read requests and answer in their own
terms, and the protocol runs here; what a close sets and keeps besides the merge is `demonet.coordinator.closing`.
Imports no grpc and no protobuf; asyncio, the pure rounds and the state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

from demonet.config import Config
from demonet.errors import AggregateGone, PeerUnavailable, Refusal, SubmitRejected
from demonet.optim import Payload
from demonet.train.data import data_seed
from demonet.train.task import param_specs
from demonet.transport import JoinInfo
from demonet.wire.pace import RoundPace

from .closing import count_close, keep, next_round_s
from .inbox import Inbox
from .metrics import Metrics
from .persist import HandOff, Persister
from .rounds import ClosedRound, RoundConfig, Rounds
from .state import CanonicalState, ClosedAggregate
from .status import status_document
from .terms import CoreOptions, Submission

__all__ = ["RoundCore"]

logger = logging.getLogger(__name__)


def _now() -> float:
    return time.monotonic()


class RoundCore:
    """One run's rounds and canonical state, in the caller's event loop.

    A round closes when it is due (`Rounds.due`): it is merged and published at once (`ClosedAggregate` with an
    empty digest), the next round opens, and the apply to the canonical parameters runs after, off the lock;
    its digest follows (`canonical_digest`). Until the apply is done (`applying`), whatever needs the open
    round's parameters (a submission's digest check, a parameter download, the status) waits for it.

    Args:
        cfg: the run.
        opts: rounds, state folder.
        metrics: the counters and the dashboard's record.
        decide: called with each round's outcome before it is merged; returns the outcome to close with (a
            fault plan aborts rounds this way); None: as `Rounds` decided.
        on_open: called, holding `cond`, with the round that just opened (an adapter ends what outlived a round).
        on_applied: called after each closed round is applied, with the round as peers download it.
        state_extra: the adapter's own part of the state file (its keys), taken at each close.
    """

    def __init__(self, cfg: Config, opts: CoreOptions, metrics: Metrics, *,
                 decide: Callable[[ClosedRound], ClosedRound] | None = None,
                 on_open: Callable[[int], None] | None = None,
                 on_applied: Callable[[ClosedAggregate], None] | None = None,
                 state_extra: Callable[[], dict[str, Any]] | None = None) -> None:
        self.cfg, self.opts, self.metrics = cfg, opts, metrics
        self.decide, self.on_open, self.on_applied, self.state_extra = decide, on_open, on_applied, state_extra
        self.state = CanonicalState(cfg)
        net = cfg.net
        self.round_cfg = RoundConfig(round_timeout_s=net.round_timeout_s, min_peers=net.min_peers,
                                     heartbeat_timeout_s=net.heartbeat_timeout_s, start_peers=net.start_peers,
                                     max_idle_rounds=net.max_idle_rounds)
        self.rounds = Rounds(cfg=self.round_cfg, now=_now())
        self.pace = RoundPace(fixed_s=net.round_s, lockstep=net.lockstep, max_micro_batches=net.max_micro_batches,
                              round_timeout_s=net.round_timeout_s)
        """The length of the next round, announced with each aggregate (lockstep, fixed or automatic)."""
        self.aggregates: OrderedDict[int, ClosedAggregate] = OrderedDict()
        self.inbox = Inbox(lambda: self.rounds, metrics)
        """The open round's payloads, and the refusals and resyncs counted (what adapters refuse goes there)."""
        self.cond = asyncio.Condition()
        self.finished = asyncio.Event()
        self.applying: int | None = None
        """The round whose aggregate is published and being applied (guarded by `cond`): until it is applied,
        `state.digest` and `state.params` are still those it started from."""
        self.advancing: asyncio.Task[None] | None = None
        """That apply, the state write it hands over, and the run's end after the last round."""
        self.param_specs = tuple((n, tuple(s), d) for n, s, d in param_specs(self.state.params))
        self.saved = self.state.load(opts.state_dir) if opts.state_dir is not None else None
        """The state file's extras when the run resumed (the adapter restores its own part), else None."""
        if self.saved is not None:
            self.rounds = Rounds.from_state(self.round_cfg, self.saved["rounds"], now=_now())
            for item in self.saved.get("aggregates", []):
                self.aggregates[item.round] = item
            self.metrics.restore(self.saved.get("counters", {}))
        self.persister = None if opts.state_dir is None else Persister(
            opts.state_dir, metrics, on_disk=self.rounds.round if self.saved is not None else None,
            every_s=opts.state_every_s)
        self._hand_off = None if self.persister is None else HandOff(self.persister)
        self.metrics.set_round(self.rounds.round, len(self.rounds.members), 0)

    # -- waiting -------------------------------------------------------------------------------------

    @property
    def wait_s(self) -> float:
        """How long a call may wait for a round to open, close or be applied: two round timeouts and a margin."""
        return 2 * self.cfg.net.round_timeout_s + 30.0

    async def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        """Wait, holding `cond` on return, until `predicate()`.

        Raises:
            PeerUnavailable: not within `wait_s`.
        """
        try:
            # asyncio.timeout, not wait_for: wait_for wraps the wait in a task, and a cancellation
            # (shutdown) there can leave the condition's lock released under the caller (3.11).
            async with asyncio.timeout(self.wait_s):
                await self.cond.wait_for(predicate)
        except TimeoutError:
            raise PeerUnavailable(f"timed out waiting for {what}") from None

    def applied(self) -> bool:
        """Whether the parameters are those at the start of the open round (no apply in flight)."""
        return self.applying is None

    def _changed(self) -> None:
        """After a membership change, holding `cond`: the gauges, and wake the clock (a round may close now)."""
        r = self.rounds
        self.metrics.set_round(r.round, len(r.members), len(r.submitted))
        self.cond.notify_all()

    # -- membership ----------------------------------------------------------------------------------

    async def join(self, peer_id: str, *, probe: bool = False) -> JoinInfo:
        """Admit a peer (its key was checked by the adapter), or with `probe` only tell it the run's terms."""
        async with self.cond:
            if probe:  # a peer about to build its model: it joins once the model fits the run
                first = self.rounds.round
            else:
                first = self.rounds.join(peer_id, _now())
                self._changed()
        if not probe:
            logger.info("[coordinator round=%d] %s joins at round %d", self.rounds.round, peer_id, first)
        net = self.cfg.net
        return JoinInfo(peer_id=peer_id, round=first, run_config=self.cfg.to_dict(),
                        data_seed=data_seed(self.cfg.train.seed, peer_id), round_timeout_s=net.round_timeout_s,
                        heartbeat_interval_s=net.heartbeat_interval_s, total_rounds=self.opts.total_rounds,
                        param_specs=self.param_specs)

    async def heartbeat(self, peer_id: str) -> tuple[int, bool]:
        """The open round, and whether the peer is a member or joiner still (else it must join again)."""
        async with self.cond:
            return self.rounds.round, self.rounds.heartbeat(peer_id, _now())

    async def leave(self, peer_id: str, at_round: int) -> bool:
        """A member's graceful stop: the open round and the next ones stop waiting for it at once."""
        async with self.cond:
            left = self.rounds.leave(peer_id)
            self._changed()  # a round whose other members are all in closes now
        if left:
            logger.info("[coordinator round=%d] %s left (stopped at its round %d)", self.rounds.round, peer_id,
                        at_round)
        return left

    async def withdraw(self, peers: list[str], *, drop: bool) -> None:
        """Rounds stop waiting for these members now (`drop`: they are no members at all until they join again)."""
        async with self.cond:
            for peer_id in peers:
                self.rounds.withdraw(peer_id, _now(), drop=drop)
            self._changed()

    def may_download(self, peer_id: str) -> None:
        """Parameters go to members and admitted joiners only (a dropped peer joins again first).

        Raises:
            SubmitRejected: NOT_MEMBER.
        """
        if peer_id not in self.rounds.members and peer_id not in self.rounds.joiners:
            self.metrics.refused(peer_id, None, "not_member", "GetParameters from a peer that has not joined")
            raise SubmitRejected(f"{peer_id!r} is not a member of the run: Join first", Refusal.NOT_MEMBER)

    async def parameters(self, round: int) -> tuple[int, bytes]:
        """The serialized canonical parameters at the start of `round` or the open round after it, and which."""
        async with self.cond:
            await self.wait_for(lambda: self.rounds.round >= round and self.applied(), f"round {round} to open")
            round_ = self.rounds.round
            return round_, await asyncio.to_thread(self.state.parameters_blob, round_)

    # -- submissions ---------------------------------------------------------------------------------

    async def submit(self, s: Submission) -> int:
        """Count a member's payload for its round, once that round is open and the round before applied, if
        its parameter digest is the canonical one. Returns the open round.

        Raises:
            SubmitRejected: RESYNC, or what the rounds refuse (counted).
            PeerUnavailable: the round did not open in time.
        """
        async with self.cond:
            await self.wait_for(lambda: self.rounds.round >= s.round and self.applied(),
                                f"round {s.round} to open and round {s.round - 1} to be applied")
            canonical = self.state.digest if s.round == self.rounds.round else self._start_digest(s.round)
            over = bool(self.opts.total_rounds) and self.rounds.round >= self.opts.total_rounds
            if s.round < self.rounds.round and (canonical is None or over):
                s = replace(s, late=0)  # its round's parameters are no longer known here, or the run is over: stale
            elif s.param_digest != canonical and s.round <= self.rounds.round:
                self.inbox.resynced(s.peer_id, s.round, f"it submitted with digest {s.param_digest[:12]}, the "
                              f"canonical one is {(canonical or '')[:12]}")
                reason = "parameter digest differs from the canonical one"
                self.metrics.refused(s.peer_id, s.round, "resync", reason)
                raise SubmitRejected(reason, Refusal.RESYNC)
            self.inbox.accept(s)
            self.pace.report(s.peer_id, s.need_s, s.least_s, s.train_s)
            self._changed()
            return self.rounds.round

    def stream_began(self, peer_id: str, round: int) -> None:
        """A member's payload for `round` is on its way (its stream's first part is checked): if that is the open
        round, it waits for it until the stream ends (`Rounds.active`: a newcomer's first payload, say)."""
        self.rounds.arriving(peer_id, round)

    async def stream_ended(self, peer_id: str) -> None:
        """A member's stream ended, its payload counted or not: the open round no longer waits for it as on its
        way (it may close now)."""
        async with self.cond:
            if self.rounds.arrived(peer_id):
                self.cond.notify_all()

    def _start_digest(self, round: int) -> str | None:
        """The canonical digest at the start of a closed `round` (after round - 1's apply), where still kept."""
        before = self.aggregates.get(round - 1)
        return before.param_digest if before is not None and before.param_digest else None

    # -- aggregates ----------------------------------------------------------------------------------

    async def aggregate(self, peer_id: str, round: int, *, submitting: bool = False) -> ClosedAggregate:
        """A round's aggregate as published (its digest may still be empty: `canonical_digest`), once it closes.

        `submitting`: the peer's payload for the round is on its way beside this call.

        Raises:
            AggregateGone: not to be had (see its docstring).
            PeerUnavailable: the round did not close in time.
        """
        async with self.cond:
            r = self.rounds
            if round == r.round and peer_id in r.members and peer_id not in r.submitted and not submitting:
                # After a restart the payload this member sent is gone; it still holds it.
                raise AggregateGone(f"no payload from {peer_id} for round {r.round}: submit it again", resubmit=True)
            if round > r.round:
                # Nobody submits to a round before it opens: this coordinator resumed from a state older
                # than rounds it had published before a crash. The peer gets back in step at the open one.
                raise AggregateGone(f"round {round} has not opened; the open round is {r.round} (the coordinator "
                                    "resumed from its saved state): download the parameters again")
            await self.wait_for(lambda: round in self.aggregates or self.rounds.round > round,
                                f"round {round} to close")
            closed = self.aggregates.get(round)
        if closed is None:
            raise AggregateGone(f"round {round} is too old; download the parameters again")
        return closed

    async def canonical_digest(self, round: int) -> str:
        """The canonical digest after `round` (published, it may still be applied: this waits for it).

        Raises:
            AggregateGone: the round is no longer kept.
            PeerUnavailable: not applied in time.
        """
        async with self.cond:
            await self.wait_for(lambda: round not in self.aggregates or bool(self.aggregates[round].param_digest),
                                f"round {round} to be applied")
            if round not in self.aggregates:
                raise AggregateGone(f"round {round} is too old")
            return self.aggregates[round].param_digest

    # -- status --------------------------------------------------------------------------------------

    async def settled(self) -> None:
        """Wait until the open round's parameters are applied (the status's digest is then the open round's)."""
        async with self.cond:
            await self.wait_for(self.applied, f"round {self.rounds.round - 1} to be applied")

    def status_document(self, since: int | None = None, keys: dict[str, str] | None = None) -> dict[str, Any]:
        """The dashboard's document (docs/dashboard.md). Its digest is the newest applied round's: for the few ms
        while the round just published is applied, the one before's."""
        return status_document(self.rounds, self.metrics, now=_now(), param_digest=self.state.digest,
                               total_rounds=self.opts.total_rounds, since=since, keys=keys,
                               round_length_s=self.pace.round_s)

    # -- the clock -----------------------------------------------------------------------------------

    async def tick_forever(self, max_sleep_s: float = 1.0) -> None:
        """Close rounds when they are due. Runs until cancelled or the run's end.

        It sleeps on the condition until the deadline (at most `max_sleep_s`, so silent peers are
        dropped in time); a submission notifies it, so a round whose members are all in closes at
        once instead of at the next poll. A closed round is published at once; its apply (`_advance`)
        runs without holding `cond`, and the next close waits for it. Cancelling this leaves an apply in
        flight to finish: `advancing` is shielded (the shutdown awaits it before its last state write).
        """
        while not self.finished.is_set():
            advance = None
            async with self.cond:
                if self.rounds.due(_now()):
                    advance = await self._close_round()
                else:
                    sleep_s = min(max_sleep_s, self.rounds.seconds_left(_now()) if self.rounds.started else max_sleep_s)
                    try:
                        async with asyncio.timeout(max(sleep_s, 0.001)):
                            await self.cond.wait()
                    except TimeoutError:
                        pass
            if advance is not None:
                self.advancing = asyncio.create_task(advance)
                await asyncio.shield(self.advancing)

    async def _close_round(self) -> Coroutine[Any, Any, None]:
        """Close and publish the open round, holding `cond`: merge it, record its aggregate (its digest
        still empty), open the next round and wake the waiters. Returns what is left, for after `cond` is
        released: `_advance`, the apply to the canonical parameters."""
        r = self.rounds
        started = _now()
        self.metrics.phase.set(1)
        outcome = r.outcome()  # Rounds alone decides: the state applies (or not) what it says
        if self.decide is not None:
            outcome = self.decide(outcome)
        contributors = outcome.contributors
        payloads, samples, losses = self.inbox.contributions(contributors)
        closed, applied = await asyncio.to_thread(self.state.merge_round, outcome, payloads, samples)
        members, opened_at = tuple(r.members), r.opened_at  # for the dashboard's record, before they change
        decided = r.close(_now())
        self.inbox.clear()  # with the close, not before the merge: see `Inbox.clear`
        closed = replace(closed, next_round_s=next_round_s(self.pace, r, self.cfg.net.round_timeout_s))
        if self.on_open is not None:
            self.on_open(r.round)
        assert decided.round == outcome.round, "the round changed while it was merged; calls should wait on `cond`"
        keep(self.aggregates, closed)
        if applied is not None:
            self.applying = closed.round
        close_s = _now() - started  # the critical path: from here on, nothing waits for the apply but its digest
        count_close(self.metrics, closed, close_s=close_s, losses=losses, members=members, contributors=contributors,
                    round_s=_now() - opened_at, max_sample_ratio=self.cfg.net.max_sample_ratio)
        self.metrics.set_round(r.round, len(r.members), 0)
        self.metrics.phase.set(0)
        self.cond.notify_all()
        # The state file's rounds, counters and keys as of this close, whatever arrives during the apply.
        extra = {"rounds": r.state_dict(), "counters": self.metrics.counters(),
                 **(self.state_extra() if self.state_extra is not None else {})}
        return self._advance(closed, applied, extra, close_s)

    async def _advance(self, closed: ClosedAggregate, applied: Payload | None, extra: dict[str, Any],
                       close_s: float) -> None:
        """Apply a published round (`CanonicalState.advance`), set its digest and wake who waits for it,
        then hand the snapshot of the result to the background writer (`Persister`). Writing the state is
        off the round's critical path; a crash before the write completes loses the rounds published since
        the last one, and the peers that had gone ahead get back in step (a submission or an aggregate for a
        round that has not opened sends them to catch up)."""
        started = _now()
        snapshot = self.persister is not None and self.persister.due()
        digest, body = await asyncio.to_thread(self._apply, closed.round, applied, snapshot)
        async with self.cond:
            if applied is not None:
                closed = replace(closed, param_digest=digest)
                if closed.round in self.aggregates:
                    self.aggregates[closed.round] = closed
                self.applying = None
            self.cond.notify_all()
        logger.info("[coordinator round=%d] %s with %d payloads (%s); digest %s%s; published in %.1f ms, "
                    "applied %.1f ms later", closed.round, "aborted" if closed.aborted else "applied",
                    len(closed.contributors), ", ".join(closed.contributors), closed.param_digest[:12],
                    f"; clipped {', '.join(closed.clipped)}" if closed.clipped else "", 1e3 * close_s,
                    1e3 * (_now() - started))
        if self._hand_off is not None:
            self._hand_off.applied(closed.round + 1, {**extra, "aggregates": [closed]}, body)
        if self.on_applied is not None:
            self.on_applied(closed)
        if self.opts.total_rounds and closed.round + 1 >= self.opts.total_rounds:
            self.finished.set()

    def _apply(self, round: int, applied: Payload | None, snapshot: bool) -> tuple[str, dict[str, Any] | None]:
        """`CanonicalState.advance` (unless the round was aborted), then (`snapshot`: the writer takes it)
        the snapshot of its result, in one worker thread."""
        digest = self.state.advance(round, applied) if applied is not None else self.state.digest
        return digest, self.state.snapshot() if snapshot else None

    async def persist_last(self) -> None:
        """Hand the writer the state of the last closed round where its apply did not (at the end of the run)."""
        if self._hand_off is not None:
            await self._hand_off.last(self.state.snapshot)
