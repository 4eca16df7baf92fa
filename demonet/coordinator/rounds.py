"""Clock-synchronous rounds: membership, joiners, deadlines, quorum. Pure logic.

Imports nothing networked and no asyncio: the caller passes the time (`now`, seconds) into every
call, so tests drive it with a fake clock. The coordinator wraps one `Rounds` in its gRPC servicer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from demonet.errors import Refusal, SubmitRejected

__all__ = ["ClosedRound", "RoundConfig", "Rounds"]

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
    max_idle_rounds: int = 3
    """A member whose payload is missing from this many consecutive closed rounds is idle: rounds no
    longer wait for it (it stays a member, and is waited on again once it submits). 0: never idle."""

    def __post_init__(self) -> None:
        if self.start_peers < 1:
            raise ValueError("start_peers should be >= 1")
        if self.round_timeout_s <= 0:
            raise ValueError("round_timeout_s should be > 0")
        if self.min_peers < 1:
            raise ValueError("min_peers should be >= 1")
        if self.heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s should be > 0")
        if self.max_idle_rounds < 0:
            raise ValueError("max_idle_rounds should be >= 0 (0: off)")


@dataclass(frozen=True)
class ClosedRound:
    """How a round ended: its number, whose payloads are in the aggregate, or aborted."""

    round: int
    contributors: tuple[str, ...]
    aborted: bool


@dataclass
class Rounds:
    """The state machine. Round `round` is always open; `close` opens the next one.

    A member submits once per round. The round closes when every active member has submitted, or at
    its deadline: applied if at least `min_peers` payloads are in, aborted otherwise. Joiners become
    members when the next round opens; the very first peer of an idle run is admitted at once.

    Membership is by work (docs/coordinator.md#who-a-round-waits-for): a round waits only for the members
    that have done work. A member none of whose payloads was ever accepted (a newcomer, or a Sybil that
    heartbeats and never submits) is not waited on until its first payload is in; a round that opens with no
    member that has any (the run's first round, say) waits for all of them. A member missing from `max_idle_rounds`
    consecutive closed rounds (counted from its first round as a member) is idle. Its heartbeats still keep
    it a member, but rounds no longer wait for it; a payload of it accepted for the open round makes it
    active again. A member whose one micro-batch spans several rounds (`spanning`, which the coordinator's
    pace sets at each close) is not waited on either: its payload enters whichever round is open when it
    comes. Otherwise one peer that heartbeats and never submits, or one slow peer, would hold every round.
    """

    cfg: RoundConfig
    now: float
    round: int = 0
    members: dict[str, float] = field(default_factory=dict)  # peer -> last time heard from
    joiners: dict[str, float] = field(default_factory=dict)
    submitted: list[str] = field(default_factory=list)  # in arrival order
    opened_at: float = 0.0
    started: bool = False  # the first round has opened
    missed: dict[str, int] = field(default_factory=dict)  # member -> consecutive closed rounds without its payload
    idle: set[str] = field(default_factory=set)  # members the round does not wait for (see the class docstring)
    worked: set[str] = field(default_factory=set)  # peers with an accepted payload (kept when they leave: a peer that
    # rejoins is waited on again at once; an id with no work costs a payload to count)
    spanning: set[str] = field(default_factory=set)  # members slower than a round: not waited on, not counted idle
    incoming: set[str] = field(default_factory=set)  # members whose payload for the open round is on its way
    tried: set[str] = field(default_factory=set)  # members with no work whose stream ended without a payload in
    limit_s: float = 0.0
    """How long the open round waits for its members (`deadline`); 0: `round_timeout_s`. Rounds by the
    automatic clock wait about twice their length (`demonet.wire.pace.RoundPace.deadline_s`)."""

    def __post_init__(self) -> None:
        self.opened_at = self.now

    @property
    def deadline(self) -> float:
        return self.opened_at + (self.limit_s or self.cfg.round_timeout_s)

    def seconds_left(self, now: float) -> float:
        return max(0.0, self.deadline - now)

    @property
    def active(self) -> list[str]:
        """The members the open round waits for: those with accepted work (`worked`), not idle, not spanning; and
        any member whose payload for it is on its way (`incoming`: a newcomer's first, say), until it is in or
        its stream ends."""
        return [p for p in self.members if p in self.incoming
                or (p in self.worked and p not in self.idle and p not in self.spanning)]

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
                self.worked.update(self.members)  # the run's first members: its first round waits for them all
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
        self._forget(peer_id)  # as a joiner it counts again from its next round as a member

    def leave(self, peer_id: str) -> bool:
        """A member or admitted joiner that stops (a graceful stop): rounds stop waiting for it now, not after
        its heartbeat timeout (a payload of it already in still counts); it must join again to come back.
        Returns whether it was one."""
        member = self.members.pop(peer_id, None) is not None
        joiner = self.joiners.pop(peer_id, None) is not None
        self._forget(peer_id)
        return member or joiner

    def submit(self, peer_id: str, round: int, now: float, *, late: int = 0) -> None:
        """Count a member's payload for the open round (`late`: one computed for a round up to this many before it,
        which counts in the open round: see `check_submit`).

        Raises:
            SubmitRejected: not a member, a stale or future round, or a second payload.
        """
        self.check_submit(peer_id, round, late=late)
        self.members[peer_id] = now
        self.submitted.append(peer_id)
        self.worked.add(peer_id)
        if peer_id in self.idle:
            self.idle.discard(peer_id)
            logger.info("[coordinator round=%d] %s is active again: its payload is in, rounds wait for it", self.round,
                        peer_id)

    def check_submit(self, peer_id: str, round: int, *, early: bool = False, late: int = 0) -> None:
        """What `submit` would reject, without changing anything (to refuse before reading a payload).

        `early`: a stream whose parameter digest follows its payload, which a member of the open round may
        send for the next round once its payload for the open round is in (an overlapped peer sends them in
        that order); `submit` counts it once that round is open. A member whose payload for the open round
        is not in (a coordinator restarted from an older state lost it) is told FUTURE, as for any round
        that has not opened: it joins again and does the open round over. `late`: a payload of a closed round at
        most this many rounds before the open one counts in the open round (a peer whose micro-batch outlasted
        rounds, a newcomer that missed its first: bounded staleness, docs/coordinator.md#mixed-speed-peers).
        """
        if round < self.round - late:
            raise SubmitRejected(f"round {round} is closed; the open round is {self.round}", Refusal.STALE)
        if round < self.round:
            round = self.round  # counts in the open round
        if peer_id not in self.members:
            raise SubmitRejected(f"{peer_id} is not a member of round {self.round}", Refusal.NOT_MEMBER)
        if round > self.round + (early and peer_id in self.submitted):
            after = (f" (a payload for round {round} comes after {peer_id}'s payload for round {self.round}, "
                     "which is not in)" if early and round == self.round + 1 else "")
            raise SubmitRejected(f"round {round} has not opened; the open round is {self.round}{after}", Refusal.FUTURE)
        if round == self.round and peer_id in self.submitted:
            raise SubmitRejected(f"{peer_id} already submitted for round {round}", Refusal.DUPLICATE)

    def due(self, now: float) -> bool:
        """Whether the open round should close now (after dropping the peers that went silent)."""
        self._drop_silent(now)
        if not self.started:
            return False
        active = self.active  # a submission makes its sender active: none active means none submitted
        if active and all(p in self.submitted for p in active):
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
            logger.info("[coordinator round=%d] closed without %s", self.round, _names(late))
        self._count_missed([p for p in late if p not in self.spanning and p in self.worked])
        self.round += 1
        self.submitted = []
        self.incoming = set()
        self.members.update(self.joiners)
        self.joiners = {}
        self.opened_at = now
        self._found()
        return closed

    def _found(self) -> None:
        """As a round opens: where no member has accepted work (the run's first round, or every member that had
        left), the round waits for them all, as if they had."""
        if not any(p in self.worked for p in self.members):
            self.worked.update(self.members)

    def _count_missed(self, late: list[str]) -> None:
        """At a close: a member in the round counts one more missed round, or none if its payload is in."""
        for peer_id in self.submitted:
            self.missed.pop(peer_id, None)
        went_idle = []
        for peer_id in late:
            self.missed[peer_id] = self.missed.get(peer_id, 0) + 1
            limit = self.cfg.max_idle_rounds
            if limit and self.missed[peer_id] >= limit and peer_id not in self.idle:
                self.idle.add(peer_id)
                went_idle.append(peer_id)
        if went_idle:
            logger.info("[coordinator round=%d] idle (no payload in %d rounds; rounds no longer wait for them "
                        "until they submit): %s", self.round, self.cfg.max_idle_rounds, _names(went_idle))

    def arriving(self, peer_id: str, round: int) -> None:
        """A member's payload for `round` is on its way: the open round waits for it until `arrived`. A member with
        no accepted work gets this once (an id that opens a stream and never completes it holds one round, not
        every round)."""
        if round == self.round and peer_id in self.members and (peer_id in self.worked or peer_id not in self.tried):
            self.incoming.add(peer_id)

    def arrived(self, peer_id: str) -> bool:
        """A member's stream ended, its payload counted or not; returns whether the open round waited for it."""
        if peer_id not in self.incoming:
            return False
        self.incoming.discard(peer_id)
        if peer_id not in self.worked:
            self.tried.add(peer_id)
        return True

    def _forget(self, peer_id: str) -> None:
        self.missed.pop(peer_id, None)
        self.tried.discard(peer_id)
        self.idle.discard(peer_id)
        self.spanning.discard(peer_id)

    def _drop_silent(self, now: float) -> None:
        limit = now - self.cfg.heartbeat_timeout_s
        for table in (self.members, self.joiners):
            for peer_id in [p for p, seen in table.items() if seen < limit and p not in self.submitted]:
                del table[peer_id]
                self._forget(peer_id)
                logger.warning("[coordinator round=%d] dropped %s: silent for over %.1f s", self.round, peer_id,
                               self.cfg.heartbeat_timeout_s)

    def state_dict(self) -> dict[str, Any]:
        """What survives a restart: the open round, the members (their clocks restart) and their missed
        rounds, from which the idle ones follow (a resumed round does not wait for them either)."""
        return {"round": self.round, "members": sorted(self.members), "joiners": sorted(self.joiners),
                "missed": {p: n for p, n in sorted(self.missed.items()) if p in self.members},
                "worked": sorted(self.worked)}

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
        # A state saved before idle members existed has no "missed": every member starts active. A member
        # is idle when its missed rounds reach the limit (no payload of it is in: the round just opened).
        rounds.missed = {p: int(n) for p, n in state.get("missed", {}).items() if p in rounds.members}
        limit = cfg.max_idle_rounds
        rounds.idle = {p for p, n in rounds.missed.items() if limit and n >= limit}
        # A state saved before members without work existed: every member had done work.
        rounds.worked = set(state.get("worked", [*rounds.members, *rounds.joiners]))
        return rounds


def _names(peers: list[str], most: int = 10) -> str:
    """Peer ids for a log line: the first `most`, then how many more."""
    more = f" and {len(peers) - most} more" if len(peers) > most else ""
    return ", ".join(peers[:most]) + more
