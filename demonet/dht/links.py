"""Links: one long-lived libp2p stream from a peer to another that carries all of its calls to it.

Net layer under demonet.dht.streams, which signs, checks and dispatches the messages; this module only
frames them and routes replies to their calls. A stream opened per call costs a negotiation through both
peers' p2pd daemons and a new connection to each daemon: about 2 ms of CPU a call on loopback
(`bench/dht_links.py`), and a round trip on a slow link. A link is opened once, at the first call to a
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

from google.protobuf.message import DecodeError

from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload

__all__ = ["LINK", "MAX_FRAME_BYTES", "Link", "frame", "read_frame"]

logger = logging.getLogger(__name__)

LINK = "demonet.dht.link.v1"
"""The libp2p protocol of links (one call per stream: `demonet.dht.streams.HANDLER`)."""
MAX_FRAME_BYTES = (1 << 20) + (1 << 16)
"""A message's largest serialized size: a 1 MiB `PayloadPart` and its header fields."""
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


class Link:
    """The calling end of one link: sends a call's messages, and routes each reply to its call by id.

    `open_call` gives a call id and the queue its replies arrive on (None once the link closed);
    `end_call` forgets it. A link is `usable` until its remote end closes or `retire` is called (a call
    on it timed out: the link may be dead without the socket knowing); a retired link closes once its
    last call ended.
    """

    def __init__(self, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.address = address
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
        """Write a call's messages, together (the calls' messages do not interleave within a send)."""
        data = b"".join(frame(m) for m in msgs)
        async with self._sending:
            self._writer.write(data)
            await self._writer.drain()

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
