"""Benchmark: what a token holder can make a coordinator hold, and whether the honest peers notice.

One `demonet coordinator` process and 2 real `demonet peer` processes train the tiny model on loopback. Once
they are in their rounds, each attack runs from its own process against the coordinator, and the table gives
the coordinator's RSS before and at its peak during the attack (sampled every 50 ms), how the attacker's calls
ended, and the honest rounds closed meanwhile:
- `streams`: raw HTTP/2 Submit streams, each sending one gRPC message declared one byte short of the 16 MiB
  the server read before (`--flood`: the attacker alone, from a source address of its own on loopback);
- `aggregates`: unsigned GetAggregate calls in a loop (`--aggregates`).
Run from the repo root: `python bench/attacks.py`. Prints a table; not a test. `--smoke`: fewer streams and
seconds, a check that the script runs. tests/integration/test_attacks.py runs the attackers alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demonet._proto import demonet_pb2 as pb  # noqa: E402
from demonet._proto import demonet_pb2_grpc as pbg  # noqa: E402

TOKEN = "attacks-token"
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


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _status(address: str) -> dict[str, Any]:
    async def ask() -> dict[str, Any]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub: Any = pbg.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
            reply = await stub.Status(pb.StatusRequest(detail=True), metadata=(("authorization", f"Bearer {TOKEN}"),),
                                      timeout=10)
            document: dict[str, Any] = json.loads(reply.detail_json)
            return document
    return asyncio.run(ask())


def _attack(argv: list[str], coordinator: subprocess.Popen[bytes], address: str) -> dict[str, Any]:
    """Run one attacker process to its end; the coordinator's peak RSS and the honest rounds closed meanwhile."""
    before, closed = _rss_mib(coordinator.pid), _status(address)["run"]["rounds_closed"]
    proc = subprocess.Popen([sys.executable, __file__, *argv, "--coordinator", address], stdout=subprocess.PIPE)
    peak = before
    while proc.poll() is None:
        peak = max(peak, _rss_mib(coordinator.pid))
        time.sleep(0.05)
    out = json.loads((proc.stdout.read() if proc.stdout else b"{}") or b"{}")
    after = _status(address)["run"]
    return {"rss_before_mib": before, "rss_peak_mib": peak, "out": out,
            "honest_rounds": after["rounds_closed"] - closed}


def _run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="attacks-"))
    (tmp / "run.toml").write_text("[model]\nd_model = 32\nn_layers = 1\nn_heads = 2\nseq_len = 32\n[train]\n"
                                  "seq_len = 32\nbatch_size = 2\nsteps = 100000\n[net]\nround_timeout_s = 2.0\n")
    env = {**os.environ, "DEMONET_TOKEN": TOKEN, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    coordinator = subprocess.Popen([sys.executable, "-m", "demonet", "coordinator", "--listen", "127.0.0.1:0",
                                    "--config", str(tmp / "run.toml"), "--start-peers", "2"],
                                   stdout=subprocess.PIPE, stderr=open(tmp / "coordinator.log", "w"), env=env)
    assert coordinator.stdout is not None
    address = coordinator.stdout.readline().decode().split()[-1]
    peers = [subprocess.Popen([sys.executable, "-m", "demonet", "peer", "--coordinator", address, "--peer-id", p,
                               "--out", str(tmp / "out"), "--threads", "1"], stdout=subprocess.DEVNULL,
                              stderr=open(tmp / f"{p}.log", "w"), env=env) for p in ("p1", "p2")]
    try:
        while _status(address)["run"]["rounds_closed"] < 3:
            time.sleep(0.5)
        rows = [("streams", _attack(["--flood", "--streams", str(args.streams), "--hold-s", str(args.seconds)],
                                    coordinator, address)),
                ("aggregates", _attack(["--aggregates", "--hold-s", str(args.seconds)], coordinator, address))]
    finally:
        for proc in [*peers, coordinator]:
            proc.terminate()
        for proc in [*peers, coordinator]:
            proc.wait(timeout=30)
    print(f"{'attack':<12}{'RSS before MiB':>16}{'RSS peak MiB':>14}{'honest rounds':>15}  attacker")
    for name, row in rows:
        print(f"{name:<12}{row['rss_before_mib']:>16.0f}{row['rss_peak_mib']:>14.0f}{row['honest_rounds']:>15d}  "
              f"{json.dumps(row['out'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="few streams and seconds: a check that it runs")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--seconds", "--hold-s", dest="seconds", type=float, default=15.0)
    parser.add_argument("--flood", action="store_true", help="the streams attacker alone (prints JSON)")
    parser.add_argument("--aggregates", action="store_true", help="the GetAggregate attacker alone (prints JSON)")
    parser.add_argument("--coordinator", help="HOST:PORT of the coordinator the attacker calls")
    parser.add_argument("--token", default=os.environ.get("DEMONET_TOKEN", TOKEN))
    parser.add_argument("--declared", type=int, default=16 << 20, help="the size each stream's message declares")
    args = parser.parse_args()
    if args.flood or args.aggregates:
        coro = (flood(args.coordinator, args.token, streams=args.streams, declared=args.declared, hold_s=args.seconds)
                if args.flood else aggregates(args.coordinator, args.token, seconds=args.seconds))
        print(json.dumps(asyncio.run(coro)), flush=True)
        return
    if args.smoke:
        args.streams, args.seconds = 12, 4.0
    _run(args)


if __name__ == "__main__":
    main()
