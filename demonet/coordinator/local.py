"""The coordinator in-process: the same rounds, canonical state and merge as the gRPC server, no sockets.

`LocalCoordinator` runs `demonet.coordinator.rounds.Rounds` and `demonet.coordinator.state.CanonicalState`
in the caller's event loop; `LocalClient` is a peer's handle on it with the calls of the gRPC client
(`demonet.transport.coordinated.CoordinatorClient`), so `demonet train` runs every peer through the one
`demonet.train.loop.RoundLoop`, and payloads, aggregates and parameters still go through the wire
format. A fault plan keyed on (peer, round) makes any call of the loop's error paths happen on cue.
Imports no grpc.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from demonet import wire
from demonet.config import Config
from demonet.errors import InvalidPayload, PeerUnavailable
from demonet.optim import Payload
from demonet.train.data import data_seed
from demonet.train.task import param_specs
from demonet.transport import Digest, Expected, JoinInfo, NotMember, Resync, RoundResult, StaleRound, known
from demonet.wire import params as wire_params
from demonet.wire.merge import decode_contribution

from .rounds import RoundConfig, Rounds, SubmitRejected
from .state import CanonicalState, ClosedAggregate

__all__ = ["FAULTS", "LocalClient", "LocalCoordinator"]

logger = logging.getLogger(__name__)

FAULTS = ("refused", "stale", "resync", "invalid", "down", "hang", "abort")
"""What a fault plan can make happen to a peer's gather of a round:

- refused: the coordinator dropped the peer (`NotMember`): it joins again;
- stale: the round closed without its payload (`StaleRound`);
- resync: its digest differs from the canonical one (`Resync`);
- invalid: the aggregate it got fails validation (`InvalidPayload`);
- down: the coordinator is unreachable (`PeerUnavailable`);
- hang: the round never ends for it (the gather waits until cancelled);
- abort (peer "*"): the round closes aborted for everyone.
"""

_KEEP_AGGREGATES = 4


def _now() -> float:
    return time.monotonic()


class LocalCoordinator:
    """One run's coordinator in this process.

    It writes no state file: a `demonet train` run lives and ends in one process, so there is nothing
    to resume and nothing on a round's critical path but the merge and the apply, as in the gRPC
    coordinator, which writes its state in the background after publishing a round.

    Args:
        cfg: the run.
        total_rounds: the run ends after this many rounds (0: never).
        faults: (peer id or "*", round) -> one of `FAULTS`.
        on_close: called with each closed round (in the event loop, after it is applied).
    """

    def __init__(self, cfg: Config, *, total_rounds: int, faults: Mapping[tuple[str, int], str] | None = None,
                 on_close: Callable[[ClosedAggregate], None] | None = None) -> None:
        for key, fault in (faults or {}).items():
            if fault not in FAULTS:
                raise ValueError(f"fault {fault!r} for {key} should be one of {', '.join(FAULTS)}")
        self.cfg, self.total_rounds, self.on_close = cfg, total_rounds, on_close
        self.faults = dict(faults or {})
        self.state = CanonicalState(cfg)
        self.rounds = Rounds(cfg=RoundConfig(round_timeout_s=cfg.net.round_timeout_s, min_peers=cfg.net.min_peers,
                                             heartbeat_timeout_s=cfg.net.heartbeat_timeout_s,
                                             start_peers=cfg.net.start_peers,
                                             max_idle_rounds=cfg.net.max_idle_rounds), now=_now())
        self.payloads: dict[str, Payload] = {}
        self.aggregates: OrderedDict[int, ClosedAggregate] = OrderedDict()
        self.cond = asyncio.Condition()
        self.finished = asyncio.Event()

    def client(self, peer_id: str) -> LocalClient:
        return LocalClient(self, peer_id)

    @property
    def wait_s(self) -> float:
        return 2 * self.cfg.net.round_timeout_s + 30.0

    async def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        """Wait, holding `cond` on return, until `predicate()`; `PeerUnavailable` after `wait_s`."""
        try:
            async with asyncio.timeout(self.wait_s):
                await self.cond.wait_for(predicate)
        except TimeoutError:
            raise PeerUnavailable(f"timed out waiting for {what}") from None

    async def tick_forever(self, max_sleep_s: float = 1.0) -> None:
        """Close rounds when they are due, until the run's last round; runs until cancelled or finished."""
        while not self.finished.is_set():
            async with self.cond:
                if self.rounds.due(_now()):
                    await self._close_round()
                    continue
                try:
                    async with asyncio.timeout(max(0.001, min(max_sleep_s, self.rounds.seconds_left(_now())))):
                        await self.cond.wait()
                except TimeoutError:
                    pass

    async def _close_round(self) -> None:
        outcome = self.rounds.outcome()
        if self.faults.pop(("*", outcome.round), None) == "abort":
            outcome = dataclasses.replace(outcome, aborted=True)
        payloads = [self.payloads[p] for p in outcome.contributors]
        closed = await asyncio.to_thread(self.state.close, outcome, payloads)
        self.rounds.close(_now())
        self.aggregates[closed.round] = closed
        while len(self.aggregates) > _KEEP_AGGREGATES:
            self.aggregates.popitem(last=False)
        self.payloads = {}
        if self.on_close is not None:
            self.on_close(closed)
        if self.total_rounds and self.rounds.round >= self.total_rounds:
            self.finished.set()
        self.cond.notify_all()


