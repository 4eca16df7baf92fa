"""The stream messages of DHT mode: built with the run token's HMAC and the sender's signature, and checked.

A mixin of demonet.dht.streams.Streams, which supplies the options, the key and the key book. Must not
import grpc, demonet.transport.grpc, demonet.dht.streams or the round components.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload
from demonet.wire import identity as ids
from demonet.wire.merge import check_samples

from . import keys, rules
from .deadlines import now
from .options import DhtOptions

__all__ = ["Resolve", "SignedMessages"]

logger = logging.getLogger(__name__)

_PART_BYTES = 1 << 20
_REPLAY_S = 600.0  # messages sent longer ago than this (by the sender's clock) are refused

Resolve = Callable[[str, int], Awaitable[bytes | None]]
"""(a peer id, a round) -> its key, read from its DHT records of that round (None: none found)."""


class SignedMessages:
    """The messages of `demonet.dht.streams.Streams`: each signed (or, on a link, spoken for by its hello)
    and carrying the run token's HMAC; a message that comes in is checked, and a refused one counted."""

    opts: DhtOptions
    peer_id: str
    identity: ids.Identity
    book: keys.KeyBook
    resolve: Resolve | None
    refused: int
    _token: bytes
    _logged: set[tuple[str, int]]

    def _message(self, kind: pb.DhtKind, round: int, *, link: tuple[str, str] | None = None, **fields: Any
                 ) -> pb.DhtMessage:
        """A signed message, or on a link (`call` set) one that its link's hello speaks for: unsigned, except
        the hello and its reply (`link`: the link's opener and callee), which are signed for that link."""
        msg = pb.DhtMessage(run=self.opts.run, round=round, sender=self.peer_id, kind=kind, sent_at=now(), **fields)
        if link is not None:
            msg.signature = self.identity.sign(keys.link_statement(msg.SerializeToString(), *link))
        elif not msg.call:
            msg.signature = self.identity.sign(keys.message_statement(msg.SerializeToString()))
        msg.mac = rules.sign(self._token, msg.SerializeToString())
        return msg

    def _messages(self, kind: pb.DhtKind, round: int, data: bytes | None, **fields: Any) -> list[pb.DhtMessage]:
        """One message without a part if `data` is None, else one message per part of `data`."""
        if data is None:
            return [self._message(kind, round, **fields)]
        return [self._message(kind, round, part=part, **fields) for part in wire.split(data, part_bytes=_PART_BYTES)]

    def _check(self, msg: pb.DhtMessage) -> str:
        """Why a message is refused ('' if it is good): its MAC, its run, its age, and a part's sample count."""
        mac = msg.mac
        msg.mac = b""
        ok = rules.verify(self._token, msg.SerializeToString(), mac)
        msg.mac = mac
        if not ok:
            return "bad run token"
        if msg.run != self.opts.run:
            return f"another run ({msg.run!r})"
        if abs(now() - msg.sent_at) > _REPLAY_S:
            return "sent too long ago"
        if msg.kind == pb.DHT_KIND_PART:  # its weight in the slice's merge: refused before any of it is kept
            try:
                check_samples(msg.samples, self.opts.rules.max_samples)
            except InvalidPayload as e:
                return str(e)
        return ""

    async def _check_sender(self, msg: pb.DhtMessage, *, unknown_ok: bool, link: tuple[str, str] | None = None
                            ) -> str:
        """Why a message whose MAC is good is refused for its signature ('' if it is good).

        `unknown_ok`: a sender with no key known here (none in its DHT records either) passes unchecked.
        `link`: a link's hello or its reply, signed for that link (its opener's and its callee's peer ids).
        """
        public = self.book.key_of(msg.sender)
        if public is None and self.resolve is not None:
            public = await self.resolve(msg.sender, msg.round)
        if public is None:
            return "" if unknown_ok else f"unknown sender {msg.sender!r} (no DHT record of its key)"
        mac, signature = msg.mac, msg.signature
        msg.mac, msg.signature = b"", b""
        body = msg.SerializeToString()
        msg.mac, msg.signature = mac, signature
        signed = keys.message_statement(body) if link is None else keys.link_statement(body, *link)
        if not ids.verify(public, signature, signed):
            return f"bad signature: not {msg.sender!r}'s key"
        return ""

    def _refuse(self, sender: str, round: int, remote: object, why: str) -> None:
        """Count a refused message and log it (a signature's refusal once per sender and round)."""
        self.refused += 1
        if why.startswith(("unknown sender", "bad signature")):
            if (sender, round) in self._logged:
                return
            if len(self._logged) > 4096:
                self._logged.clear()
            self._logged.add((sender, round))
        logger.warning("[%s] refused a message from %s (as %r, round %d): %s", self.peer_id, remote, sender, round,
                       why)
