"""Benchmark: a DHT-mode call on a stream of its own against the same call on a link (demonet.dht.links).

Two DHT nodes on loopback (each with its p2pd daemon, as `demonet peer --dht` runs them); one calls the
other N times in a row with a request of --bytes (a slice's part) and gets a reply of the same size (its
merged slice), first with a new libp2p stream per call (how every call went before links, and how parameters
and pings still go), then over one link. Prints wall time per call, and CPU time per call of this process
(both ends' Python: signing, checking, framing) and of the two p2pd daemons, read from /proc. Run from the
repo root: `python bench/dht_links.py`. Not a test."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

TOKEN = "bench-links"


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _daemons() -> list[int]:
    """The p2pd daemons on this machine (this process's two)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "p2pd":
                found.append(int(pid))
        except OSError:
            pass
    return found


async def main(calls: int, size: int) -> None:
    from demonet._proto import demonet_pb2 as pb
    from demonet.dht import streams as streams_mod
    from demonet.dht.gatherer import DhtGatherer, DhtOptions
    from demonet.dht.streams import Reply
    from demonet.wire.identity import Identity

    def opts(initial: tuple[str, ...] = ()) -> DhtOptions:
        return DhtOptions(run="bench", token=TOKEN, initial_peers=initial, host_maddrs=("/ip4/127.0.0.1/tcp/0",))

    ids = {"a": Identity.generate(), "b": Identity.generate()}
    b = await DhtGatherer.create(opts(), "b", {}, identity=ids["b"])
    a = await DhtGatherer.create(opts((b.visible_maddrs()[0],)), "a", {}, identity=ids["a"])
    for node, other in ((a, "b"), (b, "a")):
        node._node.book.choose(other, [ids[other].public])
    reply = os.urandom(size)

    async def answer(head: pb.DhtMessage, data: bytes | None) -> Reply:
        return Reply(data=reply, fields={"slice": head.slice})

    b._node.streams.serve(pb.DHT_KIND_FETCH, answer)
    request, address, own_stream = os.urandom(size), b._node.address, streams_mod._OWN_STREAM
    print(f"# {calls} calls in a row, {size:,} B each way, two DHT nodes on loopback ({os.cpu_count()} cores)")
    print()
    print("| how | wall ms per call | this process's CPU ms per call | p2pd CPU ms per call (both) |")
    print("|---|---|---|---|")
    try:
        for how, kinds in (("a stream per call", own_stream | {pb.DHT_KIND_FETCH}), ("one link", own_stream)):
            streams_mod._OWN_STREAM = frozenset(kinds)
            for _ in range(20):  # warm up (and open the link)
                await a._node.streams.call(address, pb.DHT_KIND_FETCH, 1, slice=0, data=request, timeout_s=10)
            daemons = _daemons()
            cpu0, d0, t0 = _cpu_s(os.getpid()), sum(map(_cpu_s, daemons)), time.perf_counter()
            for i in range(calls):
                await a._node.streams.call(address, pb.DHT_KIND_FETCH, 1, slice=i, data=request, timeout_s=10)
            wall, cpu, d = time.perf_counter() - t0, _cpu_s(os.getpid()) - cpu0, sum(map(_cpu_s, daemons)) - d0
            print(f"| {how} | {1000 * wall / calls:.2f} | {1000 * cpu / calls:.2f} | {1000 * d / calls:.2f} |",
                  flush=True)
    finally:
        streams_mod._OWN_STREAM = own_stream
        await a.close()
        await b.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300, help="calls per way (300)")
    parser.add_argument("--bytes", type=int, default=8000, help="request and reply size (8000: a part at 8 peers)")
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.bytes))
