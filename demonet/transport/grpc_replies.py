"""What a peer reads back from the coordinator: the JoinReply and the StatusReply as plain values, and the
GetAggregate stream (the header, the parts, the decoded aggregate, and the trailer's canonical digest, read on
by a task of its own). Imports grpc (its call errors) and the wire layer; the gRPC client makes the calls.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from demonet import wire
from demonet.errors import InvalidPayload
from demonet.optim import Payload
from demonet.wire.params import PROTOCOL, protocol_mismatch
from demonet.wire.task_files import listing_from_pb

from . import JoinInfo

__all__ = ["CoordinatorStatus", "StreamedAggregate", "coordinator_status", "drop_early", "join_info", "read_aggregate"]


@dataclass(frozen=True)
class StreamedAggregate:
    """A GetAggregate stream up to its decoded aggregate, with `time.perf_counter()` at each step; the
    trailer (the canonical digest) is still being read by `trailer`."""

    header: Any  # pb.AggregateHeader
    data: bytes  # the serialized aggregate (empty when aborted)
    aggregate: Payload | None  # `data` decoded (None when aborted)
    header_at: float
    parts_at: float  # the last part came (the header's time when aborted)
    decoded_at: float
    trailer: asyncio.Task[str]


@dataclass(frozen=True)
class CoordinatorStatus:
    """The coordinator's StatusReply, as plain values."""

    round: int
    phase: str
    members: tuple[str, ...]
    submitted: int
    seconds_left: float
    param_digest: str
    bytes_up: int
    bytes_down: int
    last_loss: float
    rounds_closed: int
    rounds_aborted: int
    rejected: int
    resyncs: int
    """Members that downloaded the whole parameters again because their digest differed."""


def coordinator_status(reply: Any) -> CoordinatorStatus:
    """A StatusReply as plain values."""
    return CoordinatorStatus(
        round=int(reply.round), phase=reply.phase, members=tuple(reply.members), submitted=int(reply.submitted),
        seconds_left=float(reply.seconds_left), param_digest=reply.param_digest, bytes_up=int(reply.bytes_up),
        bytes_down=int(reply.bytes_down), last_loss=float(reply.last_loss),
        rounds_closed=int(reply.rounds_closed), rounds_aborted=int(reply.rounds_aborted),
        rejected=int(reply.rejected), resyncs=int(reply.resyncs))


def join_info(reply: Any, peer_id: str, address: str) -> JoinInfo:
    """A JoinReply as the run's terms for this peer.

    Raises:
        PermissionError: the coordinator at `address` speaks another protocol version (a peer probes first, so
            it was not admitted).
        InvalidPayload: its run config or parameter specs do not parse, or its task files are not a list this
            peer takes (`demonet.wire.task_files.listing_from_pb`).
    """
    if reply.protocol != PROTOCOL:
        why = protocol_mismatch(reply.protocol, sender=f"the coordinator at {address}", receiver="this peer")
        raise PermissionError(f"Join: {why}")
    try:
        run_config = json.loads(reply.run_config)
    except json.JSONDecodeError as e:
        raise InvalidPayload(f"Join: run_config is not JSON: {e}") from None
    if not isinstance(run_config, dict):
        raise InvalidPayload("Join: run_config should be a JSON object")
    try:
        listed = json.loads(reply.param_specs) if reply.param_specs else None
        specs = tuple((str(n), tuple(int(d) for d in s), str(t)) for n, s, t in listed) if listed else None
    except (ValueError, TypeError) as e:
        raise InvalidPayload(f"Join: param_specs is not a list of [name, shape, dtype]: {e}") from None
    return JoinInfo(peer_id=reply.peer_id or peer_id, round=int(reply.round), run_config=run_config,
                    data_seed=int(reply.data_seed), round_timeout_s=float(reply.round_timeout_s),
                    heartbeat_interval_s=float(reply.heartbeat_interval_s), total_rounds=int(reply.total_rounds),
                    param_specs=specs, task_files=listing_from_pb(reply.task_files))


