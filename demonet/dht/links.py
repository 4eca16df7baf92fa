"""Links: one long-lived libp2p stream from a peer to another that carries all of its calls to it.

Net layer under demonet.dht.streams, which signs and checks the messages and answers the requests; this
module frames them, routes replies to their calls (`Link`), and serves the links other peers open
(`serve`). A stream opened per call costs a negotiation through both
peers' p2pd daemons and a new connection to each daemon: about 2 ms of CPU a call on loopback
(measured: docs/decisions/README.md), and a round trip on a slow link. A link is opened once, at the first call to a
peer; each message on it is framed by its length and names its call (`DhtMessage.call`), so that several
calls run on one link at once and their replies come back in any order. A link whose remote end closes
fails the calls still waiting on it; one that lets a call time out takes no new call. Either way the
next call opens a new link.

Must not import grpc, demonet.transport.grpc or the round components.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from google.protobuf.message import DecodeError

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload

__all__ = ["LINK", "MAX_FRAME_BYTES", "Link", "Served", "frame", "read_frame", "serve"]

logger = logging.getLogger(__name__)

LINK = "demonet.dht.link.v3"
"""The libp2p protocol of links (one call per stream: `demonet.dht.streams.HANDLER`); v3: a part's receipt
(`DHT_KIND_RECEIVED`) before its reply; v2: links bound by a hello."""
MAX_FRAME_BYTES = (1 << 20) + (1 << 16)
"""A message's largest serialized size: a 1 MiB `PayloadPart` and its header fields."""
MAX_OPEN_CALLS = 256
"""Calls on one link whose request is not whole yet; a call past that is refused."""
_LENGTH_BYTES = 4


def frame(msg: pb.DhtMessage) -> bytes:
    """`msg` as it travels on a link: its serialized length (4 bytes, big-endian), then the message."""
    body = msg.SerializeToString()
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"a message of {len(body)} bytes is over the link's {MAX_FRAME_BYTES}")
    return len(body).to_bytes(_LENGTH_BYTES, "big") + body


async def read_frame(reader: asyncio.StreamReader) -> pb.DhtMessage:
    """The next message on a link.

    Raises:
        asyncio.IncompleteReadError: the link closed.
        InvalidPayload: a length over `MAX_FRAME_BYTES`, or bytes that are not a `DhtMessage`.
    """
    size = int.from_bytes(await reader.readexactly(_LENGTH_BYTES), "big")
    if size > MAX_FRAME_BYTES:
        raise InvalidPayload(f"a frame of {size} bytes is over the link's {MAX_FRAME_BYTES}")
    msg = pb.DhtMessage()
    try:
        msg.ParseFromString(await reader.readexactly(size))
    except DecodeError as e:
        raise InvalidPayload(f"a frame that is not a DhtMessage: {e}") from None
    return msg


async def send(writer: asyncio.StreamWriter, lock: asyncio.Lock, msgs: list[pb.DhtMessage]) -> None:
    """Write one call's messages on a link, together: `lock` keeps the calls' messages from interleaving."""
    data = b"".join(frame(m) for m in msgs)
    async with lock:
        writer.write(data)
        await writer.drain()


