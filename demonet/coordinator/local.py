"""The coordinator in-process: an adapter over the same round core as the gRPC servicer, with no sockets.

`LocalCoordinator` runs a `demonet.coordinator.core.RoundCore` in the caller's event loop; `LocalClient` is a
peer's handle on it with the calls of the gRPC client (`demonet.transport.coordinated.CoordinatorClient`), so
`demonet train` runs every peer through the one round loop over the production protocol: payloads, aggregates
and parameters go through the wire format, rounds are published before they are applied, and the canonical
digest follows the aggregate. A fault plan keyed on (peer, round) makes any call of the loop's error paths
happen on cue. Imports no grpc.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from demonet import wire
from demonet.config import Config
from demonet.errors import AggregateGone, InvalidPayload, PeerUnavailable, SubmitRejected
from demonet.optim import Payload
from demonet.transport import (
    Digest,
    Expected,
    JoinInfo,
    NotMember,
    Pace,
    Resync,
    RoundResult,
    StaleRound,
    refusal_error,
)
from demonet.wire import params as wire_params
from demonet.wire.merge import decode_contribution

from .core import RoundCore
from .metrics import Metrics
from .rounds import ClosedRound, Rounds
from .state import CanonicalState, ClosedAggregate
from .terms import LATE_ROUNDS, CoreOptions, Submission

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

class LocalCoordinator:
    """One run's coordinator in this process.

    It writes no state file: a `demonet train` run lives and ends in one process, so there is nothing
    to resume.

    Args:
        cfg: the run.
        total_rounds: the run ends after this many rounds (0: never).
        faults: (peer id or "*", round) -> one of `FAULTS`.
        on_close: called with each closed round once it is applied (in the event loop).
    """

    def __init__(self, cfg: Config, *, total_rounds: int, faults: Mapping[tuple[str, int], str] | None = None,
                 on_close: Callable[[ClosedAggregate], None] | None = None) -> None:
        for key, fault in (faults or {}).items():
            if fault not in FAULTS:
                raise ValueError(f"fault {fault!r} for {key} should be one of {', '.join(FAULTS)}")
        self.cfg, self.total_rounds = cfg, total_rounds
        self.faults = dict(faults or {})
        self.metrics = Metrics()
        self.core = RoundCore(cfg, CoreOptions(total_rounds=total_rounds), self.metrics, decide=self._decide,
                              on_applied=on_close)

    @property
    def state(self) -> CanonicalState:
        return self.core.state

    @property
    def rounds(self) -> Rounds:
        return self.core.rounds

    @property
    def finished(self) -> asyncio.Event:
        return self.core.finished

    def client(self, peer_id: str) -> LocalClient:
        return LocalClient(self, peer_id)

    async def tick_forever(self, max_sleep_s: float = 1.0) -> None:
        """Close rounds when they are due, until the run's last round; runs until cancelled or finished."""
        await self.core.tick_forever(max_sleep_s)

    def _decide(self, outcome: ClosedRound) -> ClosedRound:
        """A planned abort of the round ("*")."""
        if self.faults.pop(("*", outcome.round), None) == "abort":
            return dataclasses.replace(outcome, aborted=True)
        return outcome


def _retrieved(task: asyncio.Task[Any]) -> None:
    """A digest task nobody awaited (the round was abandoned): its error is not worth a warning."""
    if not task.cancelled():
        task.exception()


