"""The attackers of bench/attacks.py, each a coroutine that a token holder could run against a coordinator.

- `flood`: raw HTTP/2 Submit streams, each sending one gRPC message one byte short of what it declares;
  `streams` keeps such floods going from several source addresses for a window;
- `aggregates`: unsigned GetAggregate calls in a loop;
- `sybil`: a fresh peer id with a fresh key every round (Challenge, Join, heartbeats, never a payload);
- `replays`: an attacker-owned member's signed Heartbeat, GetParameters, GetAggregate and Leave, each sent
  twice (the same bytes), and a Leave of the session before its rejoin: how many copies the coordinator took.
Imported by bench/attacks.py (bench/ is its script folder); not a script of its own.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demonet._proto import demonet_pb2 as pb  # noqa: E402
from demonet._proto import demonet_pb2_grpc as pbg  # noqa: E402
from demonet.wire.identity import Identity  # noqa: E402
from demonet.wire.signed import (  # noqa: E402
    aggregate_request,
    heartbeat_request,
    join_request,
    leave_request,
    parameters_request,
)

_SUBMIT = "/demonet.v1.Coordinator/Submit"
_FRAME = 16384  # HTTP/2's default largest frame


def _int(value: int, prefix_bits: int) -> bytes:
    """An HPACK integer with a `prefix_bits` prefix (RFC 7541 5.1), its first byte's flags zero."""
    most = (1 << prefix_bits) - 1
    if value < most:
        return bytes([value])
    out, value = [most], value - most
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes([*out, value])


def _headers(authority: str, token: str) -> bytes:
    """A Submit call's request headers as HPACK literals without indexing (no table, no Huffman)."""
    fields = [(":method", "POST"), (":scheme", "http"), (":path", _SUBMIT), (":authority", authority),
              ("content-type", "application/grpc"), ("te", "trailers"), ("authorization", f"Bearer {token}")]
    return b"".join(b"\0" + _int(len(k), 7) + k.encode() + _int(len(v), 7) + v.encode() for k, v in fields)


def _frame(kind: int, flags: int, stream: int, body: bytes) -> bytes:
    return struct.pack(">I", len(body))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + body