class Link:
    """The calling end of one link: sends a call's messages, and routes each reply to its call by id.

    `open_call` gives a call id and the queue its replies arrive on (None once the link closed);
    `end_call` forgets it. A link is `usable` until its remote end closes or `retire` is called (a call
    on it timed out: the link may be dead without the socket knowing); a retired link closes once its
    last call ended.
    """

    def __init__(self, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.address = address
        self.peer: str | None = None
        """The callee's peer id, once its reply to the link's hello bound the link to it."""
        self._reader, self._writer = reader, writer
        self._calls: dict[int, asyncio.Queue[pb.DhtMessage | None]] = {}
        self._last_call = 0
        self._sending = asyncio.Lock()
        self.usable = True
        self._reading = asyncio.create_task(self._read())

    def open_call(self) -> tuple[int, asyncio.Queue[pb.DhtMessage | None]]:
        self._last_call += 1
        queue: asyncio.Queue[pb.DhtMessage | None] = asyncio.Queue()
        if not self.usable:
            queue.put_nowait(None)
        self._calls[self._last_call] = queue
        return self._last_call, queue

    def end_call(self, call: int) -> None:
        self._calls.pop(call, None)
        if not self.usable and not self._calls:
            self.close()

    async def send(self, msgs: list[pb.DhtMessage]) -> None:
        """Write a call's messages, together."""
        await send(self._writer, self._sending, msgs)

    def retire(self) -> None:
        """Take no new call; close once the calls on it ended."""
        self.usable = False
        if not self._calls:
            self.close()

    def close(self) -> None:
        self.usable = False
        self._reading.cancel()
        with contextlib.suppress(Exception):  # the daemon's socket may be gone already
            self._writer.close()

    async def _read(self) -> None:
        try:
            while True:
                msg = await read_frame(self._reader)
                queue = self._calls.get(msg.call)
                if queue is not None:  # a reply to a call that gave up (timed out) is dropped
                    queue.put_nowait(msg)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except InvalidPayload as e:
            logger.warning("the link to %s sent a bad frame, closing it: %s", self.address, e)
        finally:
            self.usable = False
            for queue in self._calls.values():
                queue.put_nowait(None)
            with contextlib.suppress(Exception):
                self._writer.close()


class Served(Protocol):
    """What `serve` asks of the peer it serves for (`demonet.dht.streams.Streams`)."""

    async def hello(self, msg: pb.DhtMessage, remote: object) -> tuple[pb.DhtMessage, str | None]:
        """The answer to a link's first message, and the peer id it binds the link to (None: refused)."""

    async def refusal(self, msg: pb.DhtMessage, why: str, remote: object, call: int, sender: str
                      ) -> pb.DhtMessage | None:
        """None if `msg`, on a link bound to `sender`, is good (and `why` empty), else the error reply to send
        (the refusal counted and logged)."""

    async def answer(self, head: pb.DhtMessage, data: bytes | None, call: int
                      ) -> tuple[list[pb.DhtMessage], Callable[[], Awaitable[None]] | None]:
        """The reply to a whole request, and what to call once it went out."""

    def receipt(self, head: pb.DhtMessage, call: int) -> pb.DhtMessage:
        """The message that tells the caller its whole part was read here (its reply comes once answered)."""

    def failure(self, head: pb.DhtMessage, call: int, error: Exception) -> pb.DhtMessage:
        """The error reply to a request whose handler raised."""


async def serve(peer: Served, remote: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Serve a link another peer opened until it closes: check each message, gather a request's parts, and
    answer each whole request as soon as its handler is done (several at once). The first message must
    be a hello that binds the link to its sender (`Served.hello`); a link whose first message is refused
    ends after the refusal is sent. A later refused message is answered with the refusal, and the rest of
    its call is dropped unread; the link goes on (as another stream would). A bad frame ends the link.
    A request with parts (a `PART`) is acknowledged as soon as its last part is read (`Served.receipt`),
    before its handler answers: the caller times its upload by it, not by the answer, which an owner gives
    only once every member's part is in."""
    sending = asyncio.Lock()
    pending: dict[int, tuple[pb.DhtMessage, wire.Reassembler]] = {}  # call -> (its first message, its parts)
    answering: set[asyncio.Task[None]] = set()
    refused: set[int] = set()  # calls refused (their further messages are dropped), the latest ones

    async def answer(call: int, head: pb.DhtMessage, data: bytes | None) -> None:
        try:
            msgs, sent = await peer.answer(head, data, call)
        except Exception as e:  # a handler's bug: the caller gets an error, the link goes on  # noqa: BLE001
            msgs, sent = [peer.failure(head, call, e)], None
        with contextlib.suppress(ConnectionError, OSError):  # the caller went away: nothing to answer
            await send(writer, sending, msgs)
            if sent is not None:
                await sent()

    try:
        msg = await read_frame(reader)
        reply, sender = await peer.hello(msg, remote)
        await send(writer, sending, [reply])
        if sender is None:
            return
        while True:
            msg = await read_frame(reader)
            if msg.call in refused:
                continue
            head, data, why = msg, None, ""
            if msg.HasField("part") and msg.call not in pending and len(pending) >= MAX_OPEN_CALLS:
                why = f"more than {MAX_OPEN_CALLS} calls open on one link"
            refusal = await peer.refusal(msg, why, remote, msg.call, sender)
            if refusal is None and msg.HasField("part"):
                head, parts = pending.setdefault(msg.call, (msg, wire.Reassembler()))
                try:
                    data = parts.add(msg.part)  # None until whole; a part after that raises
                except InvalidPayload as e:
                    refusal = await peer.refusal(msg, f"bad part: {e}", remote, msg.call, sender)
                if refusal is None and data is None:
                    continue
                pending.pop(msg.call, None)
                if refusal is None and head.kind == pb.DHT_KIND_PART:
                    # Written at once, past the lock: a reply draining on a slow uplink would delay it.
                    with contextlib.suppress(ConnectionError, OSError):
                        writer.write(frame(peer.receipt(head, msg.call)))
            if refusal is not None:
                pending.pop(msg.call, None)
                if len(refused) >= MAX_OPEN_CALLS:
                    refused.clear()
                refused.add(msg.call)
                await send(writer, sending, [refusal])
                continue
            answering.add(task := asyncio.create_task(answer(msg.call, head, data)))
            task.add_done_callback(answering.discard)
    except (asyncio.IncompleteReadError, ConnectionError, OSError):
        pass  # the caller closed the link
    except InvalidPayload as e:
        logger.warning("a link from %s sent a bad frame, closing it: %s", remote, e)
    finally:
        for task in answering:
            task.cancel()
        with contextlib.suppress(Exception):
            writer.close()
