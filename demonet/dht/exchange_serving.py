"""The serving side of a DHT round's exchange: the parts members send, merged slices and checks asked for.

A mixin of demonet.dht.exchange.SliceExchange, which holds the rounds' state and merges. Must not import
grpc, demonet.transport.grpc, the round board or demonet.dht.exchange.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING

from demonet._proto import demonet_pb2 as pb

from . import rules
from .deadlines import now
from .options import DhtOptions
from .round_state import RoundState
from .streams import Reply

__all__ = ["SliceServing"]


class SliceServing:
    """The handlers of `demonet.dht.exchange.SliceExchange` for the other peers' calls: parts of the slices
    this peer owns or verifies, the merged slices it holds, and the checks it is asked as a verifier."""

    opts: DhtOptions
    peer_id: str
    _cond: asyncio.Condition
    _left: dict[int, tuple[str, ...]]

    if TYPE_CHECKING:  # SliceExchange's
        def _not_here(self, r: int) -> str | None: ...
        def _round(self, r: int, *, mine: bool = False) -> RoundState: ...
        async def _froze_otherwise(self, st: RoundState, peer: str, named: Collection[str] = ()) -> None: ...
        async def _digest_over(self, r: int, st: RoundState, s: int, senders: tuple[str, ...] | None
                               ) -> tuple[tuple[str, ...], bytes] | None: ...

    async def _take_part(self, head: pb.DhtMessage, data: bytes | None) -> Reply:
        """A member's part of a slice this peer owns or verifies: kept for `_merge` (or the check). The
        owner answers with its merged slice once it has it (`_serve_slice`); a verifier, with nothing. A
        part sent ahead (`SliceExchange.send_ahead`) for another member list than this peer froze is
        answered with nothing: its sender cuts another once frozen, or (if it froze the list the part
        was cut for) fetches the slice."""
        r = head.round
        if data is None:
            return Reply(error="a part request without its payload")
        if why := self._not_here(r):
            return self._left_reply(r) if r in self._left else Reply(error=why)
        st = self._round(r)
        async with self._cond:
            held = st.parts.setdefault(head.slice, {})
            sent_ahead = st.ahead.setdefault(head.slice, set())
            if head.ahead and head.sender in held and head.sender not in sent_ahead:
                return Reply(error="a part sent ahead after the part sent once frozen")
            held[head.sender] = (head.members_digest, data)
            st.claims.setdefault(head.slice, {})[head.sender] = head.samples  # in [1, max]: `Streams` checked it
            (sent_ahead.add if head.ahead else sent_ahead.discard)(head.sender)
            st.bytes_down += len(data)
            st.decode_early(r, head.slice, head.sender, head.members_digest, data, self.opts.rules)
            self._cond.notify_all()
            with contextlib.suppress(TimeoutError):  # the part can come before this peer froze the round
                async with asyncio.timeout(self.opts.window_s + self.opts.exchange_timeout_s):
                    await self._cond.wait_for(lambda: st.plan is not None or r in self._left)
        if st.plan is None and r in self._left:
            return self._left_reply(r)
        if head.members_digest != st.mdigest:
            if head.ahead or st.plan is None:  # its sender sends another part once frozen
                return Reply()
            await self._froze_otherwise(st, head.sender)  # nothing merged here is for its member list
            return Reply(fields={"members_digest": st.mdigest, "contributors": st.members})
        if head.slice < len(st.owners) and st.owners[head.slice] == self.peer_id:
            return await self._serve_slice(head, None)
        if st.verifiers.get(head.slice) == self.peer_id and head.sender in st.members:
            return await self._answer_early(r, st, head.slice, head.sender)
        return Reply()

    def _left_reply(self, r: int) -> Reply:
        """The answer to a part of round `r`, which froze without this peer (`left_out`): the list it read."""
        return Reply(fields={"members_digest": rules.members_digest(self._left[r]), "contributors": self._left[r]})

    async def _answer_early(self, r: int, st: RoundState, s: int, sender: str) -> Reply:
        """As the verifier of slice `s`: the answer to `sender`'s part, the senders and SHA-256 of the merge
        its owner makes (`RoundState.early`): over every member's part, once it holds them all (a peer of
        another member list left out), or the reduce-scatter's deadline. Nothing if no part is valid."""
        early = await self._digest_over(r, st, s, None)
        if early is None:
            return Reply()
        senders, digest = early
        return Reply(data=digest, fields={"contributors": list(senders)}, sent=self._answered(st, s, sender))

    def _answered(self, st: RoundState, s: int, sender: str) -> Callable[[], Awaitable[None]]:
        """What a verifier calls once `sender` got its digest of slice `s`: `sender` is answered
        (`RoundState.asked`)."""
        async def sent() -> None:
            async with self._cond:
                st.asked.setdefault(s, set()).add(sender)
                self._cond.notify_all()

        return sent

    async def _serve_slice(self, head: pb.DhtMessage, data: bytes | None) -> Reply:
        """A merged slice, once this peer holds it (or, if not its owner, once the phase is over)."""
        r, s, sender = head.round, head.slice, head.sender
        if why := self._not_here(r):
            return Reply(error=why)
        st = self._round(r)
        limit = self.opts.window_s + 3 * self.opts.exchange_timeout_s  # the round must freeze and merge by then

        def answered() -> bool:
            # The owner answers once merged; another member once it holds the slice or the phase is over.
            return s in st.merged or (st.plan is not None and now() >= st.ag_deadline)

        async with self._cond:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(limit):
                    while not answered():
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(max(0.01, st.ag_deadline - now()) if st.plan else 1.0):
                                await self._cond.wait()
            held = st.merged.get(s)
        if held is None:
            return Reply(error=f"slice {s} of round {r} is not held here")
        contributors, merged, _ = held

        async def sent() -> None:
            async with self._cond:
                st.bytes_up += len(merged)
                st.fetched.setdefault(s, set()).add(sender)
                self._cond.notify_all()

        return Reply(data=merged, fields={"slice": s, "contributors": list(contributors), "members_digest": st.mdigest},
                     sent=sent)

    async def _serve_check(self, head: pb.DhtMessage, data: bytes | None) -> Reply:
        """As a verifier: the SHA-256 of this peer's merge of the slice over the asked senders."""
        r, s, senders = head.round, head.slice, tuple(sorted(head.contributors))
        if why := self._not_here(r):
            return Reply(error=why)
        st = self._round(r)
        async with self._cond:  # the request can come before this peer froze the round
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.opts.window_s + self.opts.exchange_timeout_s):
                    await self._cond.wait_for(lambda: st.plan is not None)
        if st.verifiers.get(s) != self.peer_id:
            return Reply(error=f"not the verifier of slice {s} of round {r}")
        if not senders or not set(senders) <= set(st.members):
            return Reply(error="a check of senders who are not members")
        if head.sender not in st.members:
            return Reply(error=f"{head.sender} is not a member of round {r}")
        asked = st.check_lists.setdefault(s, {}).setdefault(head.sender, senders)
        if asked != senders:  # one list per member: a member cannot make this peer merge without end
            return Reply(error=f"slice {s} of round {r} was checked for {head.sender} over another list already")
        digest = await self._digest_over(r, st, s, senders)
        if digest is None:
            return Reply(error=f"cannot check slice {s}: a part of those senders is missing here")
        return Reply(data=digest[1], sent=self._answered(st, s, head.sender))