class LocalClient:
    """A peer's calls to a `LocalCoordinator` (a `demonet.transport.coordinated.CoordinatorClient`)."""

    digest_follows = True
    """A payload sent ahead is encoded and checked at once; it is counted once its digest is known."""

    def __init__(self, hub: LocalCoordinator, peer_id: str) -> None:
        self.hub, self.core, self.peer_id = hub, hub.core, peer_id

    async def join(self, *, probe: bool = False) -> JoinInfo:
        return await self.core.join(self.peer_id, probe=probe)

    async def heartbeat(self, round: int) -> tuple[int, bool]:
        return await self.core.heartbeat(self.peer_id)

    async def leave(self, round: int) -> bool:
        return await self.core.leave(self.peer_id, round)

    async def get_parameters(self, round: int, expected: Expected, *,
                             resync: bool = False) -> tuple[int, dict[str, torch.Tensor], int]:
        try:
            self.core.may_download(self.peer_id)
        except SubmitRejected as e:
            raise NotMember(e.reason) from None
        if resync:
            self.core.inbox.resynced(self.peer_id, round,
                               f"its digest after applying round {round - 1} differed from the canonical one")
        _, blob = await self.core.parameters(round)
        got, tensors = await asyncio.to_thread(wire_params.decode_parameters, blob, expected=expected)
        return got, tensors, len(blob)

    async def gather(self, round: int, payload: Payload, *, loss: float, param_digest: Digest,
                     samples: int = 1, pace: Pace | None = None) -> RoundResult:
        """Submit through the wire format, wait for the round to close, decode the aggregate; the canonical
        digest follows (`RoundResult.digest_later`), as the gRPC coordinator's trailer does. A payload sent
        ahead (its digest to come) is encoded and decoded at once, and counted once its digest is known."""
        core = self.core
        if (self.peer_id, round) in self.hub.faults:  # played from the round's start: once its digest is known
            await param_digest.known()
            await self._fail(round, self.hub.faults.pop((self.peer_id, round)))
        data = await asyncio.to_thread(wire.encode, payload, step=round)
        _, decoded = await asyncio.to_thread(decode_contribution, data, expected=core.state.specs,
                                             rules=core.state.rules)
        submission = Submission(peer_id=self.peer_id, round=round, payload=decoded,
                                payload_digest=hashlib.sha256(data).digest(), param_digest=await param_digest.known(),
                                loss=loss, size=len(data), samples=samples,
                                need_s=pace.need_s if pace else 0.0, least_s=pace.least_s if pace else 0.0,
                                train_s=pace.train_s if pace else 0.0, micro_batches=pace.micro_batches if pace else 0,
                                compute_s=pace.compute_s if pace else 0.0, late=LATE_ROUNDS)
        counted = round
        try:
            counted = await core.submit(submission)
        except SubmitRejected as e:
            error = refusal_error(e.kind.value, e.reason, round=round, open_round=core.rounds.round)
            if error is not None:
                raise error from None
        if counted <= round:
            return await self.missed(round, payload, bytes_up=len(data))
        # A late payload: it counts in the open round; the rounds between come first.
        before = tuple([await self.missed(r, payload) for r in range(round, counted)])
        return dataclasses.replace(await self.missed(counted, payload, bytes_up=len(data)), before=before)

    async def missed(self, round: int, like: Payload, *, bytes_up: int = 0) -> RoundResult:
        """A round's aggregate, decoded against the tensors of `like` (this peer's payload), once it closes."""
        core = self.core
        try:
            closed = await core.aggregate(self.peer_id, round)
        except AggregateGone as e:
            raise StaleRound(f"round {round}: {e.reason}", open_round=core.rounds.round) from None
        aggregate = None
        if not closed.aborted:
            expected = {name: (c.shape, c.chunk) for name, c in like.tensors.items()}
            _, aggregate = await asyncio.to_thread(wire.decode, closed.data, expected=expected)
        later = None
        if not closed.param_digest:
            later = asyncio.create_task(self._digest(round))
            later.add_done_callback(_retrieved)
        return RoundResult(round=round, aggregate=aggregate, contributors=closed.contributors,
                           param_digest=closed.param_digest, aborted=closed.aborted, bytes_up=bytes_up,
                           bytes_down=len(closed.data), data=closed.data, next_round_s=closed.next_round_s,
                           digest_later=later)

    async def _digest(self, round: int) -> str:
        try:
            return await self.core.canonical_digest(round)
        except AggregateGone as e:
            raise InvalidPayload(f"round {round}: no canonical digest ({e.reason})") from None

    async def _fail(self, round: int, fault: str) -> None:
        """Play a planned fault: the round stops waiting for this peer, then the matching error."""
        core = self.core
        await core.withdraw([self.peer_id], drop=fault in ("refused", "down", "hang"))
        if fault == "down":
            raise PeerUnavailable(f"round {round}: the coordinator is unreachable (planned fault)")
        if fault == "hang":
            await asyncio.Event().wait()
        async with core.cond:
            await core.wait_for(lambda: core.rounds.round > round, f"round {round} to close")
            open_round = core.rounds.round
        errors: dict[str, Any] = {
            "refused": NotMember(f"round {round}: not a member (planned fault)"),
            "stale": StaleRound(f"round {round} closed without this payload (planned fault)", open_round=open_round),
            "resync": Resync(f"round {round}: digest differs (planned fault)"),
            "invalid": InvalidPayload(f"round {round}: the aggregate failed validation (planned fault)")}
        raise errors[fault]

    async def close(self) -> None:
        """Nothing to release."""
