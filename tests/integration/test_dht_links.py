"""DHT mode's links (demonet.dht.links), over two real hivemind nodes and their p2pd daemons on loopback.

A peer's calls to another go over one long-lived libp2p stream: many calls at once on it, their replies
in another order than the calls, a multi-part request among them; a call that times out retires the link
(the next call opens another); a handler that fails answers its call alone; and a peer that goes away
fails the calls waiting on it at once, not at their timeouts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_dht import TOKEN, WAIT_S
from tests.procs import Reaper

pytest.importorskip("hivemind")
pytestmark = pytest.mark.slow


async def _links() -> None:
    """Run by the test in a fresh interpreter (see `test_wrong_token_records_and_messages_refused`)."""
    import asyncio
    import os
    import time

    from demonet._proto import demonet_pb2 as pb
    from demonet.dht.gatherer import DhtGatherer, DhtOptions
    from demonet.dht.streams import Reply
    from demonet.errors import PeerUnavailable
    from demonet.wire.identity import Identity

    def opts(initial: tuple[str, ...] = ()) -> DhtOptions:
        return DhtOptions(run="links", token=TOKEN, initial_peers=initial, host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                          exchange_timeout_s=5.0)

    ids = {"a": Identity.generate(), "b": Identity.generate()}
    b = await DhtGatherer.create(opts(), "b", {}, identity=ids["b"])
    a = await DhtGatherer.create(opts((b.visible_maddrs()[0],)), "a", {}, identity=ids["a"])
    for node, other in ((a, "b"), (b, "a")):
        assert node._node.book.choose(other, [ids[other].public]) == ids[other].public
    finished: list[int] = []

    async def echo(head: pb.DhtMessage, data: bytes | None) -> Reply:
        """Slice i answers after (20 - i) x 10 ms: the later calls finish first. Slice 99 raises."""
        if head.slice == 99:
            raise RuntimeError("a handler's bug")
        await asyncio.sleep(0.01 * (20 - head.slice) if head.slice < 20 else head.slice / 10)
        finished.append(head.slice)
        return Reply(data=(data or b"")[::-1] + bytes([head.slice]), fields={"slice": head.slice})

    b._node.streams.serve(pb.DHT_KIND_FETCH, echo)
    streams, address = a._node.streams, b._node.address
    try:
        # Many calls at once, one of them in three parts (a part is at most 1 MiB): one link.
        sizes = [1000 + 3000 * i for i in range(20)]
        sizes[7] = 2_500_000
        datas = [os.urandom(n) for n in sizes]
        replies = await asyncio.gather(*(streams.call(address, pb.DHT_KIND_FETCH, 1, slice=i, data=d, timeout_s=20)
                                         for i, d in enumerate(datas)))
        for i, (head, data) in enumerate(replies):
            assert head.slice == i and data == datas[i][::-1] + bytes([i]), i
        assert streams.links_opened == 1
        assert finished != sorted(finished)  # replies came in another order than the calls

        # A handler that fails answers its own call; the link goes on.
        try:
            await streams.call(address, pb.DHT_KIND_FETCH, 1, slice=99, timeout_s=5)
            raise AssertionError("a failed handler answered")
        except PeerUnavailable as e:
            assert "the handler failed" in str(e), e
        assert (await streams.call(address, pb.DHT_KIND_FETCH, 1, slice=3, data=b"x", timeout_s=5))[1] == b"x\3"
        assert streams.links_opened == 1

        # A call that times out retires its link: the next call opens another, and is answered.
        try:
            await streams.call(address, pb.DHT_KIND_FETCH, 1, slice=30, timeout_s=0.5)  # answers after 3 s
            raise AssertionError("the slow call was answered within its timeout")
        except PeerUnavailable as e:
            assert "no answer within" in str(e), e
        assert (await streams.call(address, pb.DHT_KIND_FETCH, 1, slice=4, data=b"y", timeout_s=5))[1] == b"y\4"
        assert streams.links_opened == 2

        # A peer that goes away fails the call waiting on it at once, not when its handler would have
        # answered (15 s) or at the call's timeout (60 s).
        waiting = asyncio.ensure_future(streams.call(address, pb.DHT_KIND_FETCH, 1, slice=150, timeout_s=60))
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        closing = asyncio.ensure_future(b.close())
        try:
            await asyncio.wait_for(waiting, 10)
            raise AssertionError("a call to a closed peer was answered")
        except PeerUnavailable as e:
            print(f"failed {time.monotonic() - t0:.1f} s after the peer began closing: {e}")
        await asyncio.wait_for(closing, 30)
    finally:
        await asyncio.wait_for(a.close(), 30)
        await asyncio.wait_for(b.close(), 30)


def test_calls_share_one_link_and_a_broken_one_is_replaced(reap_children: Reaper) -> None:
    code = "import asyncio; from tests.integration.test_dht_links import _links; asyncio.run(_links()); print('ok')"
    proc = reap_children.add(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2]))
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0 and out.strip().endswith("ok"), out[-2000:] + err[-3000:]
