"""The gRPC client of the coordinator: the `Gatherer` and the streams of the rounds (parameters, task files, the
payload's Submit, the aggregates), on the connection of `demonet.transport.grpc_connection` (join, heartbeats,
leave, status).

Net layer: imports grpc, the wire layer and the generated stubs; never the model, the training loop
or torch.distributed. Every RPC carries the run token; every wait on the network has a deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any

import grpc
import grpc.aio
import torch

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload
from demonet.optim import Payload
from demonet.wire import params as wire_params
from demonet.wire import task_files as wire_task_files
from demonet.wire.identity import Identity
from demonet.wire.signed import aggregate_request, digest_part, parameters_request, submit_parts, task_files_request

from . import Digest, JoinInfo, NotMember, Pace, Rejected, RoundResult, StaleRound, refusal_error
from .grpc_connection import CoordinatorConnection
from .grpc_replies import CoordinatorStatus, StreamedAggregate, drop_early, read_aggregate

__all__ = ["CoordinatorStatus", "GrpcClient", "JoinInfo"]

logger = logging.getLogger(__name__)

# A round the coordinator no longer (or not yet) holds: the peer lost track and catches up.
_RESUBMITS = 2  # times a payload is sent again when a restarted coordinator asks for it
_LOST_CODES = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE)
_BUSY_FIRST_S = 0.1
"""The first wait before a Submit refused BUSY is sent again; each next one doubles, up to 1 s."""


class GrpcClient(CoordinatorConnection):
    """One peer's (or an operator's) connection to the coordinator; a `Gatherer` that sends a payload
    before its parameter digest is known (`digest_follows`).

    Timeouts, each a deadline on the gRPC call it names (``call_timeout_s`` and the retries: the
    connection's, `CoordinatorConnection`):

    - ``wait_timeout_s`` (2 * round_timeout_s + 30 s, once joined): one GetParameters or
      GetAggregate stream, which waits for a round to open or to close, then streams.
    - ``submit_timeout_s`` (round_timeout_s + call_timeout_s): uploading one Submit stream; a round
      timeout more for a stream whose digest follows (`gather` with a digest still to come).

    Args: those of `CoordinatorConnection`.
    """

    def __init__(self, address: str, *, token: str, peer_id: str = "", root_cert: bytes | None = None,
                 reconnect_timeout_s: float = 120.0, call_timeout_s: float = 10.0,
                 identity: Identity | None = None) -> None:
        super().__init__(address, token=token, peer_id=peer_id, root_cert=root_cert,
                         reconnect_timeout_s=reconnect_timeout_s, call_timeout_s=call_timeout_s, identity=identity)
        self._submitted: dict[int, asyncio.Event] = {}
        """Round -> set once this client's Submit for it has ended: a payload sent ahead waits for the one
        before it, so that the two never share the link."""

    digest_follows = True
    """`gather` takes a digest still to come: the payload streams at once, the digest after it."""

    @property
    def wait_timeout_s(self) -> float:
        """Deadline of one GetParameters or GetAggregate stream: waiting for a round to open or close
        (at most round_timeout_s after it opened, once more if the coordinator restarted), then streaming."""
        return 2 * self.round_timeout_s + 30.0

    @property
    def submit_timeout_s(self) -> float:
        """Deadline of one Submit stream: uploading the payload and the reply; later than the round's
        deadline it would be refused anyway."""
        return self.round_timeout_s + self.call_timeout_s

    # -- streams ---------------------------------------------------------------------------------------

    async def get_parameters(self, round: int, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *,
                             resync: bool = False) -> tuple[int, dict[str, torch.Tensor], int]:
        """Download the canonical parameters at the start of `round` (waits until it has opened).

        Args:
            round: the round to start.
            expected: name -> (shape, dtype) of the model's parameters, in order.
            resync: this peer's digest after applying round - 1 differed from the canonical one (the
                coordinator counts and logs the download as a resync).

        Returns:
            (the round they belong to, which may be later than asked, tensors by name, bytes received).

        Raises:
            StaleRound, NotMember: the coordinator no longer serves that round.
            InvalidPayload: the parameters do not fit the model or fail their digest.
        """
        async def attempt() -> bytes:
            parts = wire.Reassembler(max_bytes=wire_params.MAX_PARAMETER_BYTES)
            data = None
            request = parameters_request(self.identity, self._session, self.peer_id, round, self._next(), resync=resync)
            call = self._stub.GetParameters(request, metadata=self._metadata, timeout=self.wait_timeout_s)
            async for part in call:
                data = parts.add(part)
            if data is None:
                raise InvalidPayload(f"GetParameters({round}): the stream ended before the parameters were whole")
            return data

        try:
            data = await self._call(f"GetParameters({round})", attempt)
        except grpc.aio.AioRpcError as e:
            if e.code() not in _LOST_CODES:
                raise
            raise await self._lost(round, e.details() or e.code().name) from None
        got, tensors = await asyncio.to_thread(wire_params.decode_parameters, data, expected=expected)
        if got < round:
            raise InvalidPayload(f"GetParameters({round}): got the parameters of round {got}")
        return got, tensors, len(data)

    async def get_task_files(self, listing: tuple[tuple[str, int, str], ...]) -> dict[str, bytes]:
        """Download the run's task files (a joined peer's call), each checked against `listing`, the JoinReply's.

        Raises:
            InvalidPayload: a file missing, one not listed, or bytes that are not the listed file's.
            grpc.aio.AioRpcError: refused (FAILED_PRECONDITION: not joined; NOT_FOUND: the run ships none).
        """
        listed = tuple(wire_task_files.TaskFile(*f) for f in listing)

        async def attempt() -> bytes:
            parts = wire.Reassembler(max_bytes=wire_task_files.MAX_TOTAL_BYTES + (1 << 20))  # room for framing
            data = None
            request = task_files_request(self.identity, self._session, self.peer_id, self._next())
            async for part in self._stub.GetTaskFiles(request, metadata=self._metadata, timeout=self.wait_timeout_s):
                data = parts.add(part)
            if data is None:
                raise InvalidPayload("GetTaskFiles: the stream ended before the files were whole")
            return data

        data = await self._call("GetTaskFiles", attempt)
        return await asyncio.to_thread(wire_task_files.decode_task_files, data, listed)

    async def gather(self, round: int, payload: Payload, *, loss: float, param_digest: Digest,
                     samples: int = 1, pace: Pace | None = None) -> RoundResult:
        """Submit this peer's payload for `round`, then wait for the round's aggregate.

        See `demonet.transport.Gatherer.gather`. The aggregate is validated against the payload's
        own tensors (names, shapes, chunks), which are the model's. With its digest, the GetAggregate call
        goes out beside the Submit (`submitting`): the aggregate leaves the coordinator at the close, not a
        round trip after the Submit's reply. With a digest still to come, the payload streams as soon as
        this client's Submit of the round before has ended (the open round's, which may still be merged),
        the digest follows in the stream's last message once it is known, and the GetAggregate call after
        the Submit's reply (the round it asks for may not have opened before).
        """
        t0 = time.perf_counter()
        small = payload.numel() <= wire.INLINE_ENCODE_ENTRIES
        data = wire.encode(payload, step=round) if small else await asyncio.to_thread(wire.encode, payload, step=round)
        t1 = time.perf_counter()
        for old in [r for r in self._submitted if r < round - 1]:
            del self._submitted[old]
        ended = self._submitted[round] = asyncio.Event()
        expected = {name: (c.shape, c.chunk) for name, c in payload.tensors.items()}
        beside = not param_digest.follows

        def aggregate() -> Awaitable[StreamedAggregate]:  # a retry once the Submit has ended is a plain call again
            return read_aggregate(self._stub.GetAggregate(aggregate_request(
                self.identity, self._session, self.peer_id, round, self._next(),
                submitting=beside and not ended.is_set()), metadata=self._metadata, timeout=self.wait_timeout_s),
                round, expected)

        early = asyncio.create_task(self._call(f"GetAggregate({round})", aggregate)) if beside else None
        try:
            if not beside and round - 1 in self._submitted:
                await self._submitted[round - 1].wait()
            param_digest, counted = await self._submit(round, data, loss=loss, param_digest=param_digest,
                                                       samples=samples, pace=pace)
        except BaseException:
            if early is not None:
                drop_early(early)
            raise
        finally:
            ended.set()
        t2 = time.perf_counter()
        if counted > round:  # a late payload: it counts in the open round, after the rounds between
            if early is not None:
                drop_early(early)
            return await self._late(round, counted, payload, len(data), {"encode": t1 - t0, "submit": t2 - t1})
        for attempt in range(_RESUBMITS + 1):
            try:
                if early is not None:
                    call, early = early, None
                    got = await call
                else:
                    got = await self._call(f"GetAggregate({round})", aggregate)
                break
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION and attempt < _RESUBMITS:
                    # A restarted coordinator lost this payload: send it again rather than lose the round.
                    logger.info("[%s] GetAggregate(%d): %s; submitting again", self.peer_id, round, e.details())
                    await self._submit(round, data, loss=loss, param_digest=param_digest, samples=samples,
                                       pace=pace)
                    continue
                if e.code() not in _LOST_CODES:
                    raise
                raise await self._lost(round, e.details() or e.code().name) from None
        # Where the round's exchange went (seconds): "wait" is from the submit's reply to the aggregate's
        # header (the other peers, then the coordinator's close), "download" the rest of its parts. The
        # canonical digest comes after (the coordinator applies the round meanwhile): `RoundLoop` waits for
        # it once it has applied the aggregate itself. A payload sent ahead has its "submit" from its
        # encode to the reply, which comes once its round has opened and its digest has followed.
        phases = {"encode": t1 - t0, "submit": t2 - t1, "wait": max(got.header_at - t2, 0.0),
                  "download": got.parts_at - got.header_at, "decode": got.decoded_at - got.parts_at}
        return RoundResult(round=round, aggregate=got.aggregate, contributors=tuple(got.header.contributors),
                           param_digest="", aborted=bool(got.header.aborted), bytes_up=len(data),
                           bytes_down=len(got.data), data=got.data, phases=phases,
                           next_round_s=float(got.header.next_round_s), digest_later=got.trailer)

    async def _late(self, round: int, counted: int, payload: Payload, size: int, phases: dict[str, float]
                    ) -> RoundResult:
        """The result of a payload of `round` that counts in round `counted` (a late one): that round's aggregate,
        with the rounds from `round` on before it (`RoundResult.before`)."""
        before = tuple([await self.missed(r, payload) for r in range(round, counted)])
        result = await self.missed(counted, payload)
        return dataclasses.replace(result, bytes_up=size, before=before, phases=phases)

    async def missed(self, round: int, like: Payload) -> RoundResult:
        """The aggregate of a closed round this peer sent nothing to, validated against the tensors of `like` (this
        peer's payload: the model's names, shapes and chunks); its canonical digest follows as in `gather`.

        Raises:
            StaleRound: the coordinator keeps it no longer.
        """
        expected = {name: (c.shape, c.chunk) for name, c in like.tensors.items()}

        def aggregate() -> Awaitable[StreamedAggregate]:
            return read_aggregate(self._stub.GetAggregate(aggregate_request(
                self.identity, self._session, self.peer_id, round, self._next()), metadata=self._metadata,
                timeout=self.wait_timeout_s), round, expected)

        try:
            got = await self._call(f"GetAggregate({round})", aggregate)
        except grpc.aio.AioRpcError as e:
            if e.code() not in _LOST_CODES:
                raise
            raise await self._lost(round, e.details() or e.code().name) from None
        return RoundResult(round=round, aggregate=got.aggregate, contributors=tuple(got.header.contributors),
                           param_digest="", aborted=bool(got.header.aborted), bytes_up=0, bytes_down=len(got.data),
                           data=got.data, next_round_s=float(got.header.next_round_s), digest_later=got.trailer)

    async def _lost(self, round: int, reason: str) -> Rejected:
        """What a lost round (its aggregate is gone) means for this peer, asked with a heartbeat."""
        open_round, member = await self.heartbeat(round)
        if not member:
            return NotMember(f"round {round}: {reason}")
        return StaleRound(f"round {round}: {reason}; the open round is {open_round}", open_round=open_round)

    async def _submit(self, round: int, data: bytes, *, loss: float, param_digest: Digest,
                      samples: int = 1, pace: Pace | None = None) -> tuple[Digest, int]:
        """One payload's Submit, tried again while BUSY; returns the digest it went with, and the round it counts
        in (a later one than `round` for a late payload: bounded staleness).

        Raises:
            Rejected: refused (the subclass says what to do).
        """
        timeout_s, digest = self.submit_timeout_s, param_digest
        parts = submit_parts(self.identity, self._session, self.peer_id, round, data,
                             param_digest="" if digest.follows else digest.value, loss=loss,
                             digest_follows=digest.follows, samples=samples,
                             need_s=pace.need_s if pace else 0.0, least_s=pace.least_s if pace else 0.0,
                             train_s=pace.train_s if pace else 0.0, micro_batches=pace.micro_batches if pace else 0,
                             compute_s=pace.compute_s if pace else 0.0)

        replied = asyncio.Event()  # a reply (a refusal) before the digest: the stream has nothing more to send

        async def follow(digest: asyncio.Future[str]) -> AsyncIterator[pb.SubmitPart]:
            for part in parts:
                yield part
            # The digest once the peer has it: the stream waits for it.
            waiting: asyncio.Future[Any] = asyncio.ensure_future(replied.wait())
            try:
                await asyncio.wait({digest, waiting}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiting.cancel()
            if digest.done() and not digest.cancelled() and not replied.is_set():
                yield digest_part(self.identity, self._session, parts[0], digest.result())

        async def submit() -> Any:
            replied.clear()
            try:
                return await self._stub.Submit(follow(digest.waiter()) if digest.follows else iter(parts),
                                               metadata=self._metadata, timeout=timeout_s)
            finally:
                replied.set()

        if digest.follows:
            timeout_s += self.round_timeout_s
        give_up_at, busy_s = time.monotonic() + timeout_s, _BUSY_FIRST_S
        while True:
            reply = await self._call(f"Submit({round})", submit)
            # BUSY: this peer's previous attempt (a connection that dropped) is still being torn down on the
            # coordinator, or its bytes in flight are spent: both pass soon.
            if reply.refusal != pb.REFUSAL_BUSY or time.monotonic() + busy_s > give_up_at:
                break
            logger.info("[%s] Submit(%d): %s; trying again in %.1f s", self.peer_id, round, reply.reason, busy_s)
            await asyncio.sleep(busy_s)
            busy_s = min(2 * busy_s, 1.0)
        if reply.accepted:
            return Digest(digest.value), max(round, int(reply.open_round))
        kind = "resync" if reply.resync else pb.Refusal.Name(reply.refusal).removeprefix("REFUSAL_").lower()
        error = refusal_error(kind, reply.reason, round=round, open_round=int(reply.open_round))
        if error is not None:
            raise error
        return Digest(digest.value), round
