"""Clock-synchronous rounds: membership, joiners, deadlines, quorum. Pure logic.

Imports nothing networked and no asyncio: the caller passes the time (`now`, seconds) into every
call, so tests drive it with a fake clock. The coordinator wraps one `Rounds` in its gRPC servicer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ClosedRound", "RoundConfig", "Rounds", "SubmitRejected"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RoundConfig:
    """Timing and quorum of the rounds."""

    round_timeout_s: float = 30.0
    """A round closes at most this long after it opens, with whatever payloads are in by then."""
    min_peers: int = 1
    """Payloads needed to apply a round at its deadline; fewer aborts it (peers restore theirs)."""
    heartbeat_timeout_s: float = 15.0
    """A member or joiner not heard from for this long is dropped."""
    start_peers: int = 1
    """The first round opens once this many peers have joined (all of them are its members)."""

    def __post_init__(self) -> None:
        if self.start_peers < 1:
            raise ValueError("start_peers should be >= 1")
        if self.round_timeout_s <= 0:
            raise ValueError("round_timeout_s should be > 0")
        if self.min_peers < 1:
            raise ValueError("min_peers should be >= 1")
        if self.heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s should be > 0")


@dataclass(frozen=True)
class ClosedRound:
    """How a round ended: its number, whose payloads are in the aggregate, or aborted."""

    round: int
    contributors: tuple[str, ...]
    aborted: bool


class SubmitRejected(Exception):
    """A submission that does not belong to the open round (not an error of the coordinator).

    `kind` is one of "stale", "future", "not_member", "duplicate".
    """

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind

    @property
    def stale(self) -> bool:
        return self.kind == "stale"


@dataclass
class Rounds:
    """The state machine. Round `round` is always open; `close` opens the next one.

    A member submits once per round. The round closes when every member has submitted, or at its
    deadline: applied if at least `min_peers` payloads are in, aborted otherwise. Joiners become
    members when the next round opens; the very first peer of an idle run is admitted at once.
    """

    cfg: RoundConfig
    now: float
    round: int = 0
    members: dict[str, float] = field(default_factory=dict)  # peer -> last time heard from
    joiners: dict[str, float] = field(default_factory=dict)
    submitted: list[str] = field(default_factory=list)  # in arrival order
    opened_at: float = 0.0
    started: bool = False  # the first round has opened

    def __post_init__(self) -> None:
        self.opened_at = self.now

    @property
    def deadline(self) -> float:
        return self.opened_at + self.cfg.round_timeout_s

    def seconds_left(self, now: float) -> float:
        return max(0.0, self.deadline - now)

    def join(self, peer_id: str, now: float) -> int:
        """Add a peer; returns the first round it is a member of (a member rejoining: the open one)."""
        if peer_id in self.members:
            self.members[peer_id] = now
            return self.round
        if not self.started or (not self.members and not self.submitted):  # idle: this round waits for it
            self.members[peer_id] = now
            if len(self.members) >= (1 if self.started else self.cfg.start_peers):
                self.started = True
                self.opened_at = now
                logger.info("[coordinator round=%d] %s joined; the round opens now with %d members", self.round,
                            peer_id, len(self.members))
            return self.round
        self.joiners[peer_id] = now
        return self.round + 1

    def heartbeat(self, peer_id: str, now: float) -> bool:
        """Record that a peer is alive; False if it is neither a member nor a joiner (it must rejoin)."""
        for table in (self.members, self.joiners):
            if peer_id in table:
                table[peer_id] = now
                return True
        return False

    def withdraw(self, peer_id: str, now: float, *, drop: bool = False) -> None:
        """A member that will not submit to the open round: the round stops waiting for it, and it is a
        member again from the next round (with `drop`: not at all; it must join again)."""
        if self.members.pop(peer_id, None) is not None and not drop:
            self.joiners[peer_id] = now

    def submit(self, peer_id: str, round: int, now: float) -> None:
        """Count a member's payload for the open round.

        Raises:
            SubmitRejected: not a member, a stale or future round, or a second payload.
        """
        self.check_submit(peer_id, round)
        self.members[peer_id] = now
        self.submitted.append(peer_id)

    def check_submit(self, peer_id: str, round: int) -> None:
        """What `submit` would reject, without changing anything (to refuse before reading a payload)."""
        if round < self.round:
            raise SubmitRejected(f"round {round} is closed; the open round is {self.round}", "stale")
        if peer_id not in self.members:
            raise SubmitRejected(f"{peer_id} is not a member of round {self.round}", "not_member")
        if round > self.round:
            raise SubmitRejected(f"round {round} has not opened; the open round is {self.round}", "future")
        if peer_id in self.submitted:
            raise SubmitRejected(f"{peer_id} already submitted for round {round}", "duplicate")

    def due(self, now: float) -> bool:
        """Whether the open round should close now (after dropping the peers that went silent)."""
        self._drop_silent(now)
        if not self.started:
            return False
        if self.members and all(p in self.submitted for p in self.members):
            return True
        if now < self.deadline:
            return False
        if not self.members and not self.submitted:
            self.opened_at = now  # idle: nobody to wait for, keep the round open
            return False
        return True

    def outcome(self) -> ClosedRound:
        """How the open round ends if it closes now: applied with a quorum, aborted without. The one
        place that decides it (the coordinator merges by it, then calls `close`)."""
        return ClosedRound(self.round, tuple(sorted(self.submitted)), len(self.submitted) < self.cfg.min_peers)

    def close(self, now: float) -> ClosedRound:
        """End the open round (its `outcome`) and open the next one."""
        closed = self.outcome()
        late = sorted(set(self.members) - set(self.submitted))
        if late:
            logger.info("[coordinator round=%d] closed without %s", self.round, ", ".join(late))
        self.round += 1
        self.submitted = []
        self.members.update(self.joiners)
        self.joiners = {}
        self.opened_at = now
        return closed

    def _drop_silent(self, now: float) -> None:
        limit = now - self.cfg.heartbeat_timeout_s
        for table in (self.members, self.joiners):
            for peer_id in [p for p, seen in table.items() if seen < limit and p not in self.submitted]:
                del table[peer_id]
                logger.warning("[coordinator round=%d] dropped %s: silent for over %.1f s", self.round, peer_id,
                               self.cfg.heartbeat_timeout_s)

    def state_dict(self) -> dict[str, Any]:
        """What survives a restart: the open round and the members (their clocks restart)."""
        return {"round": self.round, "members": sorted(self.members), "joiners": sorted(self.joiners)}

    @classmethod
    def from_state(cls, cfg: RoundConfig, state: dict[str, Any], now: float) -> Rounds:
        """Resume: the open round restarts, and its members get max(round, heartbeat) timeout to come back.

        A restart is when peers are reconnecting with backoff; a short round timeout alone could
        close the resumed round before they resubmit the payloads the restart lost.
        """
        rounds = cls(cfg=cfg, now=now, round=int(state["round"]), started=True)
        rounds.opened_at = now + max(0.0, cfg.heartbeat_timeout_s - cfg.round_timeout_s)  # deadline: now + grace
        rounds.members = dict.fromkeys(state["members"], now)
        rounds.joiners = dict.fromkeys(state.get("joiners", ()), now)
        return rounds
