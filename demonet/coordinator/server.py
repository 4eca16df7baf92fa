"""The coordinator's gRPC adapter: a grpc.aio servicer over the round core (`demonet.coordinator.core`).

The servicer owns the core, the admission checks (`admission.py`) and the Submit reader (`submit.py`), and
answers each call in the protocol's terms; the rounds, the close, the digests and the refusals are the core's.
Servicer methods keep the .proto names.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet._proto import demonet_pb2_grpc as pb_grpc
from demonet.config import Config
from demonet.errors import AggregateGone, NotJoined, PeerUnavailable, SubmitRejected
from demonet.wire import task_files
from demonet.wire.identity import (
    aggregate_statement,
    heartbeat_statement,
    leave_statement,
    parameters_statement,
    task_files_statement,
)
from demonet.wire.params import PROTOCOL, protocol_mismatch

from . import weights
from .admission import Admission, caller_address
from .core import RoundCore
from .limits import DEFAULT_INFLIGHT_FLOOR_BYTES, Limits, LimitsConfig, submission_bound
from .metrics import Metrics
from .submit import SubmitReader
from .terms import KEEP_AGGREGATES, CoreOptions

__all__ = ["ROUND_WINDOW", "CoordinatorOptions", "CoordinatorServicer"]

ROUND_WINDOW = 8
"""A Heartbeat or Leave signed for a round this many rounds or more before the open one is stale: answered, never
acted on (a peer that far behind catches up first)."""

logger = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]


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


def _shipped(cfg: Config) -> tuple[list[pb.TaskFile], bytes]:
    """The run's task files (the Hugging Face task's config and tokenizer files), read once at start: the list a
    JoinReply carries, and the serialized TaskFiles message GetTaskFiles streams (b"" when there are none).

    Raises:
        ValueError: a file, or all of them, over the caps (`demonet.wire.task_files`), or one that cannot be read.
    """
    from demonet.tasks.hf import shipped_paths

    files = task_files.read_task_files(shipped_paths(cfg.to_dict()))
    if not files:
        return [], b""
    return task_files.listing_to_pb(task_files.list_files(files)), task_files.encode_task_files(files)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Clock-synchronous rounds over gRPC; see proto/demonet.proto for the protocol.

    Args:
        cfg: the run.
        opts: token, state folder, rounds, limits, initial parameters.
        metrics: the Prometheus metrics and the dashboard's record.
    """

    def __init__(self, cfg: Config, opts: CoordinatorOptions, metrics: Metrics) -> None:
        self.cfg, self.opts, self.metrics = cfg, opts, metrics
        self.core = RoundCore(cfg, CoreOptions(total_rounds=opts.total_rounds, state_dir=opts.state_dir,
                                               state_every_s=opts.state_every_s), metrics,
                              on_open=self._end_outlived, state_extra=lambda: {
                                  "identities": self.admission.identities.state_dict()})
        bound = submission_bound(self.core.state.specs, cfg.optim.compression_topk, cap=opts.max_payload_bytes)
        self.limits = Limits(LimitsConfig(
            max_submission_bytes=bound, download_every_s=cfg.net.round_timeout_s,
            max_inflight_bytes=opts.max_inflight_bytes or max(8 * bound, DEFAULT_INFLIGHT_FLOOR_BYTES),
            newcomer_s=cfg.net.newcomer_s, max_newcomers=cfg.net.max_newcomers))
        self.admission = Admission(token=opts.token, admission=cfg.net.admission, allowlist=cfg.net.allowlist,
                                   limits=self.limits, metrics=metrics, round_of=lambda: self.core.rounds.round)
        if self.core.saved is not None:
            self.admission.identities.load_state(self.core.saved.get("identities", {}), _now())
        self.submissions = SubmitReader(self.core, self.admission, self.limits)
        self._param_specs = json.dumps([list(spec) for spec in self.core.param_specs])
        self._task_listing, self._task_files = _shipped(cfg)
        self._init_params(self.core.saved is not None)

    def _init_params(self, resumed: bool) -> None:
        """`--init FILE`, unless the state was resumed. Raises `WeightsFileError` on a file that does not fit."""
        path = self.opts.init_file
        if path is None:
            return
        if resumed:
            logger.warning("[coordinator] --init %s ignored: resuming from the state saved in %s", path,
                           self.opts.state_dir)
            return
        state = self.core.state
        state.set_params(weights.read_init(path, state.params))
        logger.info("[coordinator] initial parameters from %s; digest %s", path, state.digest[:12])

    def _end_outlived(self, open_round: int) -> None:
        """A round closed: the Submit streams of the rounds before the open one end now."""
        for ends in self.limits.slots.outlived(open_round):
            ends.end_now()

    async def reload_allowlist(self) -> None:
        """Read the allowlist file again (SIGHUP); a peer whose key left it is dropped from the membership now
        (the round it is in closes without it unless its payload is in) and refused from then on."""
        removed = self.admission.reload_allowlist()
        if removed:
            await self.core.withdraw(removed, drop=True)

    @staticmethod
    async def _waited(e: PeerUnavailable, context: Context) -> None:
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))

    # -- RPCs ----------------------------------------------------------------------------------------

    async def Challenge(self, request: pb.ChallengeRequest, context: Context) -> pb.ChallengeReply:
        await self.admission.admit(request, context)
        peer_id = await self.admission.peer_id(request.peer_id, context)
        await self._let_go_newcomers()  # before the binding is checked: an id let go is free for this key
        return pb.ChallengeReply(nonce=await self.admission.challenge(peer_id, request.public_key, context))

    async def Join(self, request: pb.JoinRequest, context: Context) -> pb.JoinReply:
        await self.admission.admit(request, context)
        peer_id = await self.admission.peer_id(request.peer_id, context)
        if request.protocol != PROTOCOL:  # before any state changes: another version misreads the digests
            await self.admission.refuse_protocol(peer_id, protocol_mismatch(
                request.protocol, sender=f"peer {peer_id!r}", receiver="the coordinator"), context)
        session = b""
        if request.probe:  # a probe admits nobody: no key needed to read the run's config, limited per address
            await self.admission.limit(self.limits.probes, f"probe/{caller_address(context)}", "Join", context)
        else:
            await self._let_go_newcomers()
            await self.admission.room_for(peer_id, context)
            session = await self.admission.join(peer_id, request, context)
        info = await self.core.join(peer_id, probe=request.probe)
        return pb.JoinReply(peer_id=peer_id, round=info.round, run_config=json.dumps(info.run_config),
                            data_seed=info.data_seed, round_timeout_s=info.round_timeout_s,
                            heartbeat_interval_s=info.heartbeat_interval_s, total_rounds=info.total_rounds,
                            param_specs=self._param_specs, session=session, protocol=PROTOCOL,
                            task_files=self._task_listing)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Context) -> pb.HeartbeatReply:
        await self.admission.admit(request, context)
        session = self.admission.session(request.peer_id)
        if session is None:  # no key joined under this id (or it left the allowlist): join
            return pb.HeartbeatReply(round=self.core.rounds.round, member=False)
        await self.admission.signed(request.peer_id, request.signature, heartbeat_statement(
            session, request.peer_id, request.round, request.counter), context, counter=request.counter)
        if request.round + ROUND_WINDOW <= self.core.rounds.round:  # stale: it keeps nobody alive
            r = self.core.rounds
            return pb.HeartbeatReply(round=r.round, member=request.peer_id in r.members or request.peer_id in r.joiners)
        round_, member = await self.core.heartbeat(request.peer_id)
        return pb.HeartbeatReply(round=round_, member=member)

    async def Leave(self, request: pb.LeaveRequest, context: Context) -> pb.LeaveReply:
        """A member's graceful stop: the open round and the next ones stop waiting for it at once."""
        await self.admission.admit(request, context)
        session = self.admission.session(request.peer_id)
        if session is None:  # no key joined under this id: it is no member
            return pb.LeaveReply(left=False)
        await self.admission.signed(request.peer_id, request.signature, leave_statement(
            session, request.peer_id, request.round, request.counter), context, counter=request.counter)
        if request.round + ROUND_WINDOW <= self.core.rounds.round:
            self.metrics.refused(request.peer_id, int(request.round), "stale", "a Leave signed for a round long closed")
            return pb.LeaveReply(left=False)
        return pb.LeaveReply(left=await self.core.leave(request.peer_id, request.round))

    async def GetParameters(self, request: pb.ParametersRequest, context: Context) -> AsyncIterator[pb.PayloadPart]:
        peer_id = await self._downloader(request, "GetParameters", lambda session, peer_id: parameters_statement(
            session, peer_id, request.round, request.resync, request.counter), context)
        if request.resync:
            self.core.inbox.resynced(peer_id, request.round,
                               f"its digest after applying round {request.round - 1} differed from the canonical one")
        try:
            _, blob = await self.core.parameters(request.round)
        except PeerUnavailable as e:
            await self._waited(e, context)
        self.metrics.add("bytes_down", len(blob), peer=peer_id)
        for part in wire.split(blob):
            yield part

    async def GetTaskFiles(self, request: pb.TaskFilesRequest, context: Context) -> AsyncIterator[pb.PayloadPart]:
        """The run's task files, under GetParameters' admission and its rate (the bytes counted as the peer's)."""
        peer_id = await self._downloader(request, "GetTaskFiles", lambda session, peer_id: task_files_statement(
            session, peer_id, request.counter), context)
        if not self._task_listing:
            await context.abort(grpc.StatusCode.NOT_FOUND, "this run ships no task files (its task is built from "
                                "the run config alone, or from a module each peer has installed)")
        self.metrics.add("bytes_down", len(self._task_files), peer=peer_id)
        for part in wire.split(self._task_files):
            yield part

    async def _downloader(self, request: Any, what: str, statement: Callable[[bytes, str], bytes],
                          context: Context) -> str:
        """The member or joiner a signed download (GetParameters, GetTaskFiles) is from, within the downloads' rate
        of its id; the call is aborted otherwise (FAILED_PRECONDITION sends a dropped peer to join again)."""
        await self.admission.admit(request, context)
        peer_id = await self.admission.peer_id(request.peer_id, context)
        try:
            await self.admission.signed(peer_id, request.signature, statement(
                self.admission.session(peer_id) or b"", peer_id), context, counter=request.counter)
        except NotJoined as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{e}: join the run first")
        try:
            self.core.may_download(peer_id)
        except SubmitRejected as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, e.reason)
        await self.admission.limit(self.limits.downloads, peer_id, what, context)
        return peer_id

    async def Submit(self, request_iterator: AsyncIterator[pb.SubmitPart], context: Context) -> pb.SubmitReply:
        return await self.submissions.submit(request_iterator, context)

    async def GetAggregate(self, request: pb.AggregateRequest, context: Context) -> AsyncIterator[pb.AggregateChunk]:
        """A member's signed call (limited per key and round, its bytes counted as its), or the public path."""
        await self.admission.admit(request, context)
        peer_id = await self._aggregate_caller(request, context)
        try:
            closed = await self.core.aggregate(peer_id, request.round, submitting=request.submitting and bool(peer_id))
        except AggregateGone as e:
            code = grpc.StatusCode.FAILED_PRECONDITION if e.resubmit else grpc.StatusCode.NOT_FOUND
            await context.abort(code, e.reason)
        except PeerUnavailable as e:
            await self._waited(e, context)
        yield pb.AggregateChunk(header=pb.AggregateHeader(round=closed.round, aborted=closed.aborted,
                                                          contributors=list(closed.contributors),
                                                          next_round_s=closed.next_round_s))
        if peer_id:
            self.metrics.add("bytes_down", len(closed.data), peer=peer_id)
        else:
            self.metrics.add("bytes_public", len(closed.data))
        if closed.data:
            for part in wire.split(closed.data):
                yield pb.AggregateChunk(part=part)
        digest = closed.param_digest
        if not digest:  # published before it was applied: the digest follows once it is
            try:
                digest = await self.core.canonical_digest(request.round)
            except AggregateGone as e:  # cannot be: a digest is set before the next close
                await context.abort(grpc.StatusCode.NOT_FOUND, e.reason)
            except PeerUnavailable as e:
                await self._waited(e, context)
        yield pb.AggregateChunk(trailer=pb.AggregateTrailer(param_digest=digest))

    async def _aggregate_caller(self, request: pb.AggregateRequest, context: Context) -> str:
        """The member a signed GetAggregate is from, within its calls for the round; "" for the public path,
        within the path's shared rate (RESOURCE_EXHAUSTED past either)."""
        if not request.signature:
            await self.admission.limit(self.limits.public, "public", "GetAggregate (unsigned)", context)
            return ""
        peer_id = await self.admission.peer_id(request.peer_id, context)
        try:
            await self.admission.signed(peer_id, request.signature, aggregate_statement(
                self.admission.session(peer_id) or b"", peer_id, request.round, request.submitting, request.counter),
                context, counter=request.counter)
        except NotJoined as e:  # NOT_FOUND: the peer asks whether it is a member, and joins again
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{e}: join the run first")
        oldest = self.core.rounds.round - KEEP_AGGREGATES
        if not self.limits.aggregates.take(peer_id, int(request.round), oldest):
            self.metrics.refused(peer_id, int(request.round), "rate", "GetAggregate over its calls for the round")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"GetAggregate: {peer_id} made "
                                f"{self.limits.cfg.aggregate_calls_per_round} calls for round {request.round}, "
                                "the most for one round")
        return peer_id

    async def _let_go_newcomers(self) -> None:
        """Before a challenge or a join: drop the members that never had a payload accepted in `newcomer_s`, and
        free their ids."""
        due = self.admission.newcomers_due()
        if due:
            await self.core.withdraw(due, drop=True)

    async def Status(self, request: pb.StatusRequest, context: Context) -> pb.StatusReply:
        await self.admission.admit(request, context)
        try:
            await self.core.settled()  # the digest at the open round's start: after its apply
        except PeerUnavailable as e:
            await self._waited(e, context)
        r, t = self.core.rounds, self.metrics.totals
        detail = json.dumps(self.status_document(), allow_nan=False) if request.detail else ""
        return pb.StatusReply(round=r.round, phase="closing" if self.metrics.phase.value else "open",
                              members=sorted(r.members), submitted=len(r.submitted),
                              seconds_left=r.seconds_left(_now()), param_digest=self.core.state.digest,
                              bytes_up=t["bytes_up"], bytes_down=t["bytes_down"], last_loss=self.metrics.last_loss,
                              rounds_closed=t["rounds_closed"], rounds_aborted=t["rounds_aborted"],
                              rejected=t["rejected"], resyncs=t["resyncs"], detail_json=detail)

    def status_document(self, since: int | None = None) -> dict[str, Any]:
        """The dashboard's document (docs/dashboard.md): `/status.json` and `Status` with `detail`."""
        return self.core.status_document(since, keys=self.admission.fingerprints())
