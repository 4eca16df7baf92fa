"""A FlexDeMo node's ranks as one member of a coordinator run: rank 0 talks, every rank follows.

`NodeLink` is the `Membership` and the `Gatherer` of every rank of a node. Local rank 0 holds the
coordinator membership; each call runs there and its outcome is broadcast over the node's group, so
every rank takes the same branch of `demonet.loop.RoundLoop` and the collectives always match.
A round's shard payloads are gathered to rank 0, which submits their row-wise concatenation (the
payload an unsharded peer would send); the aggregate goes back to the ranks as its validated wire
bytes. Imports torch.distributed and the transport protocols; no grpc.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from demonet import errors, transport, wire
from demonet.errors import DemonetError, PeerUnavailable
from demonet.optim import Payload
from demonet.transport import Digest, Expected, JoinInfo, Pace, Parameters, RoundResult
from demonet.transport.coordinated import CoordinatorMembership

from .shard import join_shards

__all__ = ["NodeLink"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_ERRORS: dict[str, type[DemonetError]] = {
    cls.__name__: cls for cls in (transport.NotMember, transport.Resync, transport.Rejected, errors.InvalidPayload,
                                  PeerUnavailable, DemonetError)}


def _error(e: DemonetError) -> tuple[str, str, int]:
    """An exception as plain values (StaleRound's keyword-only argument does not survive pickling)."""
    if isinstance(e, transport.StaleRound):
        return "StaleRound", str(e), e.open_round
    name = next(cls.__name__ for cls in type(e).__mro__ if cls.__name__ in _ERRORS)
    return name, str(e), -1


def _raise(kind: str, message: str, open_round: int) -> None:
    if kind == "StaleRound":
        raise transport.StaleRound(message, open_round=open_round)
    raise _ERRORS[kind](message)


class NodeLink:
    """One rank's view of the node's membership (`inner` on local rank 0, None elsewhere).

    Args:
        group: the node's process group (its ranks hold the shards of one model); the link talks over a
            new groups of the same ranks (every rank constructs its NodeLink at the same point).
        inner: rank 0's membership of the coordinator run.
        full_shapes: the whole parameters' shapes by name (to join the ranks' shard payloads).
    """

    digest_follows = False
    """Every rank gathers a round together (collectives on the node's group): no round is sent ahead."""

    def __init__(self, group: dist.ProcessGroup, inner: CoordinatorMembership | None,
                 full_shapes: Mapping[str, tuple[int, ...]]) -> None:
        # Groups of its own (gloo: Python objects on the CPU). Collectives of one group must come in the
        # same order on every rank, so with overlapped rounds each concurrent caller has its own: the
        # training thread's FSDP (the node's group), the loop's calls (`group`), and the round in flight
        # (`exchange`: its gather and outcome broadcast).
        ranks = dist.get_process_group_ranks(group)
        self.group = dist.new_group(ranks, backend="gloo")
        self.exchange = dist.new_group(ranks, backend="gloo")
        self.inner, self.full_shapes = inner, dict(full_shapes)
        self.rank = dist.get_rank(self.group)
        self.src = dist.get_global_rank(self.group, 0)

    async def _bcast(self, value: Any, group: dist.ProcessGroup | None = None) -> Any:
        box = [value]
        await asyncio.to_thread(dist.broadcast_object_list, box, src=self.src, group=group or self.group)
        return box[0]

    async def _on_rank0(self, call: Callable[[CoordinatorMembership], Awaitable[_T]]) -> _T:
        """`call(inner)` on rank 0; its result, or its error, on every rank."""
        outcome: tuple[str, Any] | None = None
        if self.inner is not None:
            try:
                outcome = ("ok", await call(self.inner))
            except DemonetError as e:
                outcome = ("error", _error(e))
        kind, value = await self._bcast(outcome)
        if kind == "error":
            _raise(*value)
        return value  # type: ignore[no-any-return]

    # -- Membership ----------------------------------------------------------------------------------

    async def join(self) -> JoinInfo:
        return await self._on_rank0(lambda m: m.join())

    async def first_parameters(self, info: JoinInfo, expected: Expected) -> Parameters | None:
        return await self._on_rank0(lambda m: m.first_parameters(info, expected))

    async def parameters(self, round: int, expected: Expected, *, resync: bool = False) -> Parameters:
        return await self._on_rank0(lambda m: m.parameters(round, expected, resync=resync))

    async def catch_up(self, reason: DemonetError, round: int, expected: Expected) -> Parameters:
        return await self._on_rank0(lambda m: m.catch_up(reason, round, expected))

    async def moved_on(self, round: int, like: Payload, most: int) -> list[RoundResult] | None:
        """A node's ranks train in step with each other: a node does not span rounds."""
        return None

    async def heartbeat(self, round: int) -> None:
        if self.inner is not None:  # rank 0 alone: no collective in the heartbeat task
            await self.inner.heartbeat(round)

    async def leave(self, round: int) -> None:
        if self.inner is not None:  # rank 0 speaks for the node; no collective on the way out
            await self.inner.leave(round)

    async def begin_round(self, round: int, digest: str,
                          named_parameters: Callable[[], list[tuple[str, torch.Tensor]]]) -> None:
        """The coordinator needs nothing before a round."""

    async def agree(self, value: bool) -> bool:
        return bool(await self._bcast(value))

    async def close(self) -> None:
        if self.inner is not None:
            await self.inner.close()

    # -- Gatherer ------------------------------------------------------------------------------------

    async def gather(self, round: int, payload: Payload, *, loss: float, param_digest: Digest,
                     samples: int = 1, pace: Pace | None = None) -> RoundResult:
        """Submit the node's payload (its ranks' shards joined on rank 0) and wait for the round's outcome.

        Every rank gets the outcome: the aggregate as rank 0 received and validated it, decoded from
        the same bytes, or the same error.
        """
        digest = await param_digest.known()  # every rank joins the gather below at the same round
        gathered: list[Any] | None = [None] * dist.get_world_size(self.exchange) if self.rank == 0 else None
        await asyncio.to_thread(dist.gather_object, (payload, loss), gathered, dst=self.src, group=self.exchange)

        async def submit(m: CoordinatorMembership) -> tuple[RoundResult, dict[str, Any]]:
            assert gathered is not None
            node_payload = join_shards([g[0] for g in gathered], self.full_shapes)
            result = await m.client.gather(round, node_payload, loss=sum(g[1] for g in gathered) / len(gathered),
                                           param_digest=Digest(digest), samples=samples)
            specs = {name: (c.shape, c.chunk) for name, c in node_payload.tensors.items()}
            return result, specs

        outcome: tuple[str, Any] | None = None
        if self.inner is not None:
            try:
                result, specs = await submit(self.inner)
                outcome = ("ok", (result.data, specs, result.round, result.contributors, result.param_digest,
                                  result.aborted, result.bytes_up, result.bytes_down))
            except DemonetError as e:
                outcome = ("error", _error(e))
        kind, value = await self._bcast(outcome, self.exchange)
        if kind == "error":
            _raise(*value)
        if self.inner is not None:
            return result
        data, specs, r, contributors, digest, aborted, bytes_up, bytes_down = value
        aggregate = None if aborted else (await asyncio.to_thread(wire.decode, data, expected=specs))[1]
        return RoundResult(round=r, aggregate=aggregate, contributors=contributors, param_digest=digest,
                           aborted=aborted, bytes_up=bytes_up, bytes_down=bytes_down, data=data)
