"""What the dashboard shows of a run, kept bounded: recent rounds, members' counters, recent refusals.

Pure bookkeeping: no I/O, no asyncio. The owner (the coordinator's `Metrics`, a DHT peer's gatherer)
calls it on events it already handles; `document` builds the `/status.json` document on request,
so nothing is serialized on a round's path.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_LISTED", "SCHEMA", "MemberStats", "RunRecord"]

SCHEMA = 1
"""The version of the `/status.json` document (docs/dashboard.md); bumped when a field changes meaning."""

MAX_LISTED = 200
"""Members the document lists at most (contributors first, then the most recently heard from); the others are
counted by state in its `members_omitted`, so a run joined by thousands of ids still gives a small document."""


def finite(x: float | None) -> float | None:
    """`x`, or None when it is None, NaN or infinite (JSON has no NaN)."""
    return None if x is None or not math.isfinite(x) else float(x)


@dataclass
class MemberStats:
    """One peer's counters, as its coordinator (or a DHT peer) saw them. None: nothing measured yet."""

    contributed: int = 0
    """Rounds whose aggregate holds its payload."""
    missed: int = 0
    """Rounds it was a member of whose aggregate does not hold its payload."""
    resyncs: int = 0
    last_loss: float | None = None
    bytes_up: int | None = None
    """Bytes received from it (its payloads)."""
    bytes_down: int | None = None
    """Bytes sent to it (aggregates, parameters)."""
    link_bps: float | None = None
    """Bytes per second of its last upload: the payload's bytes over its stream's duration."""
    slices: int | None = None
    """DHT mode: slices of the last round it owned."""
    samples: int | None = None
    """The samples its last payload was computed from."""
    topk: int | None = None
    """The coefficients per chunk its last payload sent."""
    upload_s: float | None = None
    """Seconds its last upload took (its Submit stream)."""
    need_s: float | None = None
    """The seconds it reported needing for a round of its own micro-batches, exchange included."""
    micro_batches: int | None = None
    """The micro-batches its last payload was computed from, as it said (None: not said)."""
    compute_s: float | None = None
    """Their forward and backward seconds, as it said."""
    weight: float | None = None
    """Its share of the last merged round it was in (its samples, capped, over all of that round's)."""
    seen_at: float = 0.0
    """time.monotonic() of the last event from it."""


