"""The coordinator: a grpc.aio servicer around the round state machine and the canonical state.

Imports grpc and the layers below; the round logic is in demonet.coordinator.rounds, the tensors in state.py.
One asyncio loop; torch work runs in `asyncio.to_thread`. Servicer methods keep the .proto names.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet._proto import demonet_pb2_grpc as pb_grpc
from demonet.config import Config
from demonet.optim import Payload
from demonet.train.data import data_seed
from demonet.train.task import param_specs
from demonet.wire.identity import heartbeat_statement, leave_statement, parameters_statement

from . import weights
from .handlers import Malformed
from .identities import Identities, NotJoined, Refused, read_allowlist
from .limits import DEFAULT_INFLIGHT_FLOOR_BYTES, Limits, LimitsConfig, RateLimits, submission_bound
from .metrics import Metrics
from .persist import Persister, Snapshot
from .rounds import RoundConfig, Rounds
from .state import CanonicalState, ClosedAggregate
from .status import status_document
from .submit import Submissions

__all__ = ["CoordinatorOptions", "CoordinatorServicer"]

logger = logging.getLogger(__name__)

_PEER_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_KEEP_AGGREGATES = 8  # closed rounds whose aggregate a slow peer can still download


@dataclass(frozen=True, kw_only=True)
class CoordinatorOptions:
    """How the coordinator runs (the run itself is a `Config`)."""

    token: str
    """Shared run token: every RPC must carry "authorization: Bearer <token>"."""
    state_dir: Path | None = None
    """Where the state is persisted after every round (in the background, once the round is published);
    None keeps it in memory only."""
    state_every_s: float = 0.0
    """The least time between the starts of two state writes (0: after every round the writer is free
    for). A crash loses the rounds since the last write: up to this long, plus one write."""
    total_rounds: int = 0
    """The run ends after this many rounds (0: no end)."""
    max_payload_bytes: int = 1 << 30
    """Largest serialized payload a peer may submit; the run's own bound (`limits.submission_bound`, a few
    times a real payload) is used where smaller."""
    max_inflight_bytes: int = 0
    """The declared sizes of all open Submit streams together, at most; a stream over it is refused BUSY.
    0: max(8 submissions at the run's bound, 256 MiB)."""
    init_file: Path | None = None
    """A safetensors file of the initial parameters by name, instead of the seeded init; a state saved in
    `state_dir` wins over it (a resume)."""


def _now() -> float:
    return time.monotonic()


class CoordinatorServicer(Submissions, pb_grpc.CoordinatorServicer):
    """Clock-synchronous rounds over gRPC; see proto/demonet.proto for the protocol."""

    def __init__(self, cfg: Config, opts: CoordinatorOptions, metrics: Metrics) -> None:
        self.cfg, self.opts, self.metrics = cfg, opts, metrics
        self.state = CanonicalState(cfg)
        round_cfg = RoundConfig(round_timeout_s=cfg.net.round_timeout_s, min_peers=cfg.net.min_peers,
                                heartbeat_timeout_s=cfg.net.heartbeat_timeout_s, start_peers=cfg.net.start_peers,
                                max_idle_rounds=cfg.net.max_idle_rounds)
        self.rounds = Rounds(cfg=round_cfg, now=_now())
        self.aggregates: OrderedDict[int, ClosedAggregate] = OrderedDict()
        self.payloads: dict[str, Payload] = {}
        self.losses: dict[str, float] = {}
        self.resynced_at: dict[str, int] = {}
        """Peer -> the round of its last resync, so that a retried call is not counted twice."""
        self.cond = asyncio.Condition()
        self.finished = asyncio.Event()
        self.applying: int | None = None
        """The round whose aggregate is published and being applied to the canonical parameters (guarded by
        `cond`): until it is applied, `state.digest` and `state.params` are still those it started from."""
        self.advancing: asyncio.Task[None] | None = None
        """That apply, the state write it hands over, and the run's end after the last round."""
        self._param_specs = json.dumps(param_specs(self.state.params))
        net = cfg.net
        self.identities = Identities(net.admission, read_allowlist(Path(net.allowlist)) if net.allowlist else None)
        self.accepted_digests: dict[str, bytes] = {}
        """Peer -> the digest of its payload in the open round (a retry of it is a duplicate, another one is not)."""
        bound = submission_bound(self.state.specs, cfg.optim.compression_topk, cap=opts.max_payload_bytes)
        self.limits = Limits(LimitsConfig(
            max_submission_bytes=bound, download_every_s=cfg.net.round_timeout_s,
            max_inflight_bytes=opts.max_inflight_bytes or max(8 * bound, DEFAULT_INFLIGHT_FLOOR_BYTES)))
        saved = self.state.load(opts.state_dir) if opts.state_dir is not None else None
        if saved is not None:
            self.rounds = Rounds.from_state(round_cfg, saved["rounds"], now=_now())
            self.identities.load_state(saved.get("identities", {}))
            for item in saved.get("aggregates", []):
                self.aggregates[item.round] = item
            self.metrics.restore(saved.get("counters", {}))
        self.persister = None if opts.state_dir is None else Persister(
            opts.state_dir, metrics, on_disk=self.rounds.round if saved is not None else None,
            every_s=opts.state_every_s)
        self._unsaved: tuple[ClosedAggregate, dict[str, Any]] | None = None
        """The last closed round and the state file's extras as of its close, where its state was not
        snapshotted (the writer was busy, or wrote less than `state_every_s` ago): `persist_last` saves it."""
        self._init_params(saved is not None)
        self.metrics.set_round(self.rounds.round, len(self.rounds.members), 0)

    # -- helpers -------------------------------------------------------------------------------------

    def _init_params(self, resumed: bool) -> None:
        """`--init FILE`, unless the state was resumed. Raises `WeightsFileError` on a file that does not fit."""
        path = self.opts.init_file
        if path is None:
            return
        if resumed:
            logger.warning("[coordinator] --init %s ignored: resuming from the state saved in %s", path,
                           self.opts.state_dir)
            return
        self.state.set_params(weights.read_init(path, self.state.params))
        logger.info("[coordinator] initial parameters from %s; digest %s", path, self.state.digest[:12])

    async def _admit(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Refuse a call without the run token, then one whose request did not parse."""
        await self._authorize(context)
        if isinstance(request, Malformed):
            self.metrics.add("rejected")
            self.metrics.refused("", None, "malformed", str(request))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))

    async def _authorize(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if not self.identities.needs_token:
            return
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(str(given).encode(), f"Bearer {self.opts.token}".encode()):
            self.metrics.add("unauthorized")
            self.metrics.refused("", None, "unauthorized", "missing or wrong run token")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong run token")

    async def _peer_id(self, peer_id: str, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        if not _PEER_ID.match(peer_id):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "peer_id should be 1-128 characters of letters, digits, '.', '_', '-'")
        return peer_id

    async def _wait(self, predicate: Any, timeout_s: float, context: grpc.aio.ServicerContext[Any, Any],
                    what: str) -> None:
        """Wait (holding `cond` on return) until predicate() is true; DEADLINE_EXCEEDED after timeout_s."""
        try:
            # asyncio.timeout, not wait_for: wait_for wraps the wait in a task, and a cancellation
            # (shutdown) there can leave the condition's lock released under the caller (3.11).
            async with asyncio.timeout(timeout_s):
                await self.cond.wait_for(predicate)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"timed out waiting for {what}")

    async def _signed(self, peer_id: str, signature: bytes, message: bytes,
                      context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Refuse (PERMISSION_DENIED) a request that `peer_id`'s key did not sign.

        Raises:
            NotJoined: no key joined as `peer_id` (the caller answers so that the peer joins).
        """
        try:
            self.identities.check(peer_id, signature, message)
        except NotJoined:
            raise
        except Refused as e:
            self.metrics.add("unauthorized")
            self.metrics.refused(peer_id, None, "signature", str(e))
            logger.warning("[coordinator round=%d] refused a request as %s: %s", self.rounds.round, peer_id, e)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))

    async def reload_allowlist(self) -> None:
        """Read the allowlist file again (SIGHUP); a peer whose key left it is dropped from the membership now
        (the round it is in closes without it unless its payload is in) and refused from then on."""
        if self.cfg.net.admission != "allowlist":
            logger.info("[coordinator] SIGHUP: admission is %r, no allowlist to reload", self.cfg.net.admission)
            return
        try:
            allowed = read_allowlist(Path(self.cfg.net.allowlist))
        except (OSError, ValueError) as e:
            logger.error("[coordinator] SIGHUP: the allowlist was not reloaded, the old one stays: %s", e)
            return
        async with self.cond:
            removed = self.identities.reload(allowed)
            for peer_id in removed:
                self.rounds.withdraw(peer_id, _now(), drop=True)
            self.cond.notify_all()
        logger.info("[coordinator] allowlist reloaded: %d keys%s", len(allowed),
                    f"; dropped {', '.join(removed)}" if removed else "")

    async def _limit(self, rates: RateLimits, peer_id: str, what: str,
                     context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """RESOURCE_EXHAUSTED, saying when to try again (also as "retry-after-s"), past `peer_id`'s rate."""
        wait_s = rates.take(peer_id, _now())
        if wait_s > 0:
            self.metrics.refused(peer_id, None, "rate", f"{what} over its rate")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{what}: {peer_id} is over its rate ({rates.burst} at once, then one per "
                                f"{rates.every_s:g} s); try again in {wait_s:.1f} s",
                                trailing_metadata=(("retry-after-s", f"{wait_s:.3f}"),))

    async def _may_download(self, peer_id: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Parameters go to members and admitted joiners only (a dropped peer joins again first: FAILED_PRECONDITION
        sends the client to catch up), at most at `limits.downloads`' rate."""
        if peer_id not in self.rounds.members and peer_id not in self.rounds.joiners:
            self.metrics.refused(peer_id, None, "not_member", "GetParameters from a peer that has not joined")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{peer_id!r} is not a member of the run: Join first")
        await self._limit(self.limits.downloads, peer_id, "GetParameters", context)

    @property
    def _wait_s(self) -> float:
        """How long a GetParameters or GetAggregate call may wait: two round timeouts and a margin."""
        return 2 * self.cfg.net.round_timeout_s + 30.0

    # -- RPCs ----------------------------------------------------------------------------------------

    async def Challenge(self, request: pb.ChallengeRequest,
                        context: grpc.aio.ServicerContext[Any, Any]) -> pb.ChallengeReply:
        await self._admit(request, context)
        peer_id = await self._peer_id(request.peer_id, context)
        try:
            nonce = self.identities.challenge(peer_id, request.public_key, _now())
        except Refused as e:
            self.metrics.refused(peer_id, None, "join", str(e))
            logger.warning("[coordinator round=%d] refused a challenge for %s: %s", self.rounds.round, peer_id, e)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        return pb.ChallengeReply(nonce=nonce)

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.JoinReply:
        await self._admit(request, context)
        peer_id = await self._peer_id(request.peer_id, context)
        session = b""
        if request.probe:  # a probe admits nobody: no key needed to read the run's config
            await self._limit(self.limits.joins, f"probe/{peer_id}", "Join", context)
        else:
            try:
                session = self.identities.join(peer_id, request.public_key, request.nonce, request.signature,
                                               _now()).session
            except Refused as e:
                self.metrics.refused(peer_id, None, "join", str(e))
                logger.warning("[coordinator round=%d] refused a join as %s: %s", self.rounds.round, peer_id, e)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
            # Per key: only the holder of the key `peer_id` is bound to spends its joins.
            await self._limit(self.limits.joins, peer_id, "Join", context)
        async with self.cond:
            if request.probe:  # a peer about to build its model: it joins once the model fits the run
                first = self.rounds.round
            else:
                first = self.rounds.join(peer_id, _now())
                self.metrics.set_round(self.rounds.round, len(self.rounds.members), len(self.rounds.submitted))
                self.cond.notify_all()
        if not request.probe:
            logger.info("[coordinator round=%d] %s joins at round %d", self.rounds.round, peer_id, first)
        return pb.JoinReply(peer_id=peer_id, round=first, run_config=json.dumps(self.cfg.to_dict()),
                            data_seed=data_seed(self.cfg.train.seed, peer_id),
                            round_timeout_s=self.cfg.net.round_timeout_s,
                            heartbeat_interval_s=self.cfg.net.heartbeat_interval_s,
                            total_rounds=self.opts.total_rounds, param_specs=self._param_specs, session=session)

    async def Heartbeat(self, request: pb.HeartbeatRequest,
                        context: grpc.aio.ServicerContext[Any, Any]) -> pb.HeartbeatReply:
        await self._admit(request, context)
        session = self.identities.session(request.peer_id)
        if session is None:  # no key joined under this id (or it left the allowlist): join
            return pb.HeartbeatReply(round=self.rounds.round, member=False)
        await self._signed(request.peer_id, request.signature,
                           heartbeat_statement(session, request.peer_id, request.round), context)
        async with self.cond:
            member = self.rounds.heartbeat(request.peer_id, _now())
            return pb.HeartbeatReply(round=self.rounds.round, member=member)

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.LeaveReply:
        """A member's graceful stop: the open round and the next ones stop waiting for it at once."""
        await self._admit(request, context)
        session = self.identities.session(request.peer_id)
        if session is None:  # no key joined under this id: it is no member
            return pb.LeaveReply(left=False)
        await self._signed(request.peer_id, request.signature,
                           leave_statement(session, request.peer_id, request.round), context)
        async with self.cond:
            left = self.rounds.leave(request.peer_id)
            self.metrics.set_round(self.rounds.round, len(self.rounds.members), len(self.rounds.submitted))
            self.cond.notify_all()  # a round whose other members are all in closes now
        if left:
            logger.info("[coordinator round=%d] %s left (stopped at its round %d)", self.rounds.round,
                        request.peer_id, request.round)
        return pb.LeaveReply(left=left)

    async def GetParameters(self, request: pb.ParametersRequest,
                            context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[pb.PayloadPart]:
        await self._admit(request, context)
        peer_id = await self._peer_id(request.peer_id, context)
        try:
            await self._signed(peer_id, request.signature, parameters_statement(
                self.identities.session(peer_id) or b"", peer_id, request.round, request.resync), context)
        except NotJoined as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{e}: join the run first")
        await self._may_download(peer_id, context)
        if request.resync:
            self._resynced(await self._peer_id(request.peer_id, context), request.round,
                           f"its digest after applying round {request.round - 1} differed from the canonical one")
        async with self.cond:
            await self._wait(lambda: self.rounds.round >= request.round and self._applied(), self._wait_s, context,
                             f"round {request.round} to open")
            round_ = self.rounds.round
            blob = await asyncio.to_thread(self.state.parameters_blob, round_)
        self.metrics.add("bytes_down", len(blob), peer=request.peer_id)
        for part in wire.split(blob):
            yield part

    async def GetAggregate(self, request: pb.AggregateRequest,
                           context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[pb.AggregateChunk]:
        await self._admit(request, context)
        async with self.cond:
            r = self.rounds
            if (request.round == r.round and request.peer_id in r.members and request.peer_id not in r.submitted
                    and not request.submitting):
                # After a restart the payload this member sent is gone; it still holds it. (`submitting`: its
                # Submit is on its way beside this call; should it be refused, the peer drops this call.)
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"no payload from {request.peer_id} for round {r.round}: submit it again")
            if request.round > r.round:
                # Nobody submits to a round before it opens: this coordinator resumed from a state older
                # than rounds it had published before a crash. The peer gets back in step at the open one.
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"round {request.round} has not opened; the open round is {r.round} (the "
                                    f"coordinator resumed from its saved state): download the parameters again")
            await self._wait(lambda: request.round in self.aggregates or self.rounds.round > request.round,
                             self._wait_s, context, f"round {request.round} to close")
            closed = self.aggregates.get(request.round)
        if closed is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"round {request.round} is too old; download the parameters again")
            return
        yield pb.AggregateChunk(header=pb.AggregateHeader(round=closed.round, aborted=closed.aborted,
                                                          contributors=list(closed.contributors)))
        self.metrics.add("bytes_down", len(closed.data), peer=request.peer_id)
        if closed.data:
            for part in wire.split(closed.data):
                yield pb.AggregateChunk(part=part)
        digest = closed.param_digest
        if not digest:  # published before it was applied: the digest follows once it is
            async with self.cond:
                await self._wait(lambda: request.round not in self.aggregates
                                 or bool(self.aggregates[request.round].param_digest), self._wait_s, context,
                                 f"round {request.round} to be applied")
                if request.round not in self.aggregates:  # cannot be: a digest is set before the next close
                    await context.abort(grpc.StatusCode.NOT_FOUND, f"round {request.round} is too old")
                digest = self.aggregates[request.round].param_digest
        yield pb.AggregateChunk(trailer=pb.AggregateTrailer(param_digest=digest))

    def _applied(self) -> bool:
        """Whether the parameters are those at the start of the open round (no apply in flight)."""
        return self.applying is None

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.StatusReply:
        await self._admit(request, context)
        async with self.cond:  # the digest at the open round's start: after its apply
            await self._wait(self._applied, self._wait_s, context, f"round {self.rounds.round - 1} to be applied")
        r, t = self.rounds, self.metrics.totals
        detail = json.dumps(self.status_document(), allow_nan=False) if request.detail else ""
        return pb.StatusReply(round=r.round, phase="closing" if self.metrics.phase.value else "open",
                              members=sorted(r.members), submitted=len(r.submitted),
                              seconds_left=r.seconds_left(_now()), param_digest=self.state.digest,
                              bytes_up=t["bytes_up"], bytes_down=t["bytes_down"], last_loss=self.metrics.last_loss,
                              rounds_closed=t["rounds_closed"], rounds_aborted=t["rounds_aborted"],
                              rejected=t["rejected"], resyncs=t["resyncs"], detail_json=detail)

    def status_document(self, since: int | None = None) -> dict[str, Any]:
        """The dashboard's document (docs/dashboard.md): `/status.json` and `Status` with `detail`. Its digest is
        the newest applied round's: for the few ms while the round just published is applied, the one before's."""
        return status_document(self.rounds, self.metrics, now=_now(), param_digest=self.state.digest,
                               total_rounds=self.opts.total_rounds, since=since,
                               keys={p: b.fingerprint for p, b in self.identities.bindings.items()})

    # -- the clock -----------------------------------------------------------------------------------

    async def tick_forever(self, max_sleep_s: float = 1.0) -> None:
        """Close rounds when they are due. Runs until cancelled.

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
        released: `_advance`, the apply to the canonical parameters.

        Peers download and decode the aggregate while the coordinator applies it: its canonical digest
        reaches them at the end of the GetAggregate stream. Until the apply is done (`applying`), a Submit,
        GetParameters or Status that needs the parameters of the open round waits for it."""
        r = self.rounds
        started = _now()
        self.metrics.phase.set(1)
        outcome = r.outcome()  # Rounds alone decides: the state applies (or not) what it says
        contributors = outcome.contributors
        payloads = [self.payloads[p] for p in contributors]
        closed, applied = await asyncio.to_thread(self.state.merge_round, outcome, payloads)
        members, opened_at = tuple(r.members), r.opened_at  # for the dashboard's record, before they change
        decided = r.close(_now())
        for ends in self.limits.slots.outlived(r.round):
            ends.end_now()
        assert decided == outcome, "the round changed while it was merged; submissions should wait on `cond`"
        self.aggregates[closed.round] = closed
        while len(self.aggregates) > _KEEP_AGGREGATES:
            self.aggregates.popitem(last=False)
        losses = [self.losses[p] for p in contributors if p in self.losses]
        self.payloads, self.losses, self.accepted_digests = {}, {}, {}
        if applied is not None:
            self.applying = closed.round
        close_s = _now() - started  # the critical path: from here on, nothing waits for the apply but its digest
        self.metrics.closed(closed.aborted, close_s, sum(losses) / len(losses) if losses else None,
                            round=closed.round, members=members, contributors=contributors, round_s=_now() - opened_at)
        if closed.clipped:
            self.metrics.add("clipped", len(closed.clipped))
        self.metrics.set_round(r.round, len(r.members), 0)
        self.metrics.phase.set(0)
        self.cond.notify_all()
        # The state file's rounds, counters and keys as of this close, whatever arrives during the apply.
        extra = {"rounds": r.state_dict(), "counters": self.metrics.counters(),
                 "identities": self.identities.state_dict()}
        return self._advance(closed, applied, extra, close_s)

    async def _advance(self, closed: ClosedAggregate, applied: Payload | None, extra: dict[str, Any],
                       close_s: float) -> None:
        """Apply a published round (`CanonicalState.advance`), set its digest and wake who waits for it,
        then hand the snapshot of the result to the background writer (`Persister`). Writing the state is
        off the round's critical path; a crash before the write completes loses the rounds published since
        the last one, and the peers that had gone ahead get back in step (a Submit or GetAggregate for a
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
        if self.persister is not None:
            self._unsaved = None if body is not None else (closed, extra)
            if body is not None:
                self._hand_over(closed, extra, body)
        if self.opts.total_rounds and closed.round + 1 >= self.opts.total_rounds:
            self.finished.set()

    def _apply(self, round: int, applied: Payload | None, snapshot: bool) -> tuple[str, dict[str, Any] | None]:
        """`CanonicalState.advance` (unless the round was aborted), then (`snapshot`: the writer takes it)
        the snapshot of its result, in one worker thread."""
        digest = self.state.advance(round, applied) if applied is not None else self.state.digest
        return digest, self.state.snapshot() if snapshot else None

    async def persist_last(self) -> None:
        """Hand the writer the state of the last closed round where its close did not (at the end of the
        run, with no apply in flight: the parameters are still those of that close)."""
        if self.persister is None or self._unsaved is None:
            return
        closed, extra = self._unsaved
        self._unsaved = None
        self._hand_over(closed, extra, await asyncio.to_thread(self.state.snapshot))

    def _hand_over(self, closed: ClosedAggregate, extra: dict[str, Any], body: dict[str, Any]) -> None:
        """Give the writer the state as of `closed`: the parameters' snapshot `body`, the close's `extra`."""
        assert self.persister is not None
        self.persister.submit(Snapshot(closed.round + 1, {**body, **extra, "aggregates": [closed]}))
