"""DHT mode: two members of a round that waited for each other abort it together and go on together.

One of them was held to the exchange deadline of the round before (the third, a slice owner, was cut
off mid-exchange) and announces after the other froze alone. Whichever of the two finds the late
majority first is a round ahead when the other looks. And a peer cut off right after it froze a round
applies nothing of it. Fake DHT nodes in memory; no sockets, no hivemind.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from demonet.dht.board import RoundBoard
from demonet.dht.exchange import Exchanged
from demonet.dht.gatherer import DhtGatherer
from demonet.dht.streams import DhtOptions
from tests.unit.test_dht_majority import _FakeNode


class _SlowPings(_FakeNode):
    """A node whose pings to its base last a while: a member of the base is cut off."""

    async def reconnect(self, addresses: Any) -> Any:
        reached = await super().reconnect(addresses)
        await asyncio.sleep(0.5)
        return reached


@pytest.mark.timeout(10)
@pytest.mark.parametrize("late_s", [0.3, 0.6, 0.9])
def test_two_members_that_waited_for_each_other_abort_the_round_together(monkeypatch: pytest.MonkeyPatch,
                                                                         late_s: float) -> None:
    import demonet.dht.board as board_module

    monkeypatch.setattr(board_module, "_WAIT_POLL_S", 0.05)
    records: dict[str, dict[str, dict[str, Any]]] = {}
    boards = {}
    for p in ("a", "b"):
        node = _SlowPings(p, records)
        node.opts = DhtOptions(run="r", token="t", window_s=0.2, settle_s=0.0, leave_after_s=60.0)
        boards[p] = RoundBoard(node)  # type: ignore[arg-type]
        boards[p].expected[6] = boards[p].previous[6] = {"a", "b", "c"}  # c was cut off in round 5

    async def member(p: str, delay_s: float) -> tuple[Any, Any]:
        board = boards[p]
        await asyncio.sleep(delay_s)
        frozen, _ = await board.enter(6, "d")
        assert 6 in board.waited  # aborted: nobody applies it
        board.previous[7] = board.expected[7] = set(frozen.members)  # as `DhtGatherer.gather` does then
        after, _ = await board.enter(7, "d")  # the parameters did not change: the same digest
        return frozen, after

    async def run() -> list[tuple[Any, Any]]:
        return await asyncio.gather(member("b", 0.0), member("a", late_s))  # a: held to the deadline

    for frozen, after in asyncio.run(run()):
        assert frozen.members == ("a", "b")
        assert after.members == ("a", "b") and after.complete and after.majority  # together again, in time


# -- a peer cut off right after it froze a round with the others' announcements -----------------------------


class _Exchange:
    """The exchange as a cut-off peer sees it: the slices it got hold these contributors' payloads only."""

    def __init__(self, contributors: tuple[str, ...]) -> None:
        self.contributors = contributors

    async def run(self, r: int, payload: Any, **_: Any) -> Exchanged:
        return Exchanged(aggregate=payload, kept=payload, contributors=self.contributors, dead_owners=frozenset(),
                         bytes_up=10, bytes_down=0, slice_owners=("a", "b", "c"), disagreed=frozenset(), checked=0,
                         phases={})


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("got", "applies"), [(("c",), False), (("b", "c"), True), (("a", "b", "c"), True)])
def test_a_round_applies_only_with_the_payloads_of_a_majority_of_the_base(got: tuple[str, ...], applies: bool
                                                                          ) -> None:
    """c froze round 6 with a's and b's announcements, stored on its node just before its link went down:
    the exchange then brings c its own slice, merged from its own part alone. Applying that would be a
    round alone. A slice merged with b's part as well (2 of 3) is a majority's round."""
    records: dict[str, dict[str, dict[str, Any]]] = {}
    gatherers = {}
    for p in ("a", "b", "c"):
        node = _FakeNode(p, records)
        node.streams = SimpleNamespace(serve=lambda *_: None)  # type: ignore[attr-defined]
        node.gets = 0  # type: ignore[attr-defined]
        node.opts = DhtOptions(run="r", token="t", window_s=1.0, settle_s=0.0, leave_after_s=60.0)
        g = gatherers[p] = DhtGatherer(node, {})  # type: ignore[arg-type]
        g._board.expected[6] = g._board.previous[6] = {"a", "b", "c"}
        g._exchange = _Exchange(("a", "b") if p != "c" else got)  # type: ignore[assignment]

    async def run() -> list[Any]:
        return await asyncio.gather(*(g.gather(6, f"payload-{p}", loss=1.0, param_digest="d")
                                      for p, g in gatherers.items()))

    a, b, c = asyncio.run(run())
    assert not a.aborted and not b.aborted and a.contributors == ("a", "b")  # the majority side applies
    assert c.aborted is not applies
    assert c.aggregate == ("payload-c" if applies else None)
    assert c.contributors == (got if applies else ())
