"""The calling side of a DHT round's exchange: parts sent to their owners and verifiers, slices fetched and checked.

A mixin of demonet.dht.exchange.SliceExchange, which holds the rounds' state and merges. Must not import
grpc, demonet.transport.grpc, the round board or demonet.dht.exchange.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import TYPE_CHECKING

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload, PeerUnavailable

from .ahead import Call, call_or_ahead
from .deadlines import NoAnswer, now, retry
from .options import DhtOptions
from .round_state import RoundState
from .streams import Streams

__all__ = ["SliceCalls"]

logger = logging.getLogger(__name__)


class SliceCalls:
    """The calls of `demonet.dht.exchange.SliceExchange` to the other peers: this peer's parts to their
    owners and verifiers, the merged slices it fetches, and the checks of those against their verifiers."""

    opts: DhtOptions
    peer_id: str
    _streams: Streams
    _cond: asyncio.Condition

    if TYPE_CHECKING:  # SliceExchange's
        async def _froze_otherwise(self, st: RoundState, peer: str, named: Collection[str] = ()) -> None: ...
        async def _digest_over(self, r: int, st: RoundState, s: int, senders: tuple[str, ...] | None
                               ) -> tuple[tuple[str, ...], bytes] | None: ...

    def _part_call(self, r: int, st: RoundState, s: int, data: bytes, address: str, ahead: Call | None
                   ) -> Callable[[float], Awaitable[tuple[pb.DhtMessage, bytes]]]:
        """`call(timeout_s)` sends this peer's part of slice `s` to `address`: the first time, it awaits the
        call sent ahead (`ahead`, if any); then, and after a failure, it makes a new call."""
        pending = [ahead] if ahead is not None else []

        async def call(timeout_s: float) -> tuple[pb.DhtMessage, bytes]:
            return await call_or_ahead(pending.pop() if pending else None, timeout_s, lambda: self._streams.call(
                address, pb.DHT_KIND_PART, r, slice=s, data=data, members_digest=st.mdigest, samples=st.samples,
                timeout_s=timeout_s))

        return call

    async def _send_part(self, r: int, st: RoundState, s: int, data: bytes, address: str, ahead: Call | None = None
                         ) -> None:
        """Send this peer's rows of slice `s` (encoded) to the slice's verifier, which answers once it holds
        every member's part (or at the reduce-scatter's deadline) with the senders and SHA-256 of their merge
        (`RoundState.early`): the check of the slice then needs no call of its own when the owner merged the
        same parts. `ahead`: that call, made already
        (`send_ahead`); its failure is tried again as a new call."""
        def answered(early: tuple[tuple[str, ...], bytes] | None) -> None:
            if not st.early[s].done():  # the first answer counts; a failed try falls back to a check at once
                st.early[s].set_result(early)

        part = self._part_call(r, st, s, data, address, ahead)

        async def send(timeout_s: float) -> None:
            try:
                reply, digest = await part(timeout_s)
            except (PeerUnavailable, InvalidPayload) as e:
                if isinstance(e, NoAnswer):  # before the check wakes up: it makes no call to a silent verifier
                    st.silent.add(st.verifiers[s])
                answered(None)
                raise
            if st.other_list(reply):
                await self._froze_otherwise(st, st.verifiers[s], reply.contributors)
            answered((tuple(reply.contributors), digest) if digest else None)

        try:
            error = await retry(send, st.ag_deadline)
            if error:
                logger.warning("[%s round=%d] slice %d: its verifier did not take the part: %s", self.peer_id, r, s,
                               error)
            else:
                st.bytes_up += len(data)
        finally:
            answered(None)

    async def _part_and_slice(self, r: int, st: RoundState, s: int, data: bytes, address: str, ahead: Call | None = None
                              ) -> None:
        """Send this peer's rows of slice `s` (encoded) to its owner, which answers with the merged slice
        once it has merged it. An answer without the slice (a peer that does not own it in its view of
        the round) is followed by a fetch. `ahead`: that call, made already (`send_ahead`)."""
        taken = False
        part = self._part_call(r, st, s, data, address, ahead)

        async def attempt(timeout_s: float) -> None:
            nonlocal taken
            reply, merged = await part(timeout_s)
            if not taken:  # a later attempt (the slice was bad) sends the part again; counted once
                st.bytes_up += len(data)
                taken = True
            if st.other_list(reply):  # its owner froze another member list (named): no slice for this one
                await self._froze_otherwise(st, st.owners[s], reply.contributors)
            elif merged:
                await self._keep_slice(r, st, s, reply, merged)
            else:
                await self._fetch(r, st, s, address, timeout_s=max(0.1, st.ag_deadline - now()))

        error = await retry(attempt, st.ag_deadline)
        if isinstance(error, NoAnswer):
            st.silent.add(st.owners[s])
        if error:
            logger.warning("[%s round=%d] slice %d: not from its owner: %s", self.peer_id, r, s, error)

    async def _check(self, r: int, st: RoundState, s: int, address: str) -> None:
        """Compare the merged slice `s` this peer holds with its verifier's merge over the same senders.

        Equal: kept. Different: the slice is dropped this round and both peers are reported. No answer
        (the verifier is gone, or lacks a part of those senders): kept unverified."""
        senders, data, _ = st.merged[s]
        verifier = st.verifiers[s]
        early = await st.early[s] if s in st.early else None
        if verifier == self.peer_id:
            own = await self._digest_over(r, st, s, senders)
            theirs = None if own is None else own[1]
        elif early is not None and early[0] == senders:  # the verifier's answer to this peer's part
            theirs = early[1]
        elif verifier in st.silent or verifier in st.other_lists:  # a check call would wait, or be refused
            theirs = None
            logger.info("[%s round=%d] slice %d: its verifier %s did not answer the part, or froze another member "
                        "list; not checked", self.peer_id, r, s, verifier)
        else:
            try:
                _, theirs = await self._streams.call(address, pb.DHT_KIND_CHECK, r, slice=s, contributors=list(senders),
                                                     timeout_s=max(self.opts.exchange_timeout_s,
                                                                   st.ag_deadline - now()))
            except PeerUnavailable as e:
                theirs = None
                logger.info("[%s round=%d] slice %d: its verifier %s did not check it: %s", self.peer_id, r, s,
                            verifier, e)
        if theirs is None:
            st.unverified.add(s)
        elif theirs != hashlib.sha256(data).digest():
            st.disagreed.add(s)
            logger.warning("[%s round=%d] slice %d: its owner %s and its verifier %s disagree; dropped this round, "
                           "both reported", self.peer_id, r, s, st.owners[s], verifier)

    async def _fetch_from_holders(self, r: int, st: RoundState, s: int, addresses: Mapping[str, str]) -> None:
        await asyncio.sleep(max(0.0, st.ag_deadline - now()))  # holders answer for good only after it
        for p in st.holders(s, self.peer_id):
            with contextlib.suppress(PeerUnavailable, InvalidPayload):
                await self._fetch(r, st, s, addresses[p], timeout_s=self.opts.exchange_timeout_s)
                return

    async def _fetch(self, r: int, st: RoundState, s: int, address: str, *, timeout_s: float) -> None:
        reply, data = await self._streams.call(address, pb.DHT_KIND_FETCH, r, slice=s, timeout_s=timeout_s)
        await self._keep_slice(r, st, s, reply, data)

    async def _keep_slice(self, r: int, st: RoundState, s: int, reply: pb.DhtMessage, data: bytes) -> None:
        """Check and keep merged slice `s` as `reply` and its `data` give it."""
        assert st.plan is not None
        if not set(reply.contributors) <= set(st.members):
            raise InvalidPayload(f"merged slice names contributors who are not members: {list(reply.contributors)}")
        if st.other_list(reply):
            raise InvalidPayload("a slice merged for another member list")
        specs = st.plan.slice_specs(s)
        # A small slice is decoded here: a trip to a worker thread would cost more than the decode.
        step, payload = (wire.decode(data, expected=specs) if len(data) <= wire.INLINE_DECODE_BYTES
                         else await asyncio.to_thread(wire.decode, data, expected=specs))
        if step != r:
            raise InvalidPayload(f"merged slice says round {step}")
        async with self._cond:
            st.bytes_down += len(data)
            st.merged.setdefault(s, (tuple(reply.contributors), data, payload))
            self._cond.notify_all()
