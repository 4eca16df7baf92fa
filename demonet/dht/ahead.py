"""Parts sent ahead of the freeze: a DHT peer's parts of a round, sent before it froze the round.

Net layer over demonet.dht.streams, for demonet.dht.exchange: once its announcement's store is on its
way, a peer whose round before was whole cuts its parts for the same members and owners and sends them
(marked ``ahead``), so that they travel while the last announcement does. The exchange takes the calls
up where the freeze gives those members and owners, and they are cancelled otherwise
(docs/dht.md#a-round, step 4). Must not import grpc, demonet.transport.grpc, or the round board.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.optim import Payload

from . import rules
from .deadlines import NoAnswer
from .options import DhtOptions
from .streams import Streams

__all__ = ["Ahead", "Call", "PartsAhead", "call_or_ahead", "encode_parts", "encode_parts_now"]

logger = logging.getLogger(__name__)

_PARTS_CODING = "entropy"  # parts travel with entropy-coded indices: 7.9 bits an index instead of 12, lossless

Call = asyncio.Task[tuple[pb.DhtMessage, bytes]]
"""A call of a part: its reply and the reply's data."""


@dataclass(eq=False)
class Ahead:
    """This peer's parts of one round sent ahead, cut for the members it expects, and their calls."""

    mdigest: str
    owners: tuple[str, ...]
    verifiers: dict[int, str]
    parts: list[bytes] = field(default_factory=list)
    to_owners: dict[int, Call] = field(default_factory=dict)  # slice -> the call sending the part to its owner
    to_verifiers: dict[int, Call] = field(default_factory=dict)  # slice -> the call sending it to its verifier
    task: asyncio.Task[None] | None = None  # encodes the parts and makes the calls

    def bytes_sent(self) -> int:
        """The bytes of the parts whose calls were made."""
        return sum(len(self.parts[s]) for calls in (self.to_owners, self.to_verifiers) for s in calls)

    def cancel(self) -> None:
        """Cancel what is still on its way (a call already answered is left as it is)."""
        for t in [self.task, *self.to_owners.values(), *self.to_verifiers.values()]:
            if t is not None:
                t.cancel()


class PartsAhead:
    """One peer's parts sent ahead, by round (the latest round's only)."""

    def __init__(self, streams: Streams, opts: DhtOptions, peer_id: str) -> None:
        self._streams, self.opts, self.peer_id = streams, opts, peer_id
        self._rounds: dict[int, Ahead] = {}

    def send(self, r: int, encode: Callable[[], Awaitable[list[bytes]]], *, plan: rules.SlicePlan, mdigest: str,
             owners: Sequence[str], addresses: Mapping[str, str], samples: int = 1) -> None:
        """Send round `r`'s parts, cut by `plan` (`encode`) for the member list of digest `mdigest` and the
        dialable members `owners` (in `rules.owner_order`; `addresses` reaches them), each with the payload's
        `samples`, by a task: this returns at once. Those sent ahead of earlier rounds are cancelled."""
        for q in [q for q in self._rounds if q <= r]:
            self.drop(q)
        ahead = self._rounds[r] = Ahead(mdigest, tuple(owners[:plan.n]),
                                        rules.verifiers(r, mdigest, owners, plan.n, self.opts.verify_fraction))
        owners = ahead.owners
        # Until this peer's freeze and the owner's merge: the freeze's deadline at the latest, then the exchange.
        timeout_s = self.opts.window_s + 2 * self.opts.exchange_timeout_s

        def call(s: int, address: str) -> Call:
            return asyncio.create_task(self._streams.call(address, pb.DHT_KIND_PART, r, slice=s, data=ahead.parts[s],
                                                          members_digest=mdigest, samples=samples, ahead=True,
                                                          timeout_s=timeout_s))

        async def send() -> None:
            # One turn of the event loop first: the announcement's store, started just before, writes its calls
            # to the other nodes then, and their freezes wait for it; parts encoded here would hold them back.
            await asyncio.sleep(0)
            ahead.parts = await encode()
            for s, owner in enumerate(owners):
                if owner != self.peer_id:
                    ahead.to_owners[s] = call(s, addresses[owner])
                verifier = ahead.verifiers.get(s)
                if verifier is not None and verifier != self.peer_id:
                    ahead.to_verifiers[s] = call(s, addresses[verifier])

        ahead.task = asyncio.create_task(send())

    def drop(self, r: int) -> None:
        """Cancel the calls of round `r`'s parts sent ahead, if the exchange did not take them up."""
        ahead = self._rounds.pop(r, None)
        if ahead is not None:
            ahead.cancel()

    async def take(self, r: int, mdigest: str, owners: Sequence[str], verifiers: Mapping[int, str]
                   ) -> tuple[Ahead | None, int]:
        """Round `r`'s parts sent ahead and their calls, if they were cut for the member list (`mdigest`),
        owners and verifiers this peer froze (None: none sent, or cancelled, and the parts are sent again),
        and the bytes of the parts sent ahead for nothing."""
        ahead = self._rounds.pop(r, None)
        if ahead is None:
            return None, 0
        if (ahead.mdigest, ahead.owners, ahead.verifiers) != (mdigest, tuple(owners), dict(verifiers)):
            logger.info("[%s round=%d] the round froze with other members than the parts sent ahead were cut for; "
                        "sending them again", self.peer_id, r)
            ahead.cancel()
            return None, ahead.bytes_sent()
        assert ahead.task is not None
        try:
            await ahead.task
        except BaseException as e:
            ahead.cancel()
            if not isinstance(e, Exception):
                raise
            logger.warning("[%s round=%d] the parts sent ahead failed (%s); sending them again", self.peer_id, r, e)
            return None, ahead.bytes_sent()
        return ahead, 0


def encode_parts(r: int, plan: rules.SlicePlan, payload: Payload) -> list[bytes]:
    """A peer's part of each slice of `plan` in round `r`, encoded (in any thread: it touches no state)."""
    return wire.encode_many([plan.cut(payload, s) for s in range(plan.n)], step=r, index_coding=_PARTS_CODING)


async def encode_parts_now(r: int, plan: rules.SlicePlan, payload: Payload) -> list[bytes]:
    """`encode_parts` on the event loop for a small payload (no trip to a thread), else in a worker thread."""
    if payload.numel() <= wire.INLINE_ENCODE_ENTRIES:
        return encode_parts(r, plan, payload)
    return await asyncio.to_thread(encode_parts, r, plan, payload)


async def call_or_ahead(ahead: Call | None, timeout_s: float,
                        call: Callable[[], Awaitable[tuple[pb.DhtMessage, bytes]]]) -> tuple[pb.DhtMessage, bytes]:
    """The reply to a call sent ahead of the freeze (`ahead`, awaited for `timeout_s` more), or to `call()`
    made now (no call ahead, or one that was cancelled)."""
    if ahead is None or ahead.cancelled():
        return await call()
    try:
        async with asyncio.timeout(timeout_s):
            return await ahead
    except TimeoutError as e:
        raise NoAnswer(f"no answer within {timeout_s:.1f} s") from e
