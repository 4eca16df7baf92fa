"""The open round's inbox: the payloads members submitted, each counted or refused by one rule, and the refusals
and resyncs counted for the operator.

Owned by the round core (`demonet.coordinator.core`), which holds the lock, waits for the round and closes it;
imports the pure rounds, the metrics and the errors only (no asyncio, no network).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from demonet.errors import Refusal, SubmitRejected
from demonet.optim import Payload

from .metrics import Metrics
from .rounds import Rounds
from .terms import Submission

__all__ = ["Inbox"]

logger = logging.getLogger(__name__)


class Inbox:
    """What the open round has received.

    Args:
        rounds_of: the core's round state machine (it may be replaced by a resume before the first round).
        metrics: where refusals and uploads are counted.
    """

    def __init__(self, rounds_of: Callable[[], Rounds], metrics: Metrics) -> None:
        self.rounds_of, self.metrics = rounds_of, metrics
        self.payloads: dict[str, Payload] = {}
        self.losses: dict[str, float] = {}
        self.samples: dict[str, int] = {}
        self.accepted_digests: dict[str, bytes] = {}
        """Peer -> the digest of its payload in the open round (a retry of it is a duplicate, another one is not)."""
        self.resynced_at: dict[str, int] = {}
        """Peer -> the round of its last resync, so that a retried call is not counted twice."""
        self.late_in: set[str] = set()
        """Peers whose payload in the open round was computed for an earlier one (`late`)."""
        self.counted: dict[str, int] = {}
        """Peer -> the round its last accepted payload counted in: a payload of a closed round counts in the open one
        (`late`) only if none of its sender's counted in that round or after (a retry of one that did is stale)."""

    def check(self, peer_id: str, round: int, payload_digest: bytes, *, early: bool = False, late: int = 0) -> None:
        """What `accept` would refuse by the rounds alone, before the payload is read.

        Raises:
            SubmitRejected: counted (`refuse`).
        """
        try:
            self.rounds_of().check_submit(peer_id, round, early=early, late=self._late(peer_id, round, late))
        except SubmitRejected as e:
            raise self.refuse(e, peer_id, round, payload_digest) from None

    def accept(self, s: Submission) -> None:
        """Count a member's payload for the open round (the caller checked its digest, holding the lock).

        Raises:
            SubmitRejected: what the rounds refuse (counted).
        """
        rounds = self.rounds_of()
        try:
            rounds.submit(s.peer_id, s.round, time.monotonic(), late=self._late(s.peer_id, s.round, s.late))
        except SubmitRejected as e:
            raise self.refuse(e, s.peer_id, s.round, s.payload_digest) from None
        self.counted[s.peer_id] = rounds.round
        if s.round < rounds.round:
            self.late_in.add(s.peer_id)
        self.payloads[s.peer_id] = s.payload
        self.accepted_digests[s.peer_id] = s.payload_digest
        self.losses[s.peer_id] = s.loss
        self.samples[s.peer_id] = s.samples
        self.metrics.uploaded(s.peer_id, s.size, s.stream_s, s.loss, samples=s.samples, topk=s.payload.topk(),
                              need_s=s.need_s, micro_batches=s.micro_batches, compute_s=s.compute_s)

    def _late(self, peer_id: str, round: int, late: int) -> int:
        return late if self.counted.get(peer_id, -1) < round else 0

    def contributions(self, contributors: tuple[str, ...]) -> tuple[list[Payload], list[int], list[float]]:
        """The contributors' payloads, their samples and the losses reported with them, in their order."""
        payloads = [self.payloads[p] for p in contributors]
        samples = [self.samples.get(p, 1) for p in contributors]
        losses = [self.losses[p] for p in contributors if p in self.losses]
        return payloads, samples, losses

    def clear(self) -> None:
        """The next round opened: empty. Only together with `Rounds.close` (its list of who submitted): while the
        round is merged, a stream's first part is still checked against both (a retry of a payload that is in
        is a duplicate, not a conflict)."""
        self.payloads, self.losses, self.samples, self.accepted_digests = {}, {}, {}, {}
        self.late_in = set()

    def invalid(self, peer_id: str, round: int | None, reason: str) -> SubmitRejected:
        """Count and log a payload that failed validation; the refusal to answer with."""
        self.metrics.add("rejected")
        self.metrics.refused(peer_id, round, "invalid", reason)
        logger.warning("[coordinator round=%d] rejected a payload from %s: %s", self.rounds_of().round,
                       peer_id or "?", reason)
        return SubmitRejected(f"invalid payload: {reason}", Refusal.INVALID)

    def refuse(self, e: SubmitRejected, peer_id: str, round: int, payload_digest: bytes) -> SubmitRejected:
        """Count a refusal by the rounds; a duplicate of another payload than the one in is a conflict."""
        other = e.kind == Refusal.DUPLICATE and self.accepted_digests.get(peer_id) != payload_digest
        if other and peer_id in self.late_in:  # its payload of an earlier round counts in this one: this one is late
            e = SubmitRejected(f"{peer_id}'s payload of an earlier round counts in round {round}", Refusal.STALE)
        elif other:
            reason = f"another payload from {peer_id} for round {round} is already in"
            self.metrics.refused(peer_id, round, "conflict", reason)
            return SubmitRejected(reason, Refusal.CONFLICT)
        if e.kind == Refusal.STALE:
            self.metrics.add("late")
        self.metrics.refused(peer_id, round, e.kind.value, e.reason)
        return e

    def resynced(self, peer_id: str, round: int, why: str) -> None:
        """Count and log one resync: a member whose parameters differ from the canonical ones downloads
        them whole, the dense transfer the compressed rounds exist to avoid. A peer finds the difference
        after applying an aggregate (its download says so) or is told at its next submission; either
        way the download happens once and is counted once."""
        if self.resynced_at.get(peer_id) == round:
            return  # the same call again (the client retries a call that timed out or lost its connection)
        self.resynced_at[peer_id] = round
        self.metrics.add("resyncs", peer=peer_id)
        logger.warning("[coordinator round=%d] %s resyncs at round %d (resync %d of the run): %s; it downloads "
                       "the whole parameters", self.rounds_of().round, peer_id, round, self.metrics.totals["resyncs"],
                       why)