def _retrieved(task: asyncio.Task[Any]) -> None:
    """A trailer task nobody awaited (the round was abandoned): its error is not worth a warning."""
    if not task.cancelled():
        task.exception()


def drop_early(early: asyncio.Task[StreamedAggregate]) -> None:
    """Call off a GetAggregate sent beside a Submit that failed: the call, or the trailer of an aggregate it
    had already received (a round that closed without this payload)."""
    early.cancel()

    def drop(task: asyncio.Task[StreamedAggregate]) -> None:
        if not task.cancelled() and task.exception() is None:
            task.result().trailer.cancel()

    early.add_done_callback(drop)


async def read_aggregate(call: Any, round: int, expected: Mapping[str, tuple[tuple[int, ...], tuple[int, int]]]
                         ) -> StreamedAggregate:
    """One GetAggregate stream: the header and the parts of the aggregate (none if aborted), decoded; a
    task goes on reading its trailer (`_trailer`), which comes once the coordinator applied the round.

    Args:
        call: the GetAggregate call (a stream of `AggregateChunk`).
        round: the round asked for.
        expected: name -> (shape, chunk) of the tensors the aggregate must hold.
    """
    header, data, header_at, parts_at = None, b"", 0.0, 0.0
    parts = wire.Reassembler()
    stream = aiter(call)
    while header is None or not (header.aborted or data):
        chunk: Any = await anext(stream, None)
        kind = None if chunk is None else chunk.WhichOneof("kind")
        if kind == "header" and header is None:
            header, header_at = chunk.header, time.perf_counter()
            if header.round != round:
                raise InvalidPayload(f"GetAggregate({round}): the header is for round {header.round}")
            parts_at = header_at
        elif kind == "part" and header is not None and not header.aborted:
            whole = parts.add(chunk.part)
            if whole is not None:
                data, parts_at = whole, time.perf_counter()
        elif chunk is None:
            raise InvalidPayload(f"GetAggregate({round}): the stream ended before the aggregate was whole")
        else:
            raise InvalidPayload(f"GetAggregate({round}): unexpected {kind} in the stream")
    trailer = asyncio.create_task(_trailer(round, stream))
    trailer.add_done_callback(_retrieved)
    try:
        aggregate = None
        if not header.aborted:
            # A small aggregate is decoded here: a trip to a worker thread would cost more than the decode.
            step, aggregate = (wire.decode(data, expected=expected) if len(data) <= wire.INLINE_DECODE_BYTES
                               else await asyncio.to_thread(wire.decode, data, expected=expected))
            if step != round:
                raise InvalidPayload(f"GetAggregate({round}): the aggregate is for round {step}")
    except BaseException:
        trailer.cancel()
        raise
    return StreamedAggregate(header, data, aggregate, header_at, parts_at, time.perf_counter(), trailer)

async def _trailer(round: int, stream: AsyncIterator[Any]) -> str:
    """The rest of a GetAggregate stream: the trailer's canonical digest, then the stream's end.

    Raises:
        InvalidPayload: the stream broke off or was malformed; the caller cannot tell whether it is on
            the canonical parameters (a coordinator that restarted between its publish and its apply).
    """
    try:
        chunk = await anext(stream, None)
        if chunk is None or chunk.WhichOneof("kind") != "trailer" or not chunk.trailer.param_digest:
            raise InvalidPayload(f"GetAggregate({round}): no canonical digest after the aggregate")
        async for extra in stream:
            raise InvalidPayload(f"GetAggregate({round}): unexpected {extra.WhichOneof('kind')} after the "
                                 "trailer")
    except grpc.aio.AioRpcError as e:
        raise InvalidPayload(f"GetAggregate({round}): the stream broke off before the canonical digest "
                             f"({e.code().name}: {e.details()})") from None
    return str(chunk.trailer.param_digest)
