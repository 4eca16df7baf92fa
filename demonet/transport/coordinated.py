"""Membership in a coordinator's run, over any client that speaks the coordinator's calls.

`CoordinatorMembership` is the `Membership` of a peer whose run has a coordinator: the gRPC client
(`demonet.transport.grpc.GrpcClient`) and the in-process one (`demonet.coordinator.local.LocalClient`)
offer the same calls (`CoordinatorClient`). No grpc, no service module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from demonet.errors import DemonetError
from demonet.optim import Payload

from . import Digest, Expected, JoinInfo, Pace, Parameters, RoundResult, StaleRound, catch_up, catch_up_timeout_s

__all__ = ["CoordinatorClient", "CoordinatorMembership"]

logger = logging.getLogger(__name__)


class CoordinatorClient(Protocol):
    """A peer's calls to a coordinator."""

    peer_id: str

    async def join(self, *, probe: bool = False) -> JoinInfo: ...
    async def heartbeat(self, round: int) -> tuple[int, bool]: ...
    async def leave(self, round: int) -> bool: ...
    async def get_parameters(self, round: int, expected: Expected, *,
                             resync: bool = False) -> tuple[int, dict[str, torch.Tensor], int]: ...
    digest_follows: bool

    async def gather(self, round: int, payload: Payload, *, loss: float, param_digest: Digest,
                     samples: int = 1, pace: Pace | None = None) -> RoundResult: ...
    async def missed(self, round: int, like: Payload) -> RoundResult: ...
    async def close(self) -> None: ...


class CoordinatorMembership:
    """Join, download, heartbeat and catch up with a coordinator (a `demonet.transport.Membership`)."""

    def __init__(self, client: CoordinatorClient, source: str = "the coordinator") -> None:
        self.client, self.source = client, source
        self.round_timeout_s = 30.0
        """From the last join: catching up is bounded by a number of round timeouts."""

    async def join(self) -> JoinInfo:
        info = await self.client.join()
        self.round_timeout_s = info.round_timeout_s
        return info

    async def probe(self) -> JoinInfo:
        """The run's config and parameters without being admitted: a peer builds and checks its model first."""
        return await self.client.join(probe=True)

    async def first_parameters(self, info: JoinInfo, expected: Expected) -> Parameters | None:
        return await self.parameters(info.round, expected)

    async def parameters(self, round: int, expected: Expected, *, resync: bool = False) -> Parameters:
        got, tensors, size = await self.client.get_parameters(round, expected, resync=resync)
        return Parameters(got, tensors, size, self.source)

    async def catch_up(self, reason: DemonetError, round: int, expected: Expected) -> Parameters:
        return await catch_up(reason, join=self.join, download=lambda r: self.parameters(r, expected), round=round,
                              timeout_s=catch_up_timeout_s(self.round_timeout_s))

    async def heartbeat(self, round: int) -> None:
        _, member = await self.client.heartbeat(round)
        if not member:
            logger.warning("[%s round=%d] the coordinator dropped this member: joining again", self.client.peer_id,
                           round)
            await self.join()

    async def moved_on(self, round: int, like: Payload, most: int) -> list[RoundResult] | None:
        open_round, member = await self.client.heartbeat(round)
        if not member or open_round <= round:
            return None  # on time; or dropped, which its Submit learns (NOT_MEMBER) and catches up from
        if open_round - round > most:
            raise StaleRound(f"round {round}: the run is at round {open_round}, over {most} rounds on",
                             open_round=open_round)
        return [await self.client.missed(r, like) for r in range(round, open_round)]

    async def leave(self, round: int) -> None:
        if await self.client.leave(round):
            logger.info("[%s round=%d] left the run: its rounds no longer wait for this peer", self.client.peer_id,
                        round)

    async def begin_round(self, round: int, digest: str,
                          named_parameters: Callable[[], list[tuple[str, torch.Tensor]]]) -> None:
        """The coordinator needs nothing before a round."""

    async def agree(self, value: bool) -> bool:
        return value

    async def close(self) -> None:
        await self.client.close()
