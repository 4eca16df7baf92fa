"""The round board of DHT mode: who is in each round, read from and written to the DHT's records.

Net layer over demonet.dht.node: announcements and the freeze of a round's membership, with the
joining side (the run's head round, joiners' registrations and admission, each peer's published
state) in demonet.dht.joining. The rules themselves are demonet.dht.rules and freeze_rules. Must not
import grpc, demonet.transport.grpc, or the exchange of payloads (demonet.dht.exchange).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeGuard

from demonet.errors import PeerUnavailable
from demonet.transport import NotMember, Pace

from . import rules
from .deadlines import now
from .freeze_rules import Frozen, freeze, late_majority, majority_base, staying
from .joining import _POLL_S, Joining
from .node import DhtNode

__all__ = ["FrozeWithout", "RoundBoard"]

logger = logging.getLogger(__name__)

_SEARCH_EVERY_S = 1.0  # and how often it searches the DHT all the same (a record stored before this node met its peer)
_WAIT_POLL_S = 1.0  # how often a peer without a majority looks again for the others
_RECONNECT_EVERY = 3  # and every this many looks, it pings the base's members from its DHT node
_START_TIMEOUT_S = 600.0  # how long the first round waits for its start_peers
_KEEP_ROUNDS = 8  # rounds whose own announcements and read registrations are kept


class FrozeWithout(NotMember):
    """The round froze without this peer (it announced too late); `members`: who is in it, as read here."""

    def __init__(self, message: str, members: tuple[str, ...]) -> None:
        super().__init__(message)
        self.members = members


@dataclass
class _Waiting:
    """What a peer without a majority waits with in one freeze (`RoundBoard._freeze`)."""

    minority: tuple[tuple[str, ...], frozenset[str]] | None = None
    """(the members it froze with, the base), logged once and again on change; None: not waiting."""
    looks: int = 0


class RoundBoard(Joining):
    """This peer's view of the run's rounds on the DHT.

    Timeouts (DHT time, the same clock on every peer): ``window_s``, from a round's first announcement
    to its freeze at the latest; ``settle_s``, the store latency a freeze at its deadline allows for.
    """

    def __init__(self, node: DhtNode) -> None:
        self._node = node
        self.expected: dict[int, set[str] | None] = {}
        """Round -> the peers its freeze waits for (None: the first round, `start_peers`)."""
        self.previous: dict[int, set[str]] = {}
        """Round -> the members of the round before (its joiners not included), or the base of the round
        before as well when too few of them contributed (`rules.next_base`): the base of its majority."""
        self.bases: dict[int, frozenset[str] | None] = {}
        """Round -> the base its freeze counted the majority over (`majority_base`; None: no base)."""
        self.last_seen: dict[str, float] = {}
        """Peer -> the DHT time of its latest announcement read."""
        self.addresses: dict[str, str] = {}
        """Peer -> its libp2p address in its latest announcement read (to reach it again after a partition)."""
        self.left: dict[str, int] = {}
        """Peer -> the round it said it leaves before (`leave`; forgotten once a later record of it is read):
        a round from then on neither waits for it nor counts it in its majority's base, unless it announced."""
        self.waited: set[int] = set()
        """Rounds that had no majority at their freeze and found one only later (a heal, or a base that
        shrank): too late for their exchange, they are aborted by everyone."""
        self.joins: dict[int, dict[str, float]] = {}
        """Round -> the peers registered to join the round after, with the DHT time of their registration,
        as the latest read of the round's records found them."""
        self._announcements: dict[int, dict[str, Any]] = {}  # this peer's own, by round (the last few)
        self.reports: dict[str, int] = {}
        """Owner -> the latest round in which this peer saw a slice of it disagree with its verifier; told
        to the others in its announcements for ``exclude_rounds`` rounds after."""
        self.timing: dict[str, float] = {}
        """The last `enter`'s seconds: ``announce`` (the store, until every node confirmed it; set when they
        did) and ``freeze`` (from the store's start until the freeze is final: the two overlap)."""
        self.on_minority: Callable[[int, bool], None] = lambda round, minority: None
        """Told when this peer starts (True) and stops (False) waiting for a majority in a round."""
        self._reconnecting: asyncio.Task[Any] | None = None  # a waiting peer's pings to its base
        # This peer's announcement stores not yet confirmed by every node (each bounded by exchange_timeout_s).
        self._storing: set[asyncio.Task[bool]] = set()
        self._entered = 0.0  # when the last `enter` started its store (perf_counter)
        self._steady = False  # the last freeze was complete, without a wait: its records all arrived here

    # -- one round -------------------------------------------------------------------------------------

    async def enter(self, r: int, digest: str, loss: float | None = None, *, stored: Callable[[], None] | None = None,
                    pace: Pace | None = None) -> tuple[Frozen, dict[str, rules.Announcement]]:
        """Announce this peer in round `r` (with its loss, for the dashboards, and its `pace`: its speed, where
        measured, for the automatic round length, and its payload's micro-batches and their seconds, for the
        dashboards; its state and the head round in the same DHT call) and read the round's announcements
        until its freeze is final.
        `stored` is called once the announcement's store is on its way, before the freeze's first look.

        Raises:
            FrozeWithout: the round froze without this peer (it announced too late), a `NotMember`.
            PeerUnavailable: the DHT did not give the round's membership.
        """
        announcement = {"t": now(), "digest": digest, "address": self._node.address,
                        "client": self._opts.client_mode}
        if loss is not None and math.isfinite(loss):
            announcement["loss"] = float(loss)
        if pace is not None and pace.need_s > 0:
            announcement["pace"] = [float(pace.need_s), float(pace.least_s), float(pace.train_s)]
        if pace is not None:  # a spanning member's round may have ended no micro-batch: 0 is said too
            announcement["work"] = [int(pace.micro_batches), float(pace.compute_s), float(pace.upload_s)]
        self.reports = {o: q for o, q in self.reports.items() if q >= r - self._opts.exclude_rounds}
        if self.reports:
            announcement["reports"] = dict(self.reports)
        self._announcements = {q: a for q, a in self._announcements.items() if q > r - _KEEP_ROUNDS}
        self._announcements[r] = announcement
        # Neither the freeze nor anything after it waits for the store's confirmations: the record is on this
        # node at once, and on the others as their calls arrive (the last peer to announce would otherwise
        # wait for the answers before its exchange starts, on every round's critical path). Nor does the
        # next announcement wait for this one's: a node that does not answer (just healed, its connection
        # not yet back) holds a store up to exchange_timeout_s, and a majority peer held that long would
        # announce after the others froze without it (seen in the heal test: 10 s and 300 rounds lost).
        t0 = self._entered = time.perf_counter()
        timing = self.timing = {}
        peers = (self.expected.get(r) or set()) | self.previous.get(r, set())
        storing = asyncio.create_task(self._node.store_many(
            {self._node.key("members", r): announcement, **self.state_records(r, digest)},
            also=[self.addresses[p] for p in peers if p in self.addresses and p != self._node.peer_id]))
        self._storing.add(storing)

        def confirmed(task: asyncio.Task[bool]) -> None:
            self._storing.discard(task)
            timing["announce"] = time.perf_counter() - t0

        storing.add_done_callback(confirmed)
        if stored is not None:
            stored()
        frozen, announced = await self._freeze(r)
        timing["freeze"] = time.perf_counter() - t0
        if self._node.peer_id not in frozen.members:
            raise FrozeWithout(f"round {r} froze without this peer (announced too late)", frozen.members)
        return frozen, announced

    async def stored(self) -> None:
        """Wait for this peer's announcement stores still on their way (a failed one is logged by
        `DhtNode.store_many`), before the node closes."""
        await asyncio.gather(*self._storing, return_exceptions=True)

    def phases(self) -> dict[str, float]:
        """The last `enter`'s `timing`, for the round's metrics row: where its store is not confirmed yet,
        ``announce`` is the time so far. ``stores_pending``: this peer's stores not confirmed yet."""
        return {"announce": time.perf_counter() - self._entered, **self.timing, "stores_pending": len(self._storing)}

    async def _announced(self, r: int, *, local: bool = False, wait_for: Iterable[str] = (), wait_s: float = 0.0
                         ) -> dict[str, rules.Announcement]:
        """The announcements of round `r` read now (`local`: from this node's storage alone, no search, as
        soon as the peers `wait_for` are there or after `wait_s`); each counts as hearing from its peer."""
        announced, joins = {}, {}
        key = self._node.key("members", r)
        found = await (self._node.get_local(key, wait_for, wait_s) if local else self._node.get(key))
        for p, v in found.items():
            if isinstance(v.get("join"), float | int):
                joins[p] = float(v["join"])
            if isinstance(v.get("left"), float | int):
                self.left[p] = min(self.left.get(p, r), r)
            elif p in joins and self.left.get(p, r + 1) <= r or self.left.get(p, r) < r:
                del self.left[p]  # it came back (a restart): a registration, or a record of a later round
            with contextlib.suppress(KeyError, TypeError, ValueError):
                loss = v.get("loss")  # optional: only for the dashboards
                reports = v.get("reports")
                reports = ({str(o): q for o, q in reports.items() if isinstance(q, int)}
                           if isinstance(reports, dict) else {})
                announced[p] = rules.Announcement(p, float(v["t"]), str(v["digest"]), str(v["address"]),
                                                  bool(v["client"]),
                                                  float(loss) if isinstance(loss, float | int) else None, reports,
                                                  rules.announced_pace(v.get("pace")),
                                                  rules.announced_work(v.get("work")))
        self.joins = {q: j for q, j in self.joins.items() if q > r - _KEEP_ROUNDS}
        self.joins[r] = joins
        for p, a in announced.items():
            self.last_seen[p] = max(self.last_seen.get(p, -math.inf), a.t)
            if a.address:
                self.addresses[p] = a.address
        return announced

    async def _freeze(self, r: int) -> tuple[Frozen, dict[str, rules.Announcement]]:
        """Read the round's announcements until the freeze is final (see `freeze`) and holds a majority.

        Without a majority (`rules.has_majority`) this peer is on a minority side: it applies no round and
        writes no record beyond its announcement. It waits until either a peer's head round is past `r`
        (the majority went on: `NotMember`, and the loop catches up from the majority) or the round
        holds a majority after all (`waited`: the others came back, or silent members left the base; or
        they found it first, aborted it and wait for this peer in the round after, `_aborted_ahead`).

        Raises:
            NotMember: the run went on past `r` without this peer.
            PeerUnavailable: the DHT did not give the round's membership.
        """
        opts, expected, previous = self._opts, self.expected.get(r), self.previous.get(r)
        # The first round waits for its start_peers to come up; later ones freeze within window_s.
        limit = time.monotonic() + (_START_TIMEOUT_S if expected is None else opts.window_s * 3 + 10)
        waiting = _Waiting()
        for p in previous or ():  # a base member this peer never read (a joiner's donors' list) is heard from now
            self.last_seen.setdefault(p, now())

        def final(f: Frozen | None, at: float) -> TypeGuard[Frozen]:
            return f is not None and (f.settled or at >= f.deadline + opts.settle_s)

        searched, wait_s, absent = time.monotonic(), 0.0, set(expected or ())
        steady, self._steady = self._steady, False  # True again only when this freeze is complete at once
        while waiting.minority is not None or time.monotonic() < limit:
            # In a run of a few peers every peer stores its announcement (and a joiner its registration,
            # `register`) on every node it knows and on its members' at once (`DhtNode.store_many`), so
            # this node's own storage is looked at first: when every expected peer's announcement is here,
            # the freeze is decided without a DHT call; the look waits on this node's storage until they are
            # (or until the deadline or the next search). A freeze at the deadline is decided by a search,
            # and a search is made every `_SEARCH_EVERY_S` while waiting, for records stored before the
            # storer knew this node. Every look is a search in the first round (its peers meet while they
            # announce), without a majority (across a partition nothing was stored here), after a round
            # that was not complete at once (a heal: routing tables still short of the other side), and in
            # a run of more peers than `num_replicas` (a record is stored on the nodes nearest its key only).
            local_ok = steady and waiting.minority is None and self._node.everywhere
            search = (waiting.minority is not None or expected is None or not local_ok
                      or time.monotonic() - searched >= _SEARCH_EVERY_S)
            for local in (False,) if search else (True, False):
                searched = time.monotonic() if not local else searched
                read_at = now()
                announced = await self._announced(r, local=local, wait_for=absent, wait_s=wait_s)
                here = staying(expected, previous, announced, {p for p, at in self.left.items() if at <= r})
                wait_s, absent = 0.0, set(here.expected or ()) - set(announced)
                base = None if here.previous is None else majority_base(
                    here.previous, self.last_seen, now=read_at, leave_after_s=opts.leave_after_s)
                frozen = freeze(announced, expected=here.expected, start_peers=opts.start_peers,
                                window_s=opts.window_s, base=base)
                if not final(frozen, read_at) or frozen.complete:
                    break
            if final(frozen, read_at):
                if frozen.majority:
                    if waiting.minority is not None:
                        self.waited.add(r)
                        self.on_minority(r, False)
                        logger.warning("[%s round=%d] a majority again: %d of %d members", self._node.peer_id, r,
                                       len(frozen.members), len(base or ()))
                    elif not frozen.complete:
                        missing = sorted(set(expected or ()) - set(frozen.members))
                        logger.info("[%s round=%d] froze at the deadline with %d members%s", self._node.peer_id,
                                    r, len(frozen.members), f" (not in: {', '.join(missing)})" if missing else "")
                    self.bases[r] = base
                    self._steady = frozen.complete and waiting.minority is None
                    return frozen, announced
                assert base is not None  # a round without a base always holds a majority
                late = await self._wait_without_majority(r, frozen, base, announced, read_at, waiting)
                if late is not None:
                    self.bases[r] = base
                    return late, announced
                await asyncio.sleep(_WAIT_POLL_S)
                continue
            if not local_ok:  # searching every time
                await asyncio.sleep((4 * _POLL_S if expected is None else _POLL_S) if frozen is None or frozen.settled
                                    else min(max(frozen.deadline + opts.settle_s - now(), 0.0) + 0.001, 4 * _POLL_S))
                continue
            # The next look waits for the missing (on this node) until the deadline, or the next search.
            wait_s = max(min(searched + _SEARCH_EVERY_S, limit) - time.monotonic(), 0.0) + 0.001
            if frozen is None:  # not even this peer's announcement yet (its store is on its way): no deadline
                wait_s = min(_POLL_S, wait_s)
            elif not frozen.settled:
                wait_s = min(max(frozen.deadline + opts.settle_s - now(), 0.0) + 0.001, wait_s)
            if not absent:  # nobody to wait for (the round is not complete for another reason): sleep
                await asyncio.sleep(wait_s)
                wait_s = 0.0
        raise PeerUnavailable(f"round {r}: could not read its membership from the DHT")

    async def _wait_without_majority(self, r: int, frozen: Frozen, base: frozenset[str],
                                     announced: dict[str, rules.Announcement], read_at: float, waiting: _Waiting
                                     ) -> Frozen | None:
        """One look of `_freeze` on a minority side: say so (once, then on change), reach the base again every
        few looks, and see whether the run went on without this peer or a majority is back, late.

        Returns the round's freeze once a majority is back late (every peer aborts the round), None to look
        again.

        Raises:
            NotMember: the run went on past `r` without this peer.
        """
        if waiting.minority != (frozen.members, base):  # once, then on change
            if waiting.minority is None:
                self.on_minority(r, True)
            waiting.minority = frozen.members, base
            logger.warning("[%s round=%d] no majority: %d of the %d members of the round before (%s) "
                           "are here; not applying rounds, waiting for the others", self._node.peer_id, r,
                           len(base.intersection(frozen.members)), len(base), ", ".join(sorted(base)))
        if waiting.looks % _RECONNECT_EVERY == 0 and (self._reconnecting is None or self._reconnecting.done()):
            # A partition may have healed: reach the base again. Beside the looks: a ping to a member
            # still cut off lasts exchange_timeout_s, and a late announcement must be seen at once.
            self._reconnecting = asyncio.create_task(self._node.reconnect(
                [self.addresses[p] for p in base if p in self.addresses and p != self._node.peer_id]))
        waiting.looks += 1
        head = await self.head_round()
        following = self.joiners(r + 1, read_at)  # a side a round behind gave up its own
        late = late_majority(announced, base, following)
        if head is not None and head > r and (late is None or not await self._aborted_ahead(r, head)):
            self.on_minority(r, False)
            raise NotMember(f"round {r}: no majority here, and the run went on to round {head}")
        if late is None:
            return None
        # The others are back (or aborted it and wait): abort this round together.
        self.waited.add(r)
        self.on_minority(r, False)
        joining = sorted(base.intersection(following) - set(late))
        logger.warning("[%s round=%d] a majority again, late: %d of %d members%s; the round is aborted",
                       self._node.peer_id, r, len(base.intersection(late)) + len(joining), len(base),
                       f" ({', '.join(joining)} joining the next round)" if joining else "")
        return Frozen(deadline=read_at, members=late, complete=False, settled=True)
