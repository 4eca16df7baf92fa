"""DHT mode: members that froze one round with two member lists, over three real hivemind nodes and their
p2pd daemons on loopback.

A joiner's registration that reached some members' nodes before their freeze and others' after (right
after a partition heals) gives a round two member lists. A part cut for another list is refused, and its
owner answers with the digest of the list it froze: the sender drops that slice at once, asks nobody else
for it, and both report the other as having frozen otherwise (`Exchanged.other_lists`), not as a dead
owner. `DhtGatherer.gather` then expects those peers in the next round, where the lists agree again
(tests/unit/test_dht_late_round.py). A joiner that some members counted in while its own read of the
freeze left it out answers their parts with the list it read, so that they do not wait for it either.
"""

from __future__ import annotations

import pytest

from tests.integration.common import run_coroutine
from tests.integration.test_dht import WAIT_S, gatherers_on_loopback
from tests.procs import Reaper

pytest.importorskip("hivemind")
pytestmark = pytest.mark.slow

EXCHANGE_TIMEOUT_S = 5.0


async def _lists() -> None:
    """Run by the test in a fresh interpreter."""
    import asyncio
    import time

    import torch

    from demonet.dht.deadlines import now
    from tests.payloads import random_payload

    specs = {"w": ((64, 64), (16, 16)), "b": ((64,), (1, 64))}
    names = ["a", "b", "c"]
    nodes, addresses = await gatherers_on_loopback("lists", names, specs, exchange_timeout_s=EXCHANGE_TIMEOUT_S)
    payloads = {p: random_payload(specs, i, k=8) for i, p in enumerate(names)}

    async def run(p: str, r: int, members: list[str]):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        done = await nodes[p]._exchange.run(r, payloads[p], specs=specs, members=members, owners=members,
                                            addresses=addresses, frozen_at=now())
        return done, time.monotonic() - t0

    try:
        # Round 20: a froze a and b; b and c froze all three (c's registration reached a's node too late).
        lists = {"a": ["a", "b"], "b": names, "c": names}
        out = dict(zip(names, await asyncio.gather(*(run(p, 20, lists[p]) for p in names)), strict=True))
        a, b, c = (out[p][0] for p in names)
        # Each names the peers that answered its parts with another list, and those lists' members: b's
        # answer to a names c, a's answer to c names b (on c's list: c expects it anyway).
        assert (a.other_lists, b.other_lists, c.other_lists) == ({"b", "c"}, {"a"}, {"a", "b"}), \
            (a.other_lists, b.other_lists, c.other_lists)
        assert not a.dead_owners and not b.dead_owners and not c.dead_owners, out  # alive: not dead owners
        # a merged its slice from its own part alone, and got nothing from b; b and c dropped a's slice and
        # merged theirs from their two parts: the same bits on both.
        assert a.contributors == ("a",) and b.contributors == c.contributors == ("b", "c"), out
        assert b.aggregate is not None and c.aggregate is not None
        for n in specs:
            assert torch.equal(b.aggregate.tensors[n].idx, c.aggregate.tensors[n].idx)
            assert torch.equal(b.aggregate.tensors[n].val, c.aggregate.tensors[n].val)
        # Nobody waited for a part, a slice, a fetch or a verifier's answer that the other list never sends:
        # each exchange ended far from the reduce-scatter's deadline (0.02-0.07 s on an idle machine).
        assert all(t < EXCHANGE_TIMEOUT_S / 2 for _, t in out.values()), {p: t for p, (_, t) in out.items()}

        # Round 21: the three froze one list again; the whole round goes through.
        again = await asyncio.gather(*(run(p, 21, names) for p in names))
        assert all(d.contributors == tuple(names) and not d.other_lists and not d.dead_owners for d, _ in again)

        # Rounds 22 and 30: a froze all three, b froze a and b, and c read b's freeze, which is without it: c
        # takes no part (`FrozeWithout`), and tells a so when a's part comes (`SliceExchange.left_out`), a
        # moment after it arrived. Round 22 is c's next round (the part waits for c's freeze); round 30 is
        # far past its last one (c refuses the part until it knows, and a tries again).
        for r in (22, 30):
            async def left_out(r: int = r) -> None:
                await asyncio.sleep(0.3)
                await nodes["c"]._exchange.left_out(r, ["a", "b"])

            (a, t_a), (b, t_b), _ = await asyncio.gather(run("a", r, names), run("b", r, ["a", "b"]), left_out())
            # Both end far from the deadlines instead of a waiting for c's part and slice until them: each
            # names the others as having frozen another list (c named by a's answer to b), none a dead owner.
            assert (a.other_lists, b.other_lists) == ({"b", "c"}, {"a", "c"}), (r, a, b)
            assert not a.dead_owners and not b.dead_owners, (r, a, b)
            assert a.contributors == ("a",) and b.contributors == ("b",), (r, a, b)
            assert t_a < EXCHANGE_TIMEOUT_S / 2 and t_b < EXCHANGE_TIMEOUT_S / 2, (r, t_a, t_b)
    finally:
        for p in names:
            await asyncio.wait_for(nodes[p].close(), 30)


def test_members_that_froze_two_lists_drop_the_other_lists_slices_at_once_and_name_their_peers(
        reap_children: Reaper) -> None:
    run_coroutine(__name__, "_lists", reap_children, WAIT_S)
