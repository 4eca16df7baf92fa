"""The round loop's explicit state: how a round ended for the peer, a round in flight, a round whose canonical
digest is still to come, the loop's log prefix, and the steps a pipeline drives (`LoopSteps`). Imports asyncio,
the replica protocol and the transport's types; no pipeline and not the loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

import torch

from demonet.optim import Payload
from demonet.train.replica import Replica
from demonet.transport import Digest, EncodesAhead, Gatherer, Membership, Parameters, RoundResult

from .pacing import PeerPace
from .rows import MetricsRow

__all__ = ["STOP_GRACE_S", "InFlight", "LoopSteps", "RoundLog", "RoundOutcome", "SpanJob", "Unchecked", "check_beats"]

STOP_GRACE_S = 5.0
"""After SIGTERM, how long a peer still waits for the open round's aggregate before abandoning it."""


class RoundOutcome(enum.Enum):
    """How a round ended for this peer (`RoundLoop.land`, `RoundLoop.check`)."""

    APPLIED = "applied"
    """The peer applied the round and is at the next one, on the canonical parameters."""
    CAUGHT_UP = "caught_up"
    """The payload missed the run, or the digest differed: the run's parameters were loaded."""
    STOPPED = "stopped"
    """SIGTERM and the round abandoned, or the run's last round closed without this peer."""


@dataclass
class InFlight:
    """A round whose payload is submitted and whose outcome is not settled yet."""

    round: int
    payload: Payload
    loss: float
    gather: asyncio.Task[RoundResult]
    started: float
    """`time.perf_counter()` when the round's training began."""
    compute_s: float
    """Blocking torch work of the round so far (forward, backward, compress, lookahead)."""
    digest: Digest | None = None
    """The digest the round starts from, when its payload left before it was known (set once the round
    before is settled; called off if the peer will not start this round from it)."""
    checked_s: float = 0.0
    """How long the round waited, after its forward and backward, for the round before's canonical digest."""
    encode_s: float = 0.0
    """How long the gatherer's encode ahead took in the training's thread (`EncodesAhead`): not compute."""
    train_s: float = 0.0
    """How long the round's forward and backward took (the rest of `compute_s` is its exchange's own work)."""
    samples: int = 1
    """How many samples the payload was computed from (its weight in the merge)."""
    micro_batches: int = 1
    """How many micro-batches the round trained."""
    stale: int = 0
    """How many rounds older than the round it is sent in its gradient's parameters are (a peer whose
    micro-batch spans rounds, counted late: `RoundResult.before`)."""


@dataclass
class SpanJob:
    """A micro-batch running across rounds (`demonet.loop.spanning`): its task, which returns its loss and seconds,
    the round it started in, when its last round's share of it was counted, and the samples counted so far."""

    task: asyncio.Future[tuple[float, float]]
    round: int
    mark: float
    """`time.perf_counter()` when it started, then at each round's cut-off."""
    claimed: int = 0
    """The samples its rounds have weighed so far (`demonet.loop.spanning.share`)."""


@dataclass
class Unchecked:
    """A settled round whose canonical digest may still be on its way: its metrics row waits for it."""

    result: RoundResult
    row: MetricsRow


class RoundLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Prefixes every line of `logger` with ``[peer round=N]``."""

    def __init__(self, peer_id: str, round_of: Callable[[], int], logger: logging.Logger | None = None) -> None:
        super().__init__(logger or logging.getLogger("demonet.loop.round_loop"), {})
        self.peer_id, self.round_of = peer_id, round_of

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"[{self.peer_id} round={self.round_of()}] {msg}", kwargs


def check_beats(beats: asyncio.Task[None] | None) -> None:
    """Raise here what the heartbeat task raised (a bug in it), if it ended."""
    if beats is not None and beats.done():
        beats.result()


class LoopSteps(Protocol):
    """What a pipeline drives: the peer's state and the loop's steps (`demonet.loop.round_loop.RoundLoop`)."""

    replica: Replica
    membership: Membership
    gatherer: Gatherer
    round: int
    digest: str
    lookahead: bool
    spanning: bool
    """The last round's result said this peer's micro-batch spans rounds (`RoundResult.spans`)."""
    span: SpanJob | None
    """The micro-batch running across rounds, if one is (`demonet.loop.spanning`)."""
    last_loss: float
    """The loss of the last round that trained (a spanning round whose micro-batch has not ended reports it)."""
    timing: PeerPace

    unchecked: Unchecked | None
    """A plain round whose canonical digest had not come by its settle: checked before the next compress."""
    encoder: EncodesAhead | None
    log: RoundLog

    def cutoff(self) -> float | None: ...
    async def load_parameters(self, params: Parameters) -> None: ...
    def go(self, next_round: int) -> bool: ...
    def compress(self, replica: Replica, undoable: bool
                 ) -> tuple[Payload, tuple[Payload, torch.cuda.Event | None]]: ...
    def submit(self, payload: Payload, staged: tuple[Payload, torch.cuda.Event | None], loss: float, *,
               started: float, compute_s: float, ahead: bool = False, samples: int = 1, micro_batches: int = 1,
               train_s: float = 0.0) -> InFlight: ...
    async def land(self, flight: InFlight, metrics: TextIO | None, *, defer: bool = False) -> RoundOutcome: ...
    async def drop(self, flight: InFlight) -> None: ...
    async def check(self, unchecked: Unchecked, metrics: TextIO | None, *, deferred: bool = True
                    ) -> RoundOutcome: ...
