"""The DHT-mode transport's libp2p side: options, record signing, and the signed stream messages.

Net layer, used by demonet.dht.node and the round components (board, exchange, donor): the validators
of DHT records (the run token's HMAC, the peer's Ed25519 signature), `DhtOptions`, and `Streams`, which
sends signed requests over hivemind's P2P and serves the requests other peers send to the handlers
registered with it. Must not import grpc, demonet.transport.grpc or the round components.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2PContext, PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload, PeerUnavailable
from demonet.wire import identity as ids
from demonet.wire import params as wire_params
from demonet.wire.merge import MergeRules

from . import keys, links, rules

__all__ = ["HANDLER", "VOUCHED", "DhtOptions", "HmacValidator", "KeyValidator", "NoAnswer", "Reply", "Streams", "now",
           "retry"]

logger = logging.getLogger(__name__)

HANDLER = "demonet.dht.v3"  # one call per stream; v3: messages signed by the sender's key; v2: PayloadPart messages
_PART_BYTES = 1 << 20
_MAC_BYTES = 32
_REPLAY_S = 600.0  # messages sent longer ago than this (by the sender's clock) are refused
_MAX_DRAIN = 64  # messages read after a refused one, so that the refusal reaches its sender
_OWN_STREAM = frozenset({pb.DHT_KIND_PARAMS, pb.DHT_KIND_PING})
"""Calls that get a stream of their own instead of a link: parameters (megabytes, which would hold up the
round's calls behind them) and pings (once per peer at start, where a refusal says the token is wrong)."""

VOUCHED: contextvars.ContextVar[tuple[str, bytes] | None] = contextvars.ContextVar("vouched", default=None)
"""(peer id, key) of the peer whose STORE call is being served: a link's hello, or the call's own signature,
proved that the call comes from it (`demonet.dht.node.DhtNode._serve_store`)."""


def now() -> float:
    """DHT time: the clock every peer's deadlines use."""
    return float(get_dht_time())


class HmacValidator(RecordValidatorBase):  # type: ignore[misc]
    """Signs every DHT record this node stores with an HMAC of the run token and refuses records without it.

    hivemind calls `validate` when another node asks this one to store a record and when a record
    comes back from a search, so a node without the token can neither place records on this
    node nor have its records read by this node's peer.
    """

    def __init__(self, token: bytes) -> None:
        self._token = token

    @staticmethod
    def _body(record: DHTRecord, value: bytes) -> bytes:
        return b"|".join([record.key, record.subkey, value, repr(float(record.expiration_time)).encode()])

    def sign_value(self, record: DHTRecord) -> bytes:
        return bytes(record.value) + rules.sign(self._token, self._body(record, record.value))

    def validate(self, record: DHTRecord) -> bool:
        value = bytes(record.value)
        if len(value) <= _MAC_BYTES:
            return False
        return rules.verify(self._token, self._body(record, value[:-_MAC_BYTES]), value[-_MAC_BYTES:])

    def strip_value(self, record: DHTRecord) -> bytes:
        return bytes(record.value)[:-_MAC_BYTES]


class KeyValidator(RecordValidatorBase):  # type: ignore[misc]
    """Signs this node's records with its peer's Ed25519 key and refuses records whose signature does not
    verify against the key named in their subkey (``<peer id>@<hex key>``, `keys.subkey`).

    Applied inside the run token's HMAC (a lower priority signs first and validates last), so a node
    without the token is refused before any signature is checked. A record of the peer `VOUCHED` names
    (its id and key), stored by that peer's own call, is taken without checking its signature: the call
    proved already that it comes from that peer, which could sign the record as well. The signature is
    kept with it, and every node that reads the record from this one checks it. Which key counts for a peer id is
    the reader's decision (`keys.KeyBook`), not the store's: a valid record of another key under an
    honest peer's id is stored beside the honest one, never over it, and its readers ignore it.
    """

    def __init__(self, identity: ids.Identity) -> None:
        self._identity = identity

    @property
    def priority(self) -> int:
        return -1

    def sign_value(self, record: DHTRecord) -> bytes:
        value = bytes(record.value)
        return value + self._identity.sign(keys.record_statement(record.key, record.subkey, value,
                                                                 record.expiration_time))

    def validate(self, record: DHTRecord) -> bool:
        value = bytes(record.value)
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # msgpack raises several types for bytes that are not one of its values
            return False
        claim = keys.parse_subkey(subkey) if isinstance(subkey, str) else None
        if claim is None or len(value) <= ids.SIGNATURE_BYTES:
            return False
        if claim == VOUCHED.get():
            return True
        body, signature = value[:-ids.SIGNATURE_BYTES], value[-ids.SIGNATURE_BYTES:]
        return ids.verify(claim[1], signature, keys.record_statement(record.key, record.subkey, body,
                                                                     record.expiration_time))

    def strip_value(self, record: DHTRecord) -> bytes:
        return bytes(record.value)[:-ids.SIGNATURE_BYTES]


@dataclass(frozen=True, kw_only=True)
class DhtOptions:
    """How a peer joins the DHT and runs rounds on it."""

    run: str
    """The run's DHT prefix: peers with the same prefix (and token) train together."""
    token: str
    """The run token: records and messages carry an HMAC keyed by it; it never travels."""
    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of peers already in the DHT (none: this peer starts a new DHT)."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    """Where this peer listens (TCP port 0: any free one)."""
    announce_maddrs: tuple[str, ...] = ()
    """Public multiaddrs to advertise instead of the listening ones (port forwarding)."""
    identity_path: str | None = None
    """Private key file of this peer's libp2p identity (created if missing): a stable peer id, so a
    bootstrap peer keeps its multiaddr across restarts. None: a new identity each start."""
    bootstrap_timeout_s: float = 60.0
    """How long to keep trying to reach the initial peers when starting."""
    client_mode: bool = False
    """Behind NAT: only dial out. Such a peer trains and sends, but owns no slice and donates nothing."""
    window_s: float = 30.0
    """A round freezes at most this long after its first announcement, without the peers not in by then."""
    exchange_timeout_s: float = 10.0
    """Each of the two exchange phases (parts to owners, merged slices back) ends this long after the previous."""
    settle_s: float = 0.2
    """Store latency allowed: a freeze at the deadline is read again this long after it."""
    start_peers: int = 1
    """The first round freezes once this many peers announced."""
    leave_after_s: float = 600.0
    """A member of the previous round not heard from for this long no longer counts in the base of a
    round's majority (docs/dht.md#the-majority-rule): a run that lost most of its peers goes on after it."""
    verify_fraction: float = 0.25
    """The fraction of each round's slices that a second owner merges as well (docs/dht.md#verified-slices)."""
    exclude_rounds: int = 20
    """Rounds an owner reported by a majority for a disagreeing slice owns no slice."""
    slice_entries: int = 4096
    """Entries of the aggregate per slice owner (`rules.owner_count`); 0: every dialable member owns a slice."""
    stack_slices: bool = True
    """Within a slice, the rows of all tensors with one chunk shape travel as one tensor (`rules.SlicePlan`).
    Off where the payloads' values carry one scale per tensor (`[optim] encoding = "fp16"`), which cannot
    be stacked. Every peer of a run must agree: `rules.stacks_slices` gives it from the run's encoding."""
    rules: MergeRules = field(default_factory=lambda: MergeRules(topk=32))
    """How a slice owner merges: the coordinator's rules (top-k, encoding, median-norm clipping, norm bound)."""
    allowed: Mapping[bytes, str | None] | None = None
    """With admission "allowlist": the keys whose records and messages count (key -> the one peer id it
    may use; None: any), read from `[net] allowlist` at start. None: any key that holds the token, each
    peer id pinned to the first key seen for it (docs/security.md)."""

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("token should be non-empty")
        if not self.run or "/" in self.run:
            raise ValueError("run should be a non-empty name without '/'")
        if self.window_s <= 0 or self.exchange_timeout_s <= 0 or self.settle_s < 0:
            raise ValueError("window_s and exchange_timeout_s should be > 0, settle_s >= 0")
        if self.start_peers < 1:
            raise ValueError("start_peers should be >= 1")
        if self.leave_after_s <= self.window_s:
            raise ValueError("leave_after_s should be > window_s")
        if not 0.0 <= self.verify_fraction <= 1.0 or self.exclude_rounds < 0:
            raise ValueError("verify_fraction should be in [0, 1] and exclude_rounds >= 0")
        if self.slice_entries < 0:
            raise ValueError(f"slice_entries should be >= 0 (0: every member owns a slice), got {self.slice_entries}")


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


class NoAnswer(PeerUnavailable):
    """A call that timed out: the peer is silent (cut off, or stalled), not gone (its stream did not break)."""


async def retry(attempt: Callable[[float], Awaitable[Any]], deadline: float) -> PeerUnavailable | InvalidPayload | None:
    """Run `attempt(timeout_s)` until it succeeds or `deadline` (DHT time) passes; returns the last
    error (None on success). A stream can break while both peers are fine, so one failure is not final."""
    delay_s = 0.05
    while True:
        try:
            await attempt(max(0.1, deadline - now()))
            return None
        except (PeerUnavailable, InvalidPayload) as e:
            error = e
        if now() + delay_s >= deadline:
            return error
        await asyncio.sleep(delay_s)
        delay_s = min(2 * delay_s, 0.5)


Resolve = Callable[[str, int], Awaitable[bytes | None]]
"""(a peer id, a round) -> its key, read from its DHT records of that round (None: none found)."""


class Streams:
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

    def _message(self, kind: int, round: int, *, link: tuple[str, str] | None = None, **fields: Any
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

    def _messages(self, kind: int, round: int, data: bytes | None, **fields: Any) -> list[pb.DhtMessage]:
        """One message without a part if `data` is None, else one message per part of `data`."""
        if data is None:
            return [self._message(kind, round, **fields)]
        return [self._message(kind, round, part=part, **fields) for part in wire.split(data, part_bytes=_PART_BYTES)]

    def _check(self, msg: pb.DhtMessage) -> str:
        """Why a message is refused ('' if it is good)."""
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

    async def call(self, address: str, kind: int, round: int, *, timeout_s: float, data: bytes | None = None,
                   **fields: Any) -> tuple[pb.DhtMessage, bytes]:
        """One request to a peer and its reply; returns (the first reply, the reply's data: b"" for a reply
        without parts). The request goes over this peer's link to `address` (opened at the first call), or,
        for parameters and pings, over a stream of its own."""
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
            first = first or msg
            if msg.error:
                raise PeerUnavailable(f"refused: {msg.error}")
            if not msg.HasField("part"):
                return True
            whole = parts.add(msg.part)
            return whole is not None

        link: links.Link | None = None
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