class RunRecord:
    """Ring buffers of the recent rounds and refusals, and the counters of `max_members` peers.

    Args:
        max_rounds: rounds kept for the curves.
        max_refusals: refusals kept.
        max_members: peers kept; the one heard from least recently that never contributed goes first.
    """

    def __init__(self, *, max_rounds: int = 512, max_refusals: int = 50, max_members: int = 256) -> None:
        self.rounds: deque[dict[str, Any]] = deque(maxlen=max_rounds)
        self.refusals: deque[dict[str, Any]] = deque(maxlen=max_refusals)
        self.members: OrderedDict[str, MemberStats] = OrderedDict()
        self.max_members = max_members
        self.started_at = time.time()

    def member(self, peer_id: str) -> MemberStats:
        """The counters of `peer_id` (created if new), marked as just heard from."""
        stats = self.members.get(peer_id)
        if stats is None:
            if len(self.members) >= self.max_members:
                self._forget_one()
            stats = self.members[peer_id] = MemberStats()
        else:
            self.members.move_to_end(peer_id)
        stats.seen_at = time.monotonic()
        return stats

    def _forget_one(self) -> None:
        """Make room: forget the peer heard from least recently that never contributed (ids that join and send
        nothing cannot push out the counters of the peers that train), or else the one heard from least recently."""
        for p, stats in self.members.items():  # least recently heard from first
            if stats.contributed == 0:
                del self.members[p]
                return
        self.members.popitem(last=False)

    # -- events ------------------------------------------------------------------------------------------

    def count(self, name: str, peer_id: str, amount: int = 1) -> None:
        """Add to one of a member's counters: "bytes_up", "bytes_down" or "resyncs" (others are ignored)."""
        if not peer_id or name not in ("bytes_up", "bytes_down", "resyncs"):
            return
        stats = self.member(peer_id)
        setattr(stats, name, (getattr(stats, name) or 0) + amount)

    def uploaded(self, peer_id: str, num_bytes: int, seconds: float, loss: float | None, *, samples: int | None = None,
                 topk: int | None = None, need_s: float | None = None, micro_batches: int = 0,
                 compute_s: float = 0.0) -> None:
        """A payload of `num_bytes` whose stream took `seconds`, with the loss its sender reported, the samples it
        was computed from, its coefficients per chunk and its sender's reported round time (0: not measured)."""
        self.count("bytes_up", peer_id, num_bytes)
        stats = self.member(peer_id)
        stats.last_loss = finite(loss)
        if seconds > 0:
            stats.link_bps, stats.upload_s = num_bytes / seconds, seconds
        stats.samples, stats.topk = samples, topk
        stats.need_s = finite(need_s) if need_s else None
        stats.micro_batches, stats.compute_s = micro_batches or None, finite(compute_s) if compute_s else None

    def weighted(self, contributors: Iterable[str], weights: Iterable[float]) -> None:
        """A merged round's weights (its contributors' samples, capped; none given: all alike): each one's share."""
        peers, given = list(contributors), list(weights)
        shares = given if given else [1.0] * len(peers)
        total = sum(shares)
        for p, w in zip(peers, shares, strict=True):
            self.member(p).weight = w / total if total > 0 else None

    def refused(self, peer_id: str, round: int | None, kind: str, reason: str) -> None:
        """A call or payload refused: `kind` is a short word (stale, invalid, resync, unauthorized, ...)."""
        self.refusals.append({"time": time.time(), "peer": peer_id, "round": round, "kind": kind,
                              "reason": reason[:300]})

    def round_closed(self, round: int, *, members: Iterable[str], contributors: Iterable[str], aborted: bool,
                     loss: float | None, round_s: float | None, close_s: float | None, bytes_up: int,
                     bytes_down: int) -> None:
        """A round ended: count who contributed and who missed it, and keep its row for the curves.

        Args:
            members: the round's members (contributors included).
            round_s: the round's wall time, open to aggregate.
            close_s: the time to build the aggregate (coordinator: the merge, until the publish; DHT: the exchange).
            bytes_up, bytes_down: bytes received and sent during the round.
        """
        contributed = set(contributors)
        every = set(members) | contributed
        for p in [*contributed, *(every - contributed)]:  # the contributors' counters first: kept before the rest's
            stats = self.members.get(p) or self.member(p)
            if p in contributed and not aborted:
                stats.contributed += 1
            else:
                stats.missed += 1
        self.rounds.append({"round": round, "time": time.time(), "aborted": aborted, "loss": finite(loss),
                            "round_s": None if round_s is None else finite(max(0.0, round_s)),
                            "close_s": finite(close_s), "members": len(every), "contributors": len(contributed),
                            "bytes_up": bytes_up, "bytes_down": bytes_down})

    # -- the document --------------------------------------------------------------------------------------

    def document(self, mode: str, source: str, run: Mapping[str, Any], live: Mapping[str, tuple[str, float]], *,
                 since: int | None = None, keys: Mapping[str, str] | None = None,
                 max_listed: int = MAX_LISTED) -> dict[str, Any]:
        """The `/status.json` document (docs/dashboard.md).

        Args:
            mode: "coordinator" or "dht".
            source: who describes the run (the coordinator, or the DHT peer's id).
            run: the run's section, as the owner sees it now.
            live: peer -> (state, seconds since last heard) for the peers in the run now; the other
                peers this record knows are listed as "left".
            since: only the rounds after this one (a page that already holds the older ones).
            keys: peer -> the fingerprint of the key it joined with (coordinator mode).
            max_listed: members listed at most; the others are counted by state in `members_omitted`.
        """
        now = time.monotonic()
        rows = [dict(r) for r in self.rounds if since is None or r["round"] > since]
        known = {p: ("left", now - s.seen_at) for p, s in self.members.items() if p not in live}
        known.update(live)  # every peer this record or the owner knows -> (state, seconds since heard from)
        listed = _most_relevant(known, self.members, max_listed)
        omitted: dict[str, int] = {}
        for p, (state, _) in known.items():
            if p not in listed:
                omitted[state] = omitted.get(state, 0) + 1
        order = sorted(p for p in live if p in listed) + [p for p in reversed(self.members)
                                                          if p in listed and p not in live]
        members = [_row(p, *known[p], self.members.get(p) or MemberStats(seen_at=now), (keys or {}).get(p))
                   for p in order]
        return {"schema": SCHEMA, "mode": mode, "source": source, "time": time.time(),
                "uptime_s": time.time() - self.started_at, "run": dict(run), "rounds": rows, "members": members,
                "members_omitted": dict(sorted(omitted.items())), "refusals": list(self.refusals)}


def _row(peer_id: str, state: str, ago: float, stats: MemberStats, key: str | None) -> dict[str, Any]:
    """One member's row of the document."""
    return {"id": peer_id, "key": key, "state": state, "last_seen_s": max(0.0, ago), "contributed": stats.contributed,
            "missed": stats.missed, "resyncs": stats.resyncs, "last_loss": stats.last_loss,
            "bytes_up": stats.bytes_up, "bytes_down": stats.bytes_down, "link_bps": stats.link_bps,
            "slices": stats.slices, "samples": stats.samples, "weight": stats.weight,
            "topk": stats.topk, "upload_s": stats.upload_s, "need_s": stats.need_s,
            "micro_batches": stats.micro_batches, "compute_s": stats.compute_s}


def _most_relevant(known: Mapping[str, tuple[str, float]], stats: Mapping[str, MemberStats], count: int) -> set[str]:
    """The `count` peers of `known` (peer -> (state, seconds since heard from)) a reader most wants to see: those
    whose payloads made an aggregate first, then the most recently heard from (ties by id)."""
    if len(known) <= count:
        return set(known)

    def rank(p: str) -> tuple[bool, float, str]:
        s = stats.get(p)
        return (s is None or s.contributed == 0, known[p][1], p)

    return set(heapq.nsmallest(count, known, key=rank))
