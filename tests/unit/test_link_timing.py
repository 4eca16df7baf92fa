"""A link's server times each request's parts as they come in (`links.serve`, `DhtMessage.received_s`): a DHT peer
cannot time its own upload through its daemon's buffers, so the owner that reads its part says how long it took.

Over a real TCP connection on loopback, with the link's own framing; the peer that answers is a small stand-in for
`demonet.dht.streams.Streams` (which the DHT process tests run for real) that records what `serve` hands it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.dht import links


class _Recorder:
    """A `links.Served` that takes every hello and request, and answers each request with an empty reply."""

    def __init__(self) -> None:
        self.answered: dict[int, tuple[bytes | None, float]] = {}  # call -> (its data, its received_s)

    async def hello(self, msg: pb.DhtMessage, remote: object) -> tuple[pb.DhtMessage, str | None]:
        return pb.DhtMessage(kind=pb.DHT_KIND_REPLY, call=msg.call), msg.sender

    async def refusal(self, msg: pb.DhtMessage, why: str, remote: object, call: int, sender: str
                      ) -> pb.DhtMessage | None:
        return pb.DhtMessage(kind=pb.DHT_KIND_REPLY, call=call, error=why) if why else None

    async def answer(self, head: pb.DhtMessage, data: bytes | None, call: int, received_s: float = 0.0
                     ) -> tuple[list[pb.DhtMessage], Callable[[], Awaitable[None]] | None]:
        self.answered[call] = (data, received_s)
        return [pb.DhtMessage(kind=pb.DHT_KIND_REPLY, call=call)], None

    def failure(self, head: pb.DhtMessage, call: int, error: Exception) -> pb.DhtMessage:
        raise AssertionError(f"a request failed: {error!r}")


def _part_call(call: int, data: bytes, part_bytes: int) -> bytes:
    """The framed messages of one PART call carrying `data`."""
    return b"".join(links.frame(pb.DhtMessage(kind=pb.DHT_KIND_PART, call=call, sender="a", part=part))
                    for part in wire.split(data, part_bytes=part_bytes))


async def _served(sends: list[tuple[bytes, float]], calls: int) -> dict[int, tuple[bytes | None, float]]:
    """Serve one link on loopback; the client writes each (bytes, then sleeps seconds) in turn, then reads the
    replies of its `calls` requests. Returns what the server's peer was handed."""
    peer = _Recorder()
    server = await asyncio.start_server(lambda r, w: links.serve(peer, "remote", r, w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(links.frame(pb.DhtMessage(kind=pb.DHT_KIND_HELLO, call=1, sender="a")))
        assert (await links.read_frame(reader)).call == 1
        for data, sleep_s in sends:
            writer.write(data)
            await writer.drain()
            await asyncio.sleep(sleep_s)
        replies = [await asyncio.wait_for(links.read_frame(reader), 10) for _ in range(calls)]
        assert sorted(r.call for r in replies) == sorted(peer.answered), (replies, peer.answered)
        return peer.answered
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


async def test_a_part_that_comes_in_slowly_is_timed_from_its_length_to_its_last_byte() -> None:
    data = bytes(range(256)) * 40
    framed = _part_call(2, data, part_bytes=len(data))  # one message
    # The frame's length and half of it, then the rest 0.3 s later: the server read it over 0.3 s.
    answered = await _served([(framed[:len(framed) // 2], 0.3), (framed[len(framed) // 2:], 0.0)], calls=1)
    got, received_s = answered[2]
    assert got == data
    assert 0.28 <= received_s < 2.0, received_s


async def test_a_request_in_several_parts_is_timed_from_its_first_part_and_a_quick_one_near_zero() -> None:
    data = bytes(range(256)) * 40
    first, rest = _part_call(3, data, part_bytes=4000), _part_call(4, data, part_bytes=len(data))
    cut = len(links.frame(pb.DhtMessage(kind=pb.DHT_KIND_PART, call=3, sender="a",
                                        part=wire.split(data, part_bytes=4000)[0])))
    # Call 3: its first part, 0.3 s of nothing, its other two. Call 4 at once, whole: read in no time.
    answered = await _served([(first[:cut], 0.3), (first[cut:] + rest, 0.0)], calls=2)
    assert answered[3][0] == data and answered[4][0] == data
    assert 0.28 <= answered[3][1] < 2.0, answered
    assert answered[4][1] < 0.1, answered
