"""DHT mode's links (demonet.dht.links), over two real hivemind nodes and their p2pd daemons on loopback.

A peer's calls to another go over one long-lived libp2p stream: many calls at once on it, their replies
in another order than the calls, a multi-part request among them; a call that times out retires the link
(the next call opens another); a handler that fails answers its call alone; and a peer that goes away
fails the calls waiting on it at once, not at their timeouts. A part is acknowledged as soon as it is read,
before its handler answers. A link is signed for by its hello alone,
speaks for the sender that hello bound and no other, and carries its opener's DHT records to the callee's
node, which validates them.
"""

from __future__ import annotations

import pytest

from tests.integration.common import run_coroutine
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

        # A part is acknowledged once read whole, before its handler answers: the caller times its upload by
        # that receipt (here within the handler's second), not by the reply.
        async def hold(head: pb.DhtMessage, data: bytes | None) -> Reply:
            await asyncio.sleep(1.0)
            return Reply()

        b._node.streams.serve(pb.DHT_KIND_PART, hold)
        t0 = time.monotonic()
        await streams.call(address, pb.DHT_KIND_PART, 7, slice=0, data=os.urandom(50_000), samples=1, timeout_s=10)
        assert time.monotonic() - t0 >= 1.0
        size, seconds = streams.uploads.of(7) or (0, -1.0)
        assert size == 50_000 and 0.0 <= seconds < 1.0, (size, seconds)
        assert streams.uploads.of(1) is None  # the calls of other kinds are not parts

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


def _run(name: str, reap_children: Reaper) -> None:
    run_coroutine(__name__, name, reap_children, WAIT_S)


def test_calls_share_one_link_and_a_broken_one_is_replaced(reap_children: Reaper) -> None:
    _run("_links", reap_children)