async def flood(address: str, token: str, *, streams: int, declared: int, hold_s: float,
                source: str = "127.0.0.2") -> dict[str, Any]:
    """Open `streams` Submit streams on one connection from `source`, each sending a message of `declared`
    bytes less one, as fast as HTTP/2 flow control lets it; hold them for `hold_s`. Returns how each ended
    (a response = refused or answered, a reset, a GOAWAY) and the bytes the server took."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    ids = [1 + 2 * i for i in range(streams)]
    writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b""))
    for sid in ids:
        writer.write(_frame(1, 4, sid, _headers(address, token)))  # HEADERS, END_HEADERS
    window = {0: 65535, **dict.fromkeys(ids, 65535)}
    left = dict.fromkeys(ids, declared - 1 + 5)
    ended: dict[int, tuple[str, float]] = {}
    began, sent = time.monotonic(), 0
    wake = asyncio.Event()

    async def read() -> None:
        initial = 65535
        while True:
            head = await reader.readexactly(9)
            size, kind, flags, sid = int.from_bytes(head[:3], "big"), head[3], head[4], \
                int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
            body = await reader.readexactly(size)
            if kind == 4 and not flags & 1:  # SETTINGS: take INITIAL_WINDOW_SIZE, acknowledge
                for i in range(0, len(body), 6):
                    key, value = struct.unpack(">HI", body[i:i + 6])
                    if key == 4:
                        for s in ids:
                            window[s] += value - initial
                        initial = value
                writer.write(_frame(4, 1, 0, b""))
            elif kind == 8:  # WINDOW_UPDATE
                window[sid] = window.get(sid, 0) + int.from_bytes(body, "big")
            elif kind == 6 and not flags & 1:  # PING
                writer.write(_frame(6, 1, 0, body))
            elif kind == 1 and sid not in ended:
                ended[sid] = ("response", time.monotonic() - began)
            elif kind == 3 and sid not in ended:
                ended[sid] = ("reset", time.monotonic() - began)
            elif kind == 7:
                for s in ids:
                    ended.setdefault(s, ("goaway", time.monotonic() - began))
                return
            wake.set()

    reading = asyncio.create_task(read())
    try:
        while time.monotonic() - began < hold_s and len(ended) < len(ids) and not reading.done():
            for sid in ids:
                while left[sid] and sid not in ended and min(window[sid], window[0]) > 0:
                    n = min(left[sid], window[sid], window[0], _FRAME)
                    first = left[sid] == declared - 1 + 5
                    body = (b"\0" + struct.pack(">I", declared) + bytes(n - 5)) if first else bytes(n)
                    writer.write(_frame(0, 0, sid, body))
                    window[sid] -= n
                    window[0] -= n
                    left[sid] -= n
                    sent += n
            await writer.drain()
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), 0.2)
            except TimeoutError:
                pass
    except (ConnectionError, OSError):
        pass
    finally:
        reading.cancel()
        writer.close()
    kinds: dict[str, int] = {}
    for sid in ids:
        kind = ended.get(sid, ("open", 0.0))[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    last = max((t for _, t in ended.values()), default=None)
    return {"streams": streams, "ended": kinds, "last_ended_s": last, "bytes_sent": sent,
            "seconds": time.monotonic() - began}


async def aggregates(address: str, token: str, *, seconds: float, calls_at_once: int = 8) -> dict[str, Any]:
    """Unsigned GetAggregate calls of the open round, `calls_at_once` at a time, for `seconds`: the codes and
    the aggregate bytes served."""
    codes: dict[str, int] = {}
    served = 0
    md = (("authorization", f"Bearer {token}"),)
    async with grpc.aio.insecure_channel(address) as channel:
        stub: Any = pbg.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        end = time.monotonic() + seconds

        async def one() -> None:
            nonlocal served
            while time.monotonic() < end:
                status = await stub.Status(pb.StatusRequest(), metadata=md, timeout=10)
                try:
                    async for chunk in stub.GetAggregate(pb.AggregateRequest(peer_id="p1", round=max(
                            0, status.round - 1)), metadata=md, timeout=10):
                        served += len(chunk.part.data)
                    code = "OK"
                except grpc.aio.AioRpcError as e:
                    code = e.code().name
                codes[code] = codes.get(code, 0) + 1

        await asyncio.gather(*(one() for _ in range(calls_at_once)))
    return {"codes": codes, "bytes_served": served}




async def streams(address: str, token: str, *, seconds: float, declared: int, addresses: int = 8,
                  per_address: int = 8) -> dict[str, Any]:
    """`flood`s from `addresses` source addresses (127.0.0.2 on), `per_address` streams each, one after another
    on each address for `seconds`: every stream declares `declared` bytes (the server's largest message holds
    the most). How the streams ended, summed."""
    end = time.monotonic() + seconds
    ended: dict[str, int] = {}
    sent = 0

    async def one(source: str) -> None:
        nonlocal sent
        while time.monotonic() < end - 0.05:
            got = await flood(address, token, streams=per_address, declared=declared,
                              hold_s=end - time.monotonic(), source=source)
            sent += got["bytes_sent"]
            for kind, n in got["ended"].items():
                ended[kind] = ended.get(kind, 0) + n

    await asyncio.gather(*(one(f"127.0.0.{2 + i}") for i in range(addresses)))
    return {"declared": declared, "ended": ended, "bytes_sent": sent}


class _Caller:
    """One channel to the coordinator with the run token, and how each call ended (by status code)."""

    def __init__(self, address: str, token: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub: Any = pbg.CoordinatorStub(self.channel)  # type: ignore[no-untyped-call]
        self.md = (("authorization", f"Bearer {token}"),)

    async def code(self, method: str, request: Any) -> str:
        """Call `method` with `request` (a streamed reply read to its end): "OK" or the status code's name."""
        try:
            reply = getattr(self.stub, method)(request, metadata=self.md, timeout=10)
            if method.startswith("Get"):
                async for _ in reply:
                    pass
            else:
                await reply
            return "OK"
        except grpc.aio.AioRpcError as e:
            return e.code().name

    async def join(self, identity: Identity, peer_id: str) -> pb.JoinReply:
        challenge = await self.stub.Challenge(pb.ChallengeRequest(peer_id=peer_id, public_key=identity.public),
                                              metadata=self.md, timeout=10)
        reply: pb.JoinReply = await self.stub.Join(join_request(identity, peer_id, challenge.nonce),
                                                   metadata=self.md, timeout=10)
        return reply

    async def round(self) -> int:
        return int((await self.stub.Status(pb.StatusRequest(), metadata=self.md, timeout=10)).round)


