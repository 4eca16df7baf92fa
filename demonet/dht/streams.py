"""The DHT-mode transport's libp2p side: `Streams`, the signed stream messages between peers.

Net layer, used by demonet.dht.node and the round components (board, exchange, donor): sends signed
requests over hivemind's P2P and serves the requests other peers send to the handlers registered with
it. Must not import grpc, demonet.transport.grpc or the round components.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2PContext, PeerID

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload, PeerUnavailable
from demonet.wire import identity as ids
from demonet.wire import params as wire_params

from . import keys, links
from .deadlines import NoAnswer
from .messages import Resolve, SignedMessages
from .options import DhtOptions
from .uploads import Uploads

__all__ = ["HANDLER", "Reply", "Streams"]

logger = logging.getLogger(__name__)

HANDLER = "demonet.dht.v3"  # one call per stream; v3: messages signed by the sender's key; v2: PayloadPart messages
_MAX_DRAIN = 64  # messages read after a refused one, so that the refusal reaches its sender
_OWN_STREAM = frozenset({pb.DHT_KIND_PARAMS, pb.DHT_KIND_PING})
"""Calls that get a stream of their own instead of a link: parameters (megabytes, which would hold up the
round's calls behind them) and pings (once per peer at start, where a refusal says the token is wrong)."""

@dataclass
class Reply:
    """A handler's answer to one request: `data` (cut into messages) with extra fields, or an `error`."""

    data: bytes | None = None
    """None: a reply without parts (an acknowledgement)."""
    fields: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    sent: Callable[[], Awaitable[None]] | None = None
    """Called once the last message of the reply went out (not on an error)."""


Handler = Callable[[pb.DhtMessage, bytes | None], Awaitable[Reply]]
"""(the request's first message, its payload: None for a request without parts) -> the reply."""
"""Serves one request kind: (the request's first message, the request's data) -> the reply."""


class Streams(SignedMessages):
    """Signed messages over one peer's libp2p endpoint: calls to other peers, and the handlers that serve them.

    A round's calls (parts, slices, checks) to a peer go over one long-lived link to it
    (demonet.dht.links), opened at the first call; parameters and pings get a stream of their own.

    Every message carries the run token's HMAC. A message on a stream of its own carries its sender's
    Ed25519 signature, and counts only if it verifies against the key `book` holds for its sender (read
    from the sender's DHT records; `resolve` reads them for a sender not seen yet); a ping, which
    changes nothing, is answered to a sender not known yet. A link is signed for once, by its hello and
    the hello's reply (`_hello`, `hello`): each is signed, as above, over its bytes and both ends' libp2p
    peer ids, which the daemons' secure channel vouches for. The link's later messages count unsigned,
    sent as the peer id its hello bound, and are refused as any other. Requests are dispatched by kind to
    the handlers given to `serve`; a ping is answered here.
    """

    def __init__(self, opts: DhtOptions, peer_id: str, p2p: Any, identity: ids.Identity, book: keys.KeyBook,
                 resolve: Resolve | None = None) -> None:
        self.opts, self.peer_id, self.p2p = opts, peer_id, p2p
        self.identity, self.book, self.resolve = identity, book, resolve
        self._token = opts.token.encode()
        self._handlers: dict[int, Handler] = {pb.DHT_KIND_PING: self._ping}
        self._logged: set[tuple[str, int]] = set()  # (sender, round) whose signature refusal was logged
        self.refused = 0
        """Messages refused (bad MAC, another run, replayed, unknown sender, bad signature)."""
        self._links: dict[str, links.Link] = {}  # the links this peer opened, by the address called
        self._opening: dict[str, asyncio.Lock] = {}
        self._served: set[asyncio.StreamWriter] = set()  # the links other peers opened to this one
        self.links_opened = 0
        """Links this peer opened: one per peer called, and one more after each that broke or timed out."""
        self.uploads = Uploads()
        """This peer's parts of its latest rounds, timed by their receipts (`DHT_KIND_RECEIVED`)."""

    def serve(self, kind: int, handler: Handler) -> None:
        """Answer requests of `kind` (a `pb.DhtKind`) with `handler`."""
        self._handlers[kind] = handler

    async def open(self) -> None:
        await self.p2p.add_protobuf_handler(HANDLER, self._handle, pb.DhtMessage, stream_input=True,
                                            stream_output=True)
        await self.p2p.add_binary_stream_handler(links.LINK, self._serve_link)

    async def close(self) -> None:
        for link in self._links.values():
            link.close()
        for writer in self._served:  # its handler then reads the end of the link and returns (a cancelled one
            writer.close()            # would be logged as an error by asyncio's stream server)
        await self.p2p.remove_binary_stream_handler(links.LINK)
        await self.p2p.remove_protobuf_handler(HANDLER, stream_input=True, stream_output=True)

    @staticmethod
    async def _ping(head: pb.DhtMessage, data: bytes | None) -> Reply:
        return Reply()

    # -- messages --------------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """This peer's libp2p peer id."""
        return str(self.p2p.peer_id)

    def has_link(self, address: str) -> bool:
        """Whether this peer holds a usable link to `address` (it called that peer before)."""
        link = self._links.get(address)
        return link is not None and link.usable

    async def call(self, address: str, kind: pb.DhtKind, round: int, *, timeout_s: float,
                   data: bytes | None = None, **fields: Any) -> tuple[pb.DhtMessage, bytes]:
        """One request to a peer and its reply; returns (the first reply, the reply's data: b"" for a reply
        without parts). The request goes over this peer's link to `address` (opened at the first call), or,
        for parameters and pings, over a stream of its own. A part's receipt, which comes on a link before
        its reply, is timed into `uploads`."""
        max_bytes = wire_params.MAX_PARAMETER_BYTES if kind == pb.DHT_KIND_PARAMS else wire.DEFAULT_MAX_BYTES
        parts = wire.Reassembler(max_bytes=max_bytes)
        first: pb.DhtMessage | None = None
        whole: bytes | None = None

        async def take(msg: pb.DhtMessage) -> bool:
            """Check and keep one reply message; True once the reply is complete."""
            nonlocal first, whole
            if link is None:
                why = self._check(msg) or await self._check_sender(msg, unknown_ok=kind == pb.DHT_KIND_PING)
            else:  # the link's hello bound it to the peer that answered it
                why = self._check(msg) or _sent_as(msg, link.peer)
            if why:
                raise PeerUnavailable(f"refused a reply: {why}")
            if msg.kind == pb.DHT_KIND_RECEIVED:  # the whole part was read: its reply comes later
                if kind == pb.DHT_KIND_PART and first is None:
                    self.uploads.receipt(round, address, len(data or b""), time.perf_counter() - started)
                return False
            first = first or msg
            if msg.error:
                raise PeerUnavailable(f"refused: {msg.error}")
            if not msg.HasField("part"):
                return True
            whole = parts.add(msg.part)
            return whole is not None

        link: links.Link | None = None
        started = 0.0
        try:
            async with asyncio.timeout(timeout_s):
                if kind in _OWN_STREAM:
                    requests = self._messages(kind, round, data, **fields)

                    async def send() -> AsyncIterator[pb.DhtMessage]:
                        for msg in requests:
                            yield msg

                    stream = await self.p2p.iterate_protobuf_handler(PeerID.from_base58(address), HANDLER, send(),
                                                                     pb.DhtMessage)
                    async for msg in stream:
                        if await take(msg):
                            break
                else:
                    link = await self._link(address, round)
                    call, replies = link.open_call()
                    try:
                        started = time.perf_counter()
                        await link.send(self._messages(kind, round, data, call=call, **fields))
                        while (msg := await replies.get()) is not None and not await take(msg):
                            pass
                    finally:
                        link.end_call(call)
        except TimeoutError:
            if link is not None:  # a link that lets a call time out may be dead: the next call opens another
                link.retire()
            raise NoAnswer(f"no answer within {timeout_s:.1f} s") from None
        except (PeerUnavailable, InvalidPayload):
            raise
        except Exception as e:  # hivemind's P2P raises its own errors (daemon, handler, connection) for a lost peer
            raise PeerUnavailable(f"{type(e).__name__}: {e}") from None
        if first is None:
            raise PeerUnavailable("the stream ended without an answer")
        if first.HasField("part") and whole is None:
            raise PeerUnavailable("the reply stream ended before its payload was whole")
        return first, whole or b""

    async def _link(self, address: str, round: int) -> links.Link:
        """This peer's link to `address`: the open one, or a new one, bound by its hello (`_hello`)."""
        link = self._links.get(address)
        if link is not None and link.usable:
            return link
        async with self._opening.setdefault(address, asyncio.Lock()):  # one link opened at a time per peer
            link = self._links.get(address)
            if link is None or not link.usable:
                _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(address), links.LINK)
                link = links.Link(address, reader, writer)
                try:
                    link.peer = await self._hello(link, round)
                except BaseException:
                    link.close()
                    raise
                self._links[address] = link
                self.links_opened += 1
            return link

    async def _hello(self, link: links.Link, round: int) -> str:
        """A new link's first call: this peer's hello, signed for the link, and the callee's signed reply.
        Returns the callee's peer id, whose key signed the reply: the link's later replies count for it
        unsigned (libp2p's secure channel keeps them from anyone else), and the callee takes this peer's
        later calls on it the same way.

        Raises:
            PeerUnavailable: the callee refused the hello, or its reply is not signed for this link.
        """
        ends = (self.address, link.address)
        call, replies = link.open_call()
        try:
            await link.send([self._message(pb.DHT_KIND_HELLO, round, call=call, link=ends)])
            reply = await replies.get()
        finally:
            link.end_call(call)
        if reply is None:
            raise PeerUnavailable("the link closed before its hello was answered")
        why = self._check(reply) or await self._check_sender(reply, unknown_ok=False, link=ends)
        if why:
            raise PeerUnavailable(f"refused a reply: {why}")
        if reply.error:
            raise PeerUnavailable(f"refused: {reply.error}")
        return reply.sender

    async def answer(self, head: pb.DhtMessage, data: bytes | None, call: int = 0
                      ) -> tuple[list[pb.DhtMessage], Callable[[], Awaitable[None]] | None]:
        """The reply to a whole request (its first message, its payload) from its kind's handler, and what to
        call once the reply went out (`links.Served`)."""
        r = head.round
        handler = self._handlers.get(head.kind)
        reply = await handler(head, data) if handler is not None else Reply(error=f"unknown request kind {head.kind}")
        if reply.error:
            return [self._message(pb.DHT_KIND_REPLY, r, error=reply.error, call=call)], None
        return self._messages(pb.DHT_KIND_REPLY, r, reply.data, call=call, **reply.fields), reply.sent

    async def _handle(self, requests: AsyncIterator[pb.DhtMessage], context: P2PContext
                      ) -> AsyncIterator[pb.DhtMessage]:
        """Serve one stream: check every message, read the request to its end, answer with its kind's handler."""
        head: pb.DhtMessage | None = None
        parts = wire.Reassembler()  # only a PART request carries parts: a payload slice
        data: bytes | None = None
        async for msg in requests:
            why = self._check(msg) or await self._check_sender(msg, unknown_ok=msg.kind == pb.DHT_KIND_PING)
            if not why and msg.HasField("part"):
                try:
                    data = parts.add(msg.part)  # None until whole; a part after that raises
                except InvalidPayload as e:
                    why = f"bad part: {e}"
            if why:
                self._refuse(msg.sender, msg.round, context.remote_id, why)
                # Read what the caller still sends (a bounded number of messages) before answering: a
                # stream closed early breaks the caller's pipe, and the refusal would never reach it.
                drained = 0
                async for _ in requests:
                    drained += 1
                    if drained >= _MAX_DRAIN:
                        break
                yield self._message(pb.DHT_KIND_REPLY, msg.round, error=why)
                return
            head = head or msg  # read to the end of the stream: closing early breaks the caller's pipe
        if head is None:
            return
        r = head.round
        if head.HasField("part") and data is None:
            yield self._message(pb.DHT_KIND_REPLY, r, error="the request's payload is not whole")
            return
        msgs, sent = await self.answer(head, data)
        for msg in msgs:
            yield msg
        if sent is not None:
            await sent()

    async def _serve_link(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve a link another peer opened (`links.serve`): each message checked as `_handle` checks it."""
        self._served.add(writer)
        try:
            await links.serve(self, info.peer_id, reader, writer)
        finally:
            self._served.discard(writer)

    async def hello(self, msg: pb.DhtMessage, remote: object) -> tuple[pb.DhtMessage, str | None]:
        """`links.Served`: the answer to a link's first message, and the peer id it binds the link to (None:
        refused, counted and logged). It must be a hello signed for this link by the key of its sender."""
        link = (str(remote), self.address)
        why = (self._check(msg) or ("" if msg.kind == pb.DHT_KIND_HELLO else "a link's first call is not a hello")
               or await self._check_sender(msg, unknown_ok=False, link=link))
        if why:
            self._refuse(msg.sender, msg.round, remote, why)
            return self._message(pb.DHT_KIND_REPLY, msg.round, error=why, call=msg.call, link=link), None
        return self._message(pb.DHT_KIND_REPLY, msg.round, call=msg.call, link=link), msg.sender

    async def refusal(self, msg: pb.DhtMessage, why: str, remote: object, call: int, sender: str
                      ) -> pb.DhtMessage | None:
        """`links.Served`: why `msg`, on a link bound to `sender`, is refused ('' if it is good); a refusal
        is counted, logged and answered."""
        why = why or self._check(msg) or _sent_as(msg, sender)
        if not why:
            return None
        self._refuse(msg.sender, msg.round, remote, why)
        return self._message(pb.DHT_KIND_REPLY, msg.round, error=why, call=call)

    def receipt(self, head: pb.DhtMessage, call: int) -> pb.DhtMessage:
        """`links.Served`: the caller's whole part was read here."""
        return self._message(pb.DHT_KIND_RECEIVED, head.round, call=call)

    def failure(self, head: pb.DhtMessage, call: int, error: Exception) -> pb.DhtMessage:
        """`links.Served`: the answer to a request whose handler raised (a bug: logged)."""
        logger.warning("[%s] a request of kind %d, round %d, failed: %r", self.peer_id, head.kind, head.round, error)
        return self._message(pb.DHT_KIND_REPLY, head.round, error="the handler failed", call=call)


def _sent_as(msg: pb.DhtMessage, sender: str | None) -> str:
    """Why a message on a link that its hello bound to `sender` is refused ('' if it is good)."""
    if msg.kind == pb.DHT_KIND_HELLO:
        return "a second hello on one link"
    if msg.sender != sender:
        return f"sent as {msg.sender!r} on a link bound to {sender!r}"
    return ""