class LocalClient:
    """A peer's calls to a `LocalCoordinator` (a `demonet.transport.coordinated.CoordinatorClient`)."""

    digest_follows = True
    """A payload sent ahead is encoded and checked at once; it is counted once its digest is known."""

    def __init__(self, hub: LocalCoordinator, peer_id: str) -> None:
        self.hub, self.peer_id = hub, peer_id

    async def join(self, *, probe: bool = False) -> JoinInfo:
        hub = self.hub
        async with hub.cond:
            first = hub.rounds.round if probe else hub.rounds.join(self.peer_id, _now())
            hub.cond.notify_all()
        net = hub.cfg.net
        return JoinInfo(peer_id=self.peer_id, round=first, run_config=hub.cfg.to_dict(),
                        data_seed=data_seed(hub.cfg.train.seed, self.peer_id), round_timeout_s=net.round_timeout_s,
                        heartbeat_interval_s=net.heartbeat_interval_s, total_rounds=hub.total_rounds,
                        param_specs=tuple(param_specs(hub.state.params)))

    async def heartbeat(self, round: int) -> tuple[int, bool]:
        async with self.hub.cond:
            return self.hub.rounds.round, self.hub.rounds.heartbeat(self.peer_id, _now())

    async def leave(self, round: int) -> bool:
        async with self.hub.cond:
            left = self.hub.rounds.leave(self.peer_id)
            self.hub.cond.notify_all()
        return left

    async def get_parameters(self, round: int, expected: Expected, *,
                             resync: bool = False) -> tuple[int, dict[str, torch.Tensor], int]:
        hub = self.hub
        async with hub.cond:
            await hub.wait_for(lambda: hub.rounds.round >= round, f"round {round} to open")
            blob = hub.state.parameters_blob(hub.rounds.round)
        got, tensors = await asyncio.to_thread(wire_params.decode_parameters, blob, expected=expected)
        return got, tensors, len(blob)

    async def gather(self, round: int, payload: Payload, *, loss: float, param_digest: Digest) -> RoundResult:
        """Submit through the wire format, wait for the round to close, decode the aggregate. A payload sent
        ahead (its digest to come) is encoded and decoded at once, and counted once its digest is known."""
        hub = self.hub
        if (self.peer_id, round) in hub.faults:  # played from the round's start: once its digest is known
            await known(param_digest)
            await self._fail(round, hub.faults.pop((self.peer_id, round)))
        data = await asyncio.to_thread(wire.encode, payload, step=round)
        _, decoded = await asyncio.to_thread(decode_contribution, data, expected=hub.state.specs,
                                             rules=hub.state.rules)
        param_digest = await known(param_digest)
        async with hub.cond:
            if param_digest != hub.state.digest and round == hub.rounds.round:
                raise Resync(f"round {round}: parameter digest differs from the canonical one")
            try:
                hub.rounds.submit(self.peer_id, round, _now())
            except SubmitRejected as e:
                if e.kind == "stale":
                    raise StaleRound(f"round {round}: {e.reason}", open_round=hub.rounds.round) from None
                if e.kind != "duplicate":
                    raise NotMember(f"round {round}: {e.reason}") from None
            hub.payloads[self.peer_id] = decoded
            hub.cond.notify_all()
            await hub.wait_for(lambda: hub.rounds.round > round, f"round {round} to close")
            closed = hub.aggregates.get(round)
        if closed is None:
            raise StaleRound(f"round {round} is too old", open_round=hub.rounds.round)
        aggregate = None
        if not closed.aborted:
            expected = {name: (c.shape, c.chunk) for name, c in payload.tensors.items()}
            _, aggregate = await asyncio.to_thread(wire.decode, closed.data, expected=expected)
        return RoundResult(round=round, aggregate=aggregate, contributors=closed.contributors,
                           param_digest=closed.param_digest, aborted=closed.aborted, bytes_up=len(data),
                           bytes_down=len(closed.data), data=closed.data)

    async def _fail(self, round: int, fault: str) -> None:
        """Play a planned fault: the round stops waiting for this peer, then the matching error."""
        hub = self.hub
        async with hub.cond:
            hub.rounds.withdraw(self.peer_id, _now(), drop=fault in ("refused", "down", "hang"))
            hub.cond.notify_all()
        if fault == "down":
            raise PeerUnavailable(f"round {round}: the coordinator is unreachable (planned fault)")
        if fault == "hang":
            await asyncio.Event().wait()
        async with hub.cond:
            await hub.wait_for(lambda: hub.rounds.round > round, f"round {round} to close")
            open_round = hub.rounds.round
        errors: dict[str, Any] = {
            "refused": NotMember(f"round {round}: not a member (planned fault)"),
            "stale": StaleRound(f"round {round} closed without this payload (planned fault)", open_round=open_round),
            "resync": Resync(f"round {round}: digest differs (planned fault)"),
            "invalid": InvalidPayload(f"round {round}: the aggregate failed validation (planned fault)")}
        raise errors[fault]

    async def close(self) -> None:
        """Nothing to release."""
