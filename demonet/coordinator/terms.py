"""The terms the round core and its adapters speak in: the core's options, a submission handed to it, and an
aggregate that cannot be had.

Imports the math layer's `Payload` only; the core (`demonet.coordinator.core`) and both adapters import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from demonet.optim import Payload

__all__ = ["KEEP_AGGREGATE_BYTES", "KEEP_AGGREGATES", "LATE_ROUNDS", "MIN_KEPT_AGGREGATES", "CoreOptions",
           "Submission"]

LATE_ROUNDS = 8
"""A payload computed from the parameters of a round at most this many rounds before the open one counts in the
open round (its sender then applies the aggregates of the rounds between): a peer whose micro-batch spans rounds,
or a newcomer whose first payload missed its round, is not lost (bounded staleness)."""

KEEP_AGGREGATES = 64
"""Closed rounds whose aggregate a late peer can still download: it catches up by them, not by the parameters
(a peer that spans rounds, a newcomer whose first download outlasted many short rounds)..."""
KEEP_AGGREGATE_BYTES = 256 << 20
"""...as long as they hold at most this many bytes in all (the oldest go first)..."""
MIN_KEPT_AGGREGATES = 8
"""...and at least this many, whatever their size."""


@dataclass(frozen=True, kw_only=True)
class CoreOptions:
    """What the core needs besides the run (the adapters' own options stay with them)."""

    total_rounds: int = 0
    """The run ends after this many rounds (0: no end)."""
    state_dir: Path | None = None
    """Where the state is persisted in the background once each round is published; None: in memory only."""
    state_every_s: float = 0.0
    """The least time between the starts of two state writes (0: after every round the writer is free for)."""


@dataclass(frozen=True, kw_only=True)
class Submission:
    """One member's payload for a round, read and decoded by an adapter, to be counted by `RoundCore.submit`."""

    peer_id: str
    round: int
    payload: Payload
    payload_digest: bytes
    """The digest of the payload's bytes: a retry of the same payload is a duplicate, another one a conflict."""
    param_digest: str
    """The parameters the peer computed it from, checked against the canonical ones."""
    loss: float
    size: int
    """Bytes of the serialized payload."""
    stream_s: float = 0.0
    """How long its bytes took to arrive (the sender's link speed, for the dashboard)."""
    samples: int = 1
    """How many samples it was computed from: its weight in the merge (capped there)."""
    need_s: float = 0.0
    """The seconds the peer needs for a round of its own micro-batches, exchange included (0: not measured;
    the automatic round length, `demonet.wire.pace`)."""
    least_s: float = 0.0
    """The same for a round of one micro-batch."""
    train_s: float = 0.0
    """One micro-batch's forward and backward alone (0: not measured)."""
    micro_batches: int = 0
    """Its micro-batches, and their seconds (`compute_s`), for the dashboard (0: not said)."""
    compute_s: float = 0.0
    late: int = 0
    """How many rounds before the open one its round may be: it then counts in the open round (`LATE_ROUNDS`
    for a payload whose digest came with it; 0 for one sent ahead)."""