async def _hellos() -> None:
    """Run by the test in a fresh interpreter: peers a and c call b."""
    import asyncio
    import dataclasses

    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2

    from demonet._proto import demonet_pb2 as pb
    from demonet.dht import keys, links, rules
    from demonet.dht.deadlines import now
    from demonet.dht.gatherer import DhtGatherer, DhtOptions
    from demonet.dht.streams import Reply
    from demonet.dht.validators import HmacValidator, KeyValidator
    from demonet.errors import PeerUnavailable
    from demonet.wire.identity import Identity

    def opts(initial: tuple[str, ...] = ()) -> DhtOptions:
        return DhtOptions(run="hellos", token=TOKEN, initial_peers=initial, host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                          exchange_timeout_s=5.0)

    ids = {name: Identity.generate() for name in "abc"}
    b = await DhtGatherer.create(opts(), "b", {}, identity=ids["b"])
    a = await DhtGatherer.create(opts((b.visible_maddrs()[0],)), "a", {}, identity=ids["a"])
    c = await DhtGatherer.create(opts((b.visible_maddrs()[0],)), "c", {}, identity=ids["c"])
    for node, others in ((a, "bc"), (b, "ac"), (c, "ab")):
        for other in others:
            assert node._node.book.choose(other, [ids[other].public]) == ids[other].public

    async def echo(head: pb.DhtMessage, data: bytes | None) -> Reply:
        return Reply(data=(data or b"")[::-1])

    b._node.streams.serve(pb.DHT_KIND_FETCH, echo)
    address = b._node.address
    sent: list[pb.DhtMessage] = []  # every message framed in this process (a's, b's and c's)
    frame = links.frame

    def spy(msg: pb.DhtMessage) -> bytes:
        sent.append(pb.DhtMessage.FromString(msg.SerializeToString()))
        return frame(msg)

    links.frame = spy

    async def raw_call(node: DhtGatherer, msgs: list[pb.DhtMessage]) -> pb.DhtMessage | None:
        """`msgs` written on a new link from `node` to b, as they are; b's first answer (None: it closed)."""
        _, reader, writer = await node._node.p2p.call_binary_stream_handler(PeerID.from_base58(address), links.LINK)
        try:
            writer.write(b"".join(frame(m) for m in msgs))
            await writer.drain()
            reply = await asyncio.wait_for(links.read_frame(reader), 10)
            try:  # after refusing a link's first message, b ends the link
                await asyncio.wait_for(links.read_frame(reader), 10)
                return None
            except asyncio.IncompleteReadError:
                return reply
        finally:
            writer.close()

    def as_sender(msg: pb.DhtMessage, sender: str) -> pb.DhtMessage:
        """`msg` as `sender` says it, its HMAC made again (what any holder of the token can do)."""
        msg = pb.DhtMessage.FromString(msg.SerializeToString())
        msg.sender, msg.mac = sender, b""
        msg.mac = rules.sign(TOKEN.encode(), msg.SerializeToString())
        return msg

    try:
        # a's first call opens a link: the hello and its reply are signed, the call and its reply are not.
        assert (await a._node.streams.call(address, pb.DHT_KIND_FETCH, 1, data=b"abc", timeout_s=10))[1] == b"cba"
        assert [(m.sender, m.kind, bool(m.signature)) for m in sent] == [
            ("a", pb.DHT_KIND_HELLO, True), ("b", pb.DHT_KIND_REPLY, True),
            ("a", pb.DHT_KIND_FETCH, False), ("b", pb.DHT_KIND_REPLY, False)], sent
        hello = sent[0]
        refused = b._node.streams.refused

        # c replays a's hello on a link of its own: signed for a's link, not c's. b refuses it, ends the link.
        reply = await raw_call(c, [hello])
        assert reply is not None and reply.error == "bad signature: not 'a''s key", reply
        # A link whose first call is not a hello is refused, even from a sender b knows.
        fetch = c._node.streams._message(pb.DHT_KIND_FETCH, 1, call=1)
        reply = await raw_call(c, [fetch])
        assert reply is not None and reply.error == "a link's first call is not a hello", reply
        assert b._node.streams.refused == refused + 2

        # c's own link is bound to c: a message on it as a is refused, and the link goes on for c.
        assert (await c._node.streams.call(address, pb.DHT_KIND_FETCH, 1, data=b"xy", timeout_s=10))[1] == b"yx"
        link = c._node.streams._links[address]
        call, replies = link.open_call()
        await link.send([as_sender(c._node.streams._message(pb.DHT_KIND_FETCH, 1, call=call), "a")])
        reply = await asyncio.wait_for(replies.get(), 10)
        link.end_call(call)
        assert reply is not None and reply.error == "sent as 'a' on a link bound to 'c'", reply
        assert (await c._node.streams.call(address, pb.DHT_KIND_FETCH, 1, data=b"z", timeout_s=10))[1] == b"z"
        assert c._node.streams.links_opened == 1

        # a's records go to b over a's link, not in hivemind's store call, and b validates and keeps them.
        protocol = a._node._node().protocol
        hivemind_stores = []
        call_store = protocol.call_store

        async def counted(*args: object, **kwargs: object) -> object:
            hivemind_stores.append(args)
            return await call_store(*args, **kwargs)

        protocol.call_store = counted
        key = a._node.key("members", 7)
        assert await a._node.store_many({key: {"t": now(), "address": a._node.address}})
        # To c, which a has no link to, they go in hivemind's store call.
        assert [str(args[0]) for args in hivemind_stores] == [c._node.address] and a._node.everywhere
        assert (await b._node.get_local(key))["a"]["address"] == a._node.address
        assert (await c._node.get_local(key))["a"]["address"] == a._node.address

        # c, over its link, stores a record as a signed with its own key: b refuses to keep it.
        node = c._node._node()
        forged_key = c._node.key("members", 8)
        record = DHTRecord(DHTID.generate(source=forged_key).to_bytes(),
                           node.protocol.serializer.dumps(keys.subkey("a", ids["a"].public)),
                           node.protocol.serializer.dumps('{"t": 0}'), now() + 60)
        request = dht_pb2.StoreRequest(keys=[record.key], subkeys=[record.subkey],
                                       values=[node.protocol.record_validator.sign_value(record)],
                                       expiration_time=[record.expiration_time], in_cache=[False])
        assert await c._node.store_over_link(address, request.SerializeToString()) == [False]
        assert await b._node.get_local(forged_key) == {}
        # c's own record, over c's own link, is kept without its signature checked: the link proved it is c's.
        # Its signature is kept with it, and a node that reads it from b checks it: a's search refuses this one.
        own_key = c._node.key("members", 9)
        own = DHTRecord(DHTID.generate(source=own_key).to_bytes(),
                        node.protocol.serializer.dumps(keys.subkey("c", ids["c"].public)),
                        node.protocol.serializer.dumps('{"t": 0}'), now() + 60)
        signed = KeyValidator(ids["c"]).sign_value(own)  # the value and c's signature over it
        wrong = dataclasses.replace(own, value=signed[:-1] + bytes([signed[-1] ^ 1]))  # its last byte altered
        assert not KeyValidator(ids["a"]).validate(wrong)
        wrong = dataclasses.replace(wrong, value=HmacValidator(TOKEN.encode()).sign_value(wrong))  # the token's MAC
        request = dht_pb2.StoreRequest(keys=[own.key], subkeys=[own.subkey], values=[wrong.value],
                                       expiration_time=[own.expiration_time], in_cache=[False])
        assert await c._node.store_over_link(address, request.SerializeToString()) == [True]
        assert "c" in await b._node.get_local(own_key)
        assert await a._node.get(own_key) == {}
        # Bytes that are not a StoreRequest, and a request whose lists differ in length, are refused.
        for bad, why in ((b"\xff\xff\xff", "not a StoreRequest"),
                         (dht_pb2.StoreRequest(keys=[record.key]).SerializeToString(), "differ in number")):
            try:
                await c._node.streams.call(address, pb.DHT_KIND_STORE, 0, data=bad, timeout_s=10)
                raise AssertionError("a bad store request was answered")
            except PeerUnavailable as e:
                assert why in str(e), e
        assert await b._node.get_local(forged_key) == {}
    finally:
        links.frame = frame
        for node in (a, c, b):
            await asyncio.wait_for(node.close(), 30)


def test_a_link_is_signed_once_by_its_hello_and_speaks_for_that_sender_alone(reap_children: Reaper) -> None:
    _run("_hellos", reap_children)
