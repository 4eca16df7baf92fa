"""The pure rules of a round's freeze in DHT mode: who is in a round, and over which base its majority counts.

Imports the announcements and the majority rule of demonet.dht.rules; must not import asyncio, grpc,
hivemind or any other demonet.dht module. The round board (demonet.dht.board) calls these.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from .rules import Announcement, has_majority

__all__ = ["Frozen", "Staying", "freeze", "late_majority", "majority_base", "staying"]


@dataclass(frozen=True)
class Frozen:
    """A round's frozen membership."""

    deadline: float
    """DHT time of the freeze: announcements at or before it are members."""
    members: tuple[str, ...]
    """Sorted peer ids."""
    complete: bool
    """Every expected peer announced before the timeout (False: some were dropped at the deadline)."""
    settled: bool
    """Final as soon as seen (every expected peer is in); otherwise final once read after deadline + latency."""
    majority: bool = True
    """Its members are more than half of the majority's base (`has_majority`): only then may the round
    be applied. False: this peer is on a minority side (a partition) and waits."""


@dataclass(frozen=True)
class Staying:
    """A round's expected peers and the base of its majority, less the peers that left (`staying`)."""

    expected: frozenset[str] | None
    previous: frozenset[str] | None


def staying(expected: Iterable[str] | None, previous: Iterable[str] | None, announced: Collection[str],
            left: Collection[str]) -> Staying:
    """`expected` and `previous` (the base before `majority_base`) of a round, less the peers in `left` (they
    said they leave the run before this round or one before it) that did not announce the round.

    A peer that leaves says so itself, in a record only it can store, before the round it does not
    announce: no partition can make it up. So it leaves the base at once, where a silent member leaves
    only after `leave_after_s`: the last member of a run whose other members all left goes on alone. A
    peer that read the record and one that did not yet freeze the same members (it announced nothing);
    their bases may differ by it until the record arrives. None stays None (the first round; no base).
    """
    gone = set(left) - set(announced)
    return Staying(None if expected is None else frozenset(expected) - gone,
                   None if previous is None else frozenset(previous) - gone)


def majority_base(previous: Iterable[str], last_seen: Mapping[str, float], *, now: float,
                  leave_after_s: float) -> frozenset[str]:
    """The peers a round's majority is counted over: the previous round's members, less those not heard
    from for `leave_after_s` (DHT time).

    Joiners admitted to a round are not in its base: they count from the round after (they are then
    its previous round's members). Dropping the silent ones lets a run that really lost most of its
    peers go on; it also lets a minority that waits longer than `leave_after_s` go on alone.

    Args:
        previous: the members of the previous round.
        last_seen: peer -> the DHT time of its latest announcement this peer read (absent: never).
        now: the DHT time now.
        leave_after_s: how long a silent member stays in the base.
    """
    return frozenset(p for p in previous if now - last_seen.get(p, -math.inf) <= leave_after_s)


def late_majority(announced: Mapping[str, Announcement], base: Collection[str],
                  following: Collection[str] = ()) -> tuple[str, ...] | None:
    """The members of a round that had no majority at its deadline, late announcements counted, if they
    now hold a majority of `base` (None otherwise).

    Peers that are all alive but announced more than a window apart (a heal, a slow store) would
    otherwise wait on each other for ever. The round is too late for its exchange: the caller aborts it
    and the next round goes on with these members.

    `following`: peers registered to join the round after (`RoundBoard.joiners`). A member of the base
    among them counts as here: it gave up its own rounds and loads the parameters from whoever admits
    it. After a split healed, a side waiting a round behind the other (which applied the round the
    split cut into and then waited too) sees the other's head past its own and registers; the side
    ahead then holds a majority and admits it. The members returned are the announced ones only.
    """
    members = tuple(sorted(announced))
    return members if has_majority(set(members).union(following), base) else None


def freeze(announced: Mapping[str, Announcement], *, expected: Iterable[str] | None, start_peers: int,
           window_s: float, base: Collection[str] | None = None) -> Frozen | None:
    """The membership of a round from its announcements; the same on every peer that sees the same records.

    With `expected` (the previous round's members plus the joiners admitted for this round), the
    round is complete once all of them announced: its members are exactly them, decided as soon as
    a peer sees their records. Without (the first round), it is complete once `start_peers` peers
    announced, however long that takes (deadline inf until then). Otherwise it freezes `window_s`
    after the first announcement with whoever announced by then. Every answer but an
    expected-complete one is final only when read once the DHT time is past `deadline` plus the
    store latency the caller allows (records stored before the deadline are visible by then):
    `Frozen.settled` says which.

    With `base` (`majority_base`), `Frozen.majority` says whether the members hold more than half of
    it. A complete round without a majority is not decided early: it freezes at the deadline with
    whoever announced by then (peers that announced without being expected count too).

    Returns:
        None when nobody has announced yet.
    """
    if not announced:
        return None
    times = sorted(a.t for a in announced.values())
    timeout_at = times[0] + window_s
    if expected is not None:
        want = set(expected)
        if want and want <= set(announced) and has_majority(want, base):
            complete_at = max(announced[p].t for p in want)
            if complete_at <= timeout_at:
                return Frozen(deadline=complete_at, members=tuple(sorted(want)), complete=True, settled=True)
    elif len(times) >= start_peers:
        complete_at = times[start_peers - 1]
        members = tuple(sorted(p for p, a in announced.items() if a.t <= complete_at))
        return Frozen(deadline=complete_at, members=members, complete=True, settled=False)
    else:  # the first round waits for its start_peers (the caller bounds the wait)
        return Frozen(deadline=math.inf, members=(), complete=False, settled=False)
    members = tuple(sorted(p for p, a in announced.items() if a.t <= timeout_at))
    return Frozen(deadline=timeout_at, members=members, complete=False, settled=False,
                  majority=has_majority(members, base))
