"""DHT mode's parts sent ahead of the freeze (`SliceExchange.send_ahead`), over three real hivemind nodes
and their p2pd daemons on loopback.

A peer sends its parts before it froze the round, cut for the members it expects. Where the freeze gives
those members, the exchange awaits those calls and sends nothing twice; where it does not (a member
gone), it cancels them and sends parts cut for the members it froze, and an owner that held the part
sent ahead waits for that one instead of merging without its sender. Either way the aggregate is the
bits of the exchange without parts sent ahead.
"""

from __future__ import annotations

import pytest

from tests.integration.common import run_coroutine
from tests.integration.test_dht import WAIT_S, gatherers_on_loopback
from tests.procs import Reaper

pytest.importorskip("hivemind")
pytestmark = pytest.mark.slow


async def _ahead() -> None:
    """Run by the test in a fresh interpreter."""
    import asyncio
    import time

    import torch

    from demonet._proto import demonet_pb2 as pb
    from demonet.dht.deadlines import now
    from demonet.optim import Payload
    from tests.payloads import random_payload

    specs = {"w": ((64, 64), (16, 16)), "b": ((64,), (1, 64))}

    def payload(seed: int) -> Payload:
        return random_payload(specs, seed, k=8)

    names = ["a", "b", "c"]
    nodes, addresses = await gatherers_on_loopback("ahead", names, specs, exchange_timeout_s=5.0)
    payloads = {p: payload(i) for i, p in enumerate(names)}
    calls: list[tuple[str, int, int, str, bool, int]] = []  # (caller, round, slice, callee, sent ahead, bytes)

    for p in names:
        def counted(p: str, call: object) -> object:
            async def wrapped(address: str, kind: int, r: int, **kw: object) -> object:
                if kind == pb.DHT_KIND_PART:
                    calls.append((p, r, int(kw["slice"]), address, bool(kw.get("ahead", False)),  # type: ignore[call-overload]
                                  len(kw["data"])))  # type: ignore[arg-type]
                return await call(address, kind, r, **kw)  # type: ignore[operator]
            return wrapped
        nodes[p]._node.streams.call = counted(p, nodes[p]._node.streams.call)  # type: ignore[method-assign]

    async def run(p: str, r: int, members: list[str], delay_s: float = 0.0):  # type: ignore[no-untyped-def]
        await asyncio.sleep(delay_s)
        return await nodes[p]._exchange.run(r, payloads[p], specs=specs, members=members, owners=members,
                                            addresses=addresses, frozen_at=now())

    def same(x: Payload, y: Payload) -> bool:
        return all(torch.equal(x.tensors[n].idx, y.tensors[n].idx) and torch.equal(x.tensors[n].val, y.tensors[n].val)
                   for n in specs)

    try:
        # Round 10, no parts sent ahead: the reference. Round 11, sent ahead for the members it freezes.
        plain = await asyncio.gather(*(run(p, 10, names) for p in names))
        assert all(d.phases["ahead"] == 0.0 and d.contributors == tuple(names) for d in plain)
        for p in names:
            nodes[p]._exchange.send_ahead(11, payloads[p], specs=specs, members=names, owners=names,
                                          addresses=addresses)
        await asyncio.sleep(0.5)  # the owners hold the parts before they freeze
        ahead = await asyncio.gather(*(run(p, 11, names) for p in names))
        assert all(d.phases["ahead"] == 1.0 and d.contributors == tuple(names) for d in ahead)
        assert all(same(d.aggregate, plain[0].aggregate) for d in [*plain, *ahead])  # type: ignore[arg-type]
        # Each owner and verifier merged every member's part decoded as it arrived (its own at its freeze).
        for p, d in zip(names, ahead, strict=True):
            st = nodes[p]._exchange._rounds[11]
            merges = sum(o == p for o in st.owners) + sum(v == p for v in st.verifiers.values())
            assert merges and d.phases["early"] == len(names) * merges, (p, d.phases, st.owners, st.verifiers)
        sent = [(p, s, to) for p, r, s, to, _, _ in calls if r == 11]
        assert sent and all(a for _, r, _, _, a, _ in calls if r == 11), calls  # every part went ahead ...
        assert len(sent) == len(set(sent)), sent  # ... and none twice

        # Round 12: sent ahead for a, b and c, but c is gone and the round froze with a and b. Each part is
        # sent again, cut for a and b; b, which owns a slice, freezes first and holds a's part sent ahead
        # (cut for three) until a's new part comes: it merges with a's payload, not without it.
        for p in ["a", "b"]:
            nodes[p]._exchange.send_ahead(12, payloads[p], specs=specs, members=names, owners=names,
                                          addresses=addresses)
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        wrong = await asyncio.gather(run("a", 12, ["a", "b"], delay_s=0.5), run("b", 12, ["a", "b"]))
        assert time.monotonic() - t0 < 5.0  # no wait for c, nor for the exchange's deadline
        assert all(d.phases["ahead"] == 0.0 and d.contributors == ("a", "b") for d in wrong), wrong
        again = [(p, s, to) for p, r, s, to, a, _ in calls if r == 12 and not a]
        assert {p for p, _, _ in again} == {"a", "b"} and addresses["c"] not in {to for _, _, to in again}, again
        # Every byte sent counts, the parts sent ahead for nothing too: a's parts (each call once, none
        # tried again on loopback) and its merged slice, once for each peer that fetched it. b's part sent
        # ahead for three is answered with nothing: the slice goes once, to b's part cut for two.
        st = nodes["a"]._exchange._rounds[12]
        served = sum(len(st.merged[s][1]) * len(st.fetched.get(s, ())) for s in st.merged if st.owners[s] == "a")
        sent_a = [(s, to, ahead, n) for p, r, s, to, ahead, n in calls if p == "a" and r == 12]
        assert served > 0 and wrong[0].bytes_up == served + sum(x[-1] for x in sent_a), (wrong[0].bytes_up, sent_a)
        # The reference: the same two payloads exchanged with nothing sent ahead.
        reference = await asyncio.gather(run("a", 13, ["a", "b"]), run("b", 13, ["a", "b"]))
        assert all(same(d.aggregate, reference[0].aggregate) for d in [*wrong, *reference])  # type: ignore[arg-type]
        assert not same(reference[0].aggregate, plain[0].aggregate)  # type: ignore[arg-type]
    finally:
        for p in names:
            await asyncio.wait_for(nodes[p].close(), 30)


def test_parts_sent_ahead_are_used_when_the_freeze_agrees_and_sent_again_when_it_does_not(reap_children: Reaper
                                                                                            ) -> None:
    run_coroutine(__name__, "_ahead", reap_children, WAIT_S)
