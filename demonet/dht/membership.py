"""Membership in a DHT run: where the run is, admission to a round, parameters from several donors.

Service-side glue between `demonet.loop.RoundLoop` and `demonet.dht.gatherer.DhtGatherer`; the
DHT itself (records, freeze, exchange) lives there. Imports no grpc.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from demonet.errors import DemonetError, PeerUnavailable
from demonet.optim import Payload
from demonet.transport import Expected, JoinInfo, Parameters, RoundResult

if TYPE_CHECKING:
    from .gatherer import DhtGatherer

__all__ = ["DhtMembership"]

logger = logging.getLogger(__name__)

_REGISTER_S = 0.3  # beside settle_s: from reading the head round until the registration is on the members' nodes
_MAX_LEAD = 1000  # rounds ahead a registration names at most


class DhtMembership:
    """A `demonet.transport.Membership` over the DHT: a peer registers for the next rounds, waits to be
    admitted to one, and loads that round's parameters from the peers that hold them.

    Args:
        dht: this peer's DHT node and round exchange.
        info: what joining tells the loop (the run's config is the peer's own; every peer must use
            the same); its `round` is replaced by where the run stands when `join` is called.
    """

    def __init__(self, dht: DhtGatherer, info: JoinInfo) -> None:
        self.dht, self.info = dht, info

    async def join(self) -> JoinInfo:
        """Where the run stands: a new run (no round frozen yet) starts from the seeded parameters."""
        head = await self.dht.head_round()
        fresh = head is None or head == 0
        total = self.info.total_rounds
        round = 0 if fresh else head + 1  # type: ignore[operator]
        if not fresh and total and round >= total:
            round = total  # the run is over
        return JoinInfo(peer_id=self.info.peer_id, round=round, run_config=self.info.run_config,
                        data_seed=self.info.data_seed, round_timeout_s=self.info.round_timeout_s,
                        heartbeat_interval_s=0.0, total_rounds=total, fresh=fresh)

    async def first_parameters(self, info: JoinInfo, expected: Expected) -> Parameters | None:
        return None if info.fresh else await self.rejoin(expected)

    async def parameters(self, round: int, expected: Expected, *, resync: bool = False) -> Parameters:
        """The parameters at the start of `round` from several donors (`resync` only matters to a
        coordinator; donors keep no count)."""
        tensors, size, donors = await self.dht.load_parameters(round, expected)
        return Parameters(round, tensors, size, f"{len(donors)} donors ({', '.join(donors)})")

    async def catch_up(self, reason: DemonetError, round: int, expected: Expected) -> Parameters:
        """Late, or not the majority's parameters: register for the next rounds and load the parameters."""
        return await self.rejoin(expected)

    async def rejoin(self, expected: Expected) -> Parameters:
        """Register for the next rounds, wait to be admitted to one, and load its parameters."""
        opts = self.dht.opts
        wait_s = opts.window_s + 3 * opts.exchange_timeout_s + 30.0
        # Bounded by time, not by tries: while rounds are shorter than a DHT store, a registration
        # can miss the rounds it names several times in a row before one lands in time.
        give_up_at = time.monotonic() + wait_s
        tries, seen = 0, None
        while tries == 0 or time.monotonic() < give_up_at:
            tries += 1
            head = await self.dht.head_round()
            if head is None:
                raise PeerUnavailable("the DHT knows no round of this run")
            # A registration counts from a freeze `settle_s` after it: where rounds are shorter than that,
            # it names rounds far enough ahead, at the pace the run went since the last try.
            lead = 0
            if seen is not None and head > seen[0]:
                rate = (head - seen[0]) / max(time.monotonic() - seen[1], 1e-3)
                lead = min(math.ceil(rate * (opts.settle_s + _REGISTER_S)), _MAX_LEAD)
            seen = head, time.monotonic()
            targets = [head + 1 + lead, head + 2 + lead, head + 3 + lead]
            await self.dht.register(targets)
            logger.info("[%s] registered to join rounds %d-%d (the run's head round: %d)", self.info.peer_id,
                        targets[0], targets[-1], head)
            for r in targets:
                if await self.dht.admitted(r, wait_s):
                    try:
                        return await self.parameters(r, expected)
                    except DemonetError as e:
                        logger.warning("[%s] could not load the parameters of round %d: %s", self.info.peer_id, r, e)
                        break
        raise PeerUnavailable(f"not admitted to the run after {tries} tries in {wait_s:.0f} s")

    async def moved_on(self, round: int, like: Payload, most: int) -> list[RoundResult] | None:
        """DHT rounds do not let a peer span them (each slice owner merges the round's parts at its close)."""
        return None

    async def heartbeat(self, round: int) -> None:
        """A DHT peer's announcements each round are its heartbeat."""

    async def leave(self, round: int) -> None:
        """Tell the others this peer leaves before `round` (a graceful stop): its record among the round's
        announcements (`RoundBoard.leave`), so that their rounds neither wait for it nor count it in their
        majority's base."""
        if await self.dht.leave(round):
            logger.info("[%s round=%d] left the run: its rounds no longer wait for this peer", self.info.peer_id,
                        round)

    async def begin_round(self, round: int, digest: str,
                          named_parameters: Callable[[], list[tuple[str, torch.Tensor]]]) -> None:
        """Serve this peer's parameters to joiners as those of the round. Its state (digest, address, the
        peers it expects) is stored with its announcement, in the same DHT call."""
        self.dht.offer(round, named_parameters)

    async def agree(self, value: bool) -> bool:
        return value

    async def close(self) -> None:
        await self.dht.close()
