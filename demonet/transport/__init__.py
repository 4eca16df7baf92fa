"""Transports: how a peer's payload for a round becomes the round's aggregate.

A transport is a `Gatherer`. Imports the math layer's dataclasses and demonet.errors only; the
implementations (`demonet.transport.grpc`, ...) are imported by name, never from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from demonet.errors import DemonetError
from demonet.optim import Payload

__all__ = ["Gatherer", "NotMember", "Rejected", "Resync", "RoundResult", "StaleRound"]


@dataclass(frozen=True)
class RoundResult:
    """How one round ended, as this peer saw it."""

    round: int
    aggregate: Payload | None
    """What every member applies; None when the round was aborted."""
    contributors: tuple[str, ...]
    """Peers whose payloads are in the aggregate."""
    param_digest: str
    """The canonical parameter digest after applying the aggregate ("" in DHT mode: checked at the next round)."""
    aborted: bool
    bytes_up: int
    """Bytes of this peer's serialized payload."""
    bytes_down: int
    """Bytes of the serialized aggregate (0 when aborted)."""
    kept: Payload | None = None
    """What of this peer's payload the aggregate holds, when that is not simply the aggregate (DHT mode:
    a slice merged without this payload); None: the aggregate."""


class Gatherer(Protocol):
    """Takes this peer's payload for a round and returns the round's aggregate."""

    async def gather(self, round: int, payload: Payload, *, loss: float, param_digest: str) -> RoundResult:
        """Send `payload` for `round` and wait for the round to close.

        Args:
            round: the round the payload belongs to.
            payload: what `DeMo.compress()` returned for this round.
            loss: this peer's training loss on its batch for the round.
            param_digest: this peer's parameter digest at the start of the round.

        Raises:
            Rejected: the payload was not taken (see its subclasses for what to do).
            PeerUnavailable: the other side could not be reached in time.
            InvalidPayload: the aggregate failed validation.
        """
        ...

    async def close(self) -> None:
        """Release connections; the gatherer is of no further use."""
        ...


class Rejected(DemonetError):
    """The payload was not taken into the round; the peer restores it and gets back in step."""


class Resync(Rejected):
    """This peer's parameters differ from the canonical ones: download them again, recompute the round."""


class NotMember(Rejected):
    """This peer is not a member of the round (dropped, or the coordinator forgot it): join again."""


class StaleRound(Rejected):
    """The round is over for this peer: continue from the coordinator's open round."""

    def __init__(self, message: str, *, open_round: int) -> None:
        super().__init__(message)
        self.open_round = open_round