async def sybil(address: str, token: str, *, seconds: float, prefix: str = "") -> dict[str, Any]:
    """For `seconds`: a new id (`prefix`-N) with a new key each round, joined and then heartbeated every
    `heartbeat_interval_s` the coordinator announces, never a payload; at the end each one leaves. The ids
    joined, the joins refused (by code) and the heartbeats answered "no member"."""
    caller, end = _Caller(address, token), time.monotonic() + seconds
    prefix = prefix or f"sybil-{os.getpid()}"  # ids of its own: an earlier attacker's may still be bound
    ids: list[tuple[str, Identity, bytes, list[int]]] = []  # id, key, session, [its last counter]
    refused: dict[str, int] = {}
    beats = not_member = 0
    last_round, interval_s = -1, 2.0

    def signed(make: Callable[..., Any], peer_id: str, identity: Identity, session: bytes, counter: list[int]) -> Any:
        counter[0] += 1
        return make(identity, session, peer_id, max(last_round, 0), counter[0])

    async def beat_all() -> None:
        nonlocal beats, not_member
        while True:
            await asyncio.sleep(interval_s)
            for one in list(ids):
                try:
                    reply = await caller.stub.Heartbeat(signed(heartbeat_request, *one), metadata=caller.md,
                                                        timeout=10)
                    beats += 1
                    not_member += not reply.member
                except grpc.aio.AioRpcError:
                    not_member += 1

    beating = asyncio.create_task(beat_all())
    try:
        while time.monotonic() < end:
            round_ = await caller.round()
            if round_ != last_round:
                last_round, identity = round_, Identity.generate()
                peer_id = f"{prefix}-{len(ids) + sum(refused.values())}"
                try:
                    reply = await caller.join(identity, peer_id)
                    ids.append((peer_id, identity, reply.session, [0]))
                    interval_s = reply.heartbeat_interval_s or interval_s
                except grpc.aio.AioRpcError as e:
                    refused[e.code().name] = refused.get(e.code().name, 0) + 1
            await asyncio.sleep(0.02)
    finally:
        beating.cancel()
    for one in ids:  # leave, so that the window after starts without them
        await caller.code("Leave", signed(leave_request, *one))
    await caller.channel.close()
    return {"joined": len(ids), "refused": refused, "heartbeats": beats, "not_member": not_member}


_KINDS = ("Heartbeat", "GetParameters", "GetAggregate", "Leave", "Leave, the session before")


async def replays(address: str, token: str, *, seconds: float, peer_id: str = "") -> dict[str, Any]:
    """For `seconds`, about once a second: `peer_id` joins with its key (a new session each time), then sends
    each counted request of the session twice, the same bytes: Heartbeat, GetParameters, a signed GetAggregate
    and Leave; then, after its next join, the Leave of the session before. Per kind: the copies sent after
    the first ("replays") and how many of those the coordinator accepted, and how the first copies ended."""
    caller, identity, end = _Caller(address, token), Identity.generate(), time.monotonic() + seconds
    peer_id = peer_id or f"replayer-{os.getpid()}"  # an earlier attacker's id may still be bound to its key
    sent = dict.fromkeys(_KINDS, 0)
    accepted = dict.fromkeys(_KINDS, 0)
    firsts: dict[str, dict[str, int]] = {k: {} for k in _KINDS}
    stale: pb.LeaveRequest | None = None

    async def twice(kind: str, method: str, request: Any, *, first: bool = True) -> None:
        if first:
            code = await caller.code(method, request)
            firsts[kind][code] = firsts[kind].get(code, 0) + 1
        sent[kind] += 1
        accepted[kind] += await caller.code(method, request) == "OK"

    while time.monotonic() < end:
        t0 = time.monotonic()
        reply = await caller.join(identity, peer_id)
        session, round_ = reply.session, await caller.round()
        if stale is not None:
            await twice(_KINDS[4], "Leave", stale, first=False)
        await twice("Heartbeat", "Heartbeat", heartbeat_request(identity, session, peer_id, round_, 1))
        await twice("GetParameters", "GetParameters", parameters_request(identity, session, peer_id, reply.round, 2))
        await twice("GetAggregate", "GetAggregate", aggregate_request(identity, session, peer_id,
                                                                      max(0, round_ - 1), 3))
        stale = leave_request(identity, session, peer_id, round_, 4)
        await twice("Leave", "Leave", stale)
        await asyncio.sleep(max(0.0, 1.05 - (time.monotonic() - t0)))  # within the joins' rate of one id
    await caller.channel.close()
    return {"replays": sent, "accepted": accepted, "first_copies": firsts}
