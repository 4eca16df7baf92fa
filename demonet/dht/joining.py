"""The joining side of DHT mode's round board: the head round, joiners' registrations and admission, leaving.

A mixin of demonet.dht.board.RoundBoard (which holds the state), with each peer's published state. Must
not import grpc, demonet.transport.grpc, or the exchange of payloads (demonet.dht.exchange).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from .deadlines import now
from .node import DhtNode
from .options import DhtOptions

__all__ = ["Joining"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05


def _expected(states: Mapping[str, Mapping[str, Any]]) -> tuple[str, ...] | None:
    """The peers that most of `states` expect in the round after (None: no state says)."""
    lists = [tuple(v["expected"]) for v in states.values() if isinstance(v.get("expected"), list)]
    return max(set(lists), key=lists.count) if lists else None


class Joining:
    """Joining the run and leaving it, and the states the peers publish, of `demonet.dht.board.RoundBoard`."""

    _node: DhtNode
    expected: dict[int, set[str] | None]
    previous: dict[int, set[str]]
    addresses: dict[str, str]
    joins: dict[int, dict[str, float]]
    _announcements: dict[int, dict[str, Any]]

    @property
    def _opts(self) -> DhtOptions:
        return self._node.opts

    async def head_round(self) -> int | None:
        """The latest round any peer of the run has started, or None if the DHT knows no run yet."""
        heads = [v.get("round") for v in (await self._node.get(self._node.key("head"))).values()]
        rounds = [r for r in heads if isinstance(r, int)]
        return max(rounds) if rounds else None

    async def register(self, rounds: Iterable[int]) -> None:
        """Ask to be admitted at these rounds (the members of the round before decide at its freeze).

        A registration for round r is a ``join`` time in this peer's record among the announcements of
        round r - 1, so that the members read it with their freeze. It keeps this peer's own announcement
        of that round, if it made one (a peer that resyncs), which the record replaces.

        The members decide from their own nodes' storage (`_freeze`), so the registration must reach every
        member's node, and a store goes to the nodes this node knows. So it is stored at once, then this
        node meets the members (the addresses it read in their announcements, or in the states of the
        round before the first), and the same records are stored again, at the nodes it did not know.
        """
        rounds = sorted(rounds)
        # At once: rounds of a small model last tens of milliseconds, less than a store takes.
        t = now()
        records = {self._node.key("members", r - 1): {**self._announcements.get(r - 1, {}), "join": t} for r in rounds}
        await self._node.store_many(records)
        addresses = set(self.addresses.values())
        if not addresses and rounds:
            addresses = {str(v.get("address", "")) for v in (await self.states(rounds[0] - 1)).values()}
        if await self._node.reconnect(addresses - {self._node.address}):
            await self._node.store_many(records)

    async def leave(self, r: int) -> bool:
        """Say that this peer leaves the run before round `r` (a graceful stop; `r` the round after the last
        one it applied, or the open one it abandoned): a ``left`` time in its record among the announcements
        of `r`, stored on every node it knows and on its members' and confirmed (up to exchange_timeout_s).
        It keeps this peer's own announcement of `r`, if it made one, which the record replaces: a round it
        announced keeps it as a member. The members then freeze `r` and the rounds after without waiting
        for it, and leave it out of their majority's base. Returns whether every node confirmed it."""
        record = {**self._announcements.get(r, {}), "left": now()}
        peers = (self.expected.get(r) or set()) | self.previous.get(r, set())
        try:
            return await self._node.store_many({self._node.key("members", r): record},
                                               also=[self.addresses[p] for p in peers if p in self.addresses
                                                     and p != self._node.peer_id])
        except Exception as e:  # noqa: BLE001 - on its way out: the members drop it by the round's deadline
            logger.warning("[%s round=%d] could not say it leaves (%s: %s); the members freeze round %d without "
                           "it at its deadline", self._node.peer_id, r, type(e).__name__, e, r)
            return False

    def state_records(self, round: int, digest: str) -> dict[str, dict[str, Any]]:
        """This peer's state in `round` (its digest, its address, the peers it expects: what a joiner
        reads to be admitted and to find donors) and the head round, stored with its announcement."""
        expected = self.expected.get(round)
        state = {"digest": digest, "address": self._node.address, "client": self._opts.client_mode,
                 "expected": sorted(expected) if expected is not None else None}
        return {self._node.key("state", round): state, self._node.key("head"): {"round": round}}

    async def states(self, round: int) -> dict[str, dict[str, Any]]:
        """The states the peers published for `round`, by peer."""
        return await self._node.get(self._node.key("state", round))

    async def member_states(self, round: int) -> dict[str, dict[str, Any]]:
        """The states published for `round`, read again for up to ``settle_s`` until every peer that the
        members expect (less this one) published one: a joiner reads them right after its admission, when
        a member's state may still be on its way, and would find fewer donors than there are."""
        deadline = time.monotonic() + self._opts.settle_s
        while True:
            states = await self.states(round)
            wanted = set(_expected(states) or ()) - {self._node.peer_id}
            if wanted <= set(states) or time.monotonic() >= deadline:
                return states
            await asyncio.sleep(_POLL_S)

    async def _aborted_ahead(self, r: int, head: int) -> bool:
        """Whether the peers at `head` aborted round `r` too and wait for this peer in the round after: `head`
        is that round, and a state there holds this peer's digest of `r` (nobody applied `r`) and expects it.

        Of two members that waited in `r` for each other (one was held in the exchange of the round before
        to its deadline), the one that saw the late majority first is a round ahead when the other looks.
        """
        digest = self._announcements.get(r, {}).get("digest")
        if head != r + 1 or digest is None:
            return False
        return any(v.get("digest") == digest and isinstance(v.get("expected"), list)
                   and self._node.peer_id in v["expected"] for v in (await self.states(head)).values())

    async def admitted(self, round: int, timeout_s: float) -> bool | None:
        """Whether the members of `round` expect this peer (None: no member said so within `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            expected = _expected(await self.states(round))
            if expected is not None:
                return self._node.peer_id in expected
            await asyncio.sleep(4 * _POLL_S)
        return None

    def adopt_expected(self, round: int, states: Mapping[str, Mapping[str, Any]], donors: Iterable[str]) -> None:
        """A joiner takes the peers that the donors of `round` expect, so that its state says the same."""
        donors = set(donors)
        lists = [v["expected"] for p, v in states.items() if p in donors and isinstance(v.get("expected"), list)]
        if lists:
            self.expected[round] = set(lists[0])
            # Its base: the peers expected less this joiner (the donors' base less its other joiners is
            # not published; counting them as well only makes a majority harder to reach, never easier).
            self.previous[round] = set(lists[0]) - {self._node.peer_id}

    def joiners(self, r: int, freeze_deadline: float) -> set[str]:
        """The peers admitted at round `r`: registered for it before the previous round's freeze, less
        the store latency, as the last read of that round's records (its freeze's) found them.

        Every member reads the same: the freeze's last read comes after its deadline, when every
        registration made before the deadline less the store latency is visible.
        """
        return {p for p, t in self.joins.get(r - 1, {}).items() if t < freeze_deadline - self._opts.settle_s}
