"""DHT mode with fewer slice owners than members (`[net] slice_entries`, demonet.dht.rules.owner_count), over
five real hivemind nodes and their p2pd daemons on loopback.

A member that owns no slice still sends its parts and fetches every merged slice; the owners turn with the
round; a member that owns none may verify one; parts sent ahead go to that round's owners. The aggregate
is the bits of the slices merged from every member's parts, whoever owns them. A member that dies is left
out of the merges where it owns no slice, and its slice is dropped where it owns one.
"""

from __future__ import annotations

import pytest

from tests.integration.common import run_coroutine
from tests.integration.test_dht import WAIT_S, gatherers_on_loopback
from tests.procs import Reaper

pytest.importorskip("hivemind")
pytestmark = pytest.mark.slow


async def _owners() -> None:
    """Run by the test in a fresh interpreter."""
    import asyncio

    import torch

    from demonet.dht import rules
    from demonet.dht.ahead import encode_parts
    from demonet.dht.deadlines import now
    from demonet.optim import Payload
    from demonet.wire.merge import decode_contribution, merge
    from tests.payloads import random_payload

    specs = {"w": ((64, 64), (16, 16)), "b": ((64,), (1, 64))}  # 16 + 1 rows of 32 merged entries: 544
    names = ["a", "b", "c", "d", "e"]
    # 544 entries at 1000 a slice make one owner; the least is 4 (`rules.MIN_SLICE_OWNERS`), of 5 members.
    nodes, addresses = await gatherers_on_loopback("owners", names, specs, exchange_timeout_s=5.0,
                                                   slice_entries=1000, verify_fraction=1.0)
    payloads = {p: random_payload(specs, i, k=8) for i, p in enumerate(names)}
    opts = nodes["a"]._node.opts
    plan = rules.SlicePlan(specs, 4)

    def reference(r: int, senders: list[str] = names, dropped: int | None = None) -> Payload:
        """The slices merged here from the `senders`' parts, in sorted order, as any owner merges them; slice
        `dropped` left out, as by every peer when nobody delivered it."""
        parts = {p: encode_parts(r, plan, payloads[p]) for p in senders}
        slices = [None if s == dropped else
                  merge([decode_contribution(parts[p][s], expected=plan.slice_specs(s), rules=opts.rules)[1]
                         for p in senders], step=r, rules=opts.rules, expected=plan.slice_specs(s)).payload
                  for s in range(plan.n)]
        return plan.join(slices)  # type: ignore[arg-type]

    def same(x: Payload, y: Payload) -> bool:
        return all(torch.equal(x.tensors[n].idx, y.tensors[n].idx) and torch.equal(x.tensors[n].val, y.tensors[n].val)
                   for n in specs)

    async def run(p: str, r: int):  # type: ignore[no-untyped-def]
        return await nodes[p]._exchange.run(r, payloads[p], specs=specs, members=names, owners=names,
                                            addresses=addresses, frozen_at=now())

    # A round whose member without a slice verifies one, and the round after it.
    mdigest = rules.members_digest(names)
    r1 = next(r for r in range(20, 200)
              if rules.owner_order(r, names, 4)[4] in rules.verifiers(r, mdigest, rules.owner_order(r, names, 4), 4,
                                                                      1.0).values())
    closed: set[str] = set()
    try:
        for r, ahead in ((r1, False), (r1 + 1, True)):
            order = rules.owner_order(r, names, 4)
            idle = order[4]
            assert order[0] == names[r % 5] and idle not in order[:4]
            if ahead:  # the parts go ahead of the freeze, to this round's owners and verifiers
                for p in names:
                    nodes[p]._exchange.send_ahead(r, payloads[p], specs=specs, members=names, owners=names,
                                                  addresses=addresses)
                await asyncio.sleep(0.5)
            done = await asyncio.gather(*(run(p, r) for p in names))
            expected = reference(r)
            for p, d in zip(names, done, strict=True):
                assert d.slice_owners == tuple(order[:4]) and d.contributors == tuple(names), (p, d)
                assert d.checked == 4 and not d.disagreed and not d.dead_owners, (p, d)
                assert d.phases["ahead"] == float(ahead), (p, d.phases)
                assert same(d.aggregate, expected), p  # type: ignore[arg-type]
            st = nodes[idle]._exchange._rounds[r]
            assert sorted(st.merged) == [0, 1, 2, 3] and not st.fetched  # fetched every slice, served none
            if r == r1:
                assert idle in st.verifiers.values()  # and merged one as its verifier

        # One member dies. In a round where it owns no slice, the others merge without its part (after the
        # reduce-scatter's deadline); in a round where it owns one, that slice is dropped by everyone and
        # the next round no longer waits for it (`dead_owners`).
        gone = rules.owner_order(r1 + 6, names, 4)[4]  # owns no slice in round r1 + 6, one in round r1 + 7
        await asyncio.wait_for(nodes[gone].close(), 30)
        closed.add(gone)
        alive = [p for p in names if p != gone]
        for r in (r1 + 6, r1 + 7):
            order = rules.owner_order(r, names, 4)
            dropped = order.index(gone) if gone in order[:4] else None
            assert (dropped is None) == (r == r1 + 6)
            done = await asyncio.gather(*(run(p, r) for p in alive))
            expected = reference(r, alive, dropped)
            for p, d in zip(alive, done, strict=True):
                assert d.contributors == tuple(alive) and d.slice_owners == tuple(order[:4]), (r, p, d)
                assert d.dead_owners == (frozenset() if dropped is None else {gone}), (r, p, d)
                assert same(d.aggregate, expected), (r, p)  # type: ignore[arg-type]
    finally:
        for p in names:
            if p not in closed:
                await asyncio.wait_for(nodes[p].close(), 30)


def test_members_without_a_slice_send_parts_fetch_every_slice_and_the_owners_turn(reap_children: Reaper) -> None:
    run_coroutine(__name__, "_owners", reap_children, WAIT_S)
