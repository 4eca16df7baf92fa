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

from demonet.dht.board import FrozeWithout, RoundBoard
from demonet.dht.exchange import Exchanged
from demonet.dht.gatherer import DhtGatherer
from demonet.dht.options import DhtOptions
from demonet.dht.uploads import Uploads
from demonet.transport import Digest, NotMember
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


def _gatherers(exchanges: dict[str, Any], expected: dict[str, set[str]], previous: set[str]
               ) -> dict[str, DhtGatherer]:
    """One `DhtGatherer` per peer on fake nodes sharing their records, each with its scripted exchange, and
    the members it expects in round 6 over the base `previous`."""
    records: dict[str, dict[str, dict[str, Any]]] = {}
    gatherers = {}
    for p, exchange in exchanges.items():
        node = _FakeNode(p, records)
        node.streams = SimpleNamespace(serve=lambda *_: None, uploads=Uploads())  # type: ignore[attr-defined]
        node.gets = 0  # type: ignore[attr-defined]
        node.opts = DhtOptions(run="r", token="t", window_s=1.0, settle_s=0.0, leave_after_s=60.0)
        g = gatherers[p] = DhtGatherer(node, {})  # type: ignore[arg-type]
        g._board.previous[6], g._board.expected[6] = set(previous), set(expected[p])
        g._exchange = exchange
    return gatherers


class _NothingAhead:
    """An exchange that sends no part ahead of a freeze and expects none."""

    def send_ahead(self, r: int, payload: Any, **_: Any) -> None:
        pass

    def drop_ahead(self, r: int) -> None:
        pass

    def expect(self, r: int, **_: Any) -> None:
        pass


class _Exchange(_NothingAhead):
    """The exchange as a cut-off peer sees it: the slices it got hold these contributors' payloads only."""

    def __init__(self, contributors: tuple[str, ...]) -> None:
        self.contributors = contributors

    async def run(self, r: int, payload: Any, **_: Any) -> Exchanged:
        return Exchanged(aggregate=payload, kept=payload, contributors=self.contributors, dead_owners=frozenset(),
                         bytes_up=10, bytes_down=0, slice_owners=("a", "b", "c"), disagreed=frozenset(), checked=0,
                         phases={})


    def other_lists(self, r: int) -> frozenset[str]:
        return frozenset()


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("got", "applies"), [(("c",), False), (("b", "c"), True), (("a", "b", "c"), True)])
def test_a_round_applies_only_with_the_payloads_of_a_majority_of_the_base(got: tuple[str, ...], applies: bool
                                                                          ) -> None:
    """c froze round 6 with a's and b's announcements, stored on its node just before its link went down:
    the exchange then brings c its own slice, merged from its own part alone. Applying that would be a
    round alone. A slice merged with b's part as well (2 of 3) is a majority's round."""
    everyone = ("a", "b", "c")
    gatherers = _gatherers({p: _Exchange(("a", "b") if p != "c" else got) for p in everyone},
                           dict.fromkeys(everyone, set(everyone)), set(everyone))

    async def run() -> list[Any]:
        return await asyncio.gather(*(g.gather(6, f"payload-{p}", loss=1.0, param_digest=Digest("d"))
                                      for p, g in gatherers.items()))

    a, b, c = asyncio.run(run())
    assert not a.aborted and not b.aborted and a.contributors == ("a", "b")  # the majority side applies
    assert c.aborted is not applies
    assert c.aggregate == ("payload-c" if applies else None)
    assert c.contributors == (got if applies else ())


# -- a node that holds stores: the next rounds do not wait for their confirmations -------------------------


class _HeldStores(_FakeNode):
    """A node whose stores reach the others at once but are confirmed only once `release` is set: a node of
    the routing table does not answer (a healed peer whose connection is not back yet)."""

    release: asyncio.Event

    async def store_many(self, values: dict[str, dict[str, Any]], also: Any = ()) -> None:
        await super().store_many(values, also)
        await self.release.wait()


@pytest.mark.timeout(20)
def test_a_peer_announces_its_next_rounds_while_a_node_holds_its_stores() -> None:
    """Each round's store runs on by itself: neither the round's end nor the next announcement waits for it
    (a majority peer held there announced after the others froze without it, and lost 10 s). Closing waits
    for the stores still on their way."""
    records: dict[str, dict[str, dict[str, Any]]] = {}
    held = _HeldStores("a", records)
    boards = {}
    for node in (held, _FakeNode("b", records)):
        node.opts = DhtOptions(run="r", token="t", window_s=5.0, settle_s=0.0, leave_after_s=60.0)
        boards[node.peer_id] = RoundBoard(node)  # type: ignore[arg-type]
        boards[node.peer_id].expected[1] = boards[node.peer_id].previous[1] = {"a", "b"}

    async def member(p: str) -> list[tuple[Any, dict[str, float]]]:
        board, out = boards[p], []
        for r in range(1, 6):
            frozen, _ = await board.enter(r, "d")
            out.append((frozen, board.phases()))
            board.previous[r + 1] = board.expected[r + 1] = set(frozen.members)
        return out

    async def run() -> tuple[list[Any], list[Any], bool]:
        held.release = asyncio.Event()
        async with asyncio.timeout(10.0):  # no store is ever confirmed meanwhile: no round may wait for one
            a, b = await asyncio.gather(member("a"), member("b"))
        closing = asyncio.create_task(boards["a"].stored())
        await asyncio.sleep(0.1)
        waited = not closing.done()
        held.release.set()
        await closing
        return a, b, waited

    a, b, waited = asyncio.run(run())
    for rounds in (a, b):
        assert [f.members for f, _ in rounds] == [("a", "b")] * 5
        assert all(f.complete and f.majority for f, _ in rounds)  # each in time, its window never reached
    # a's five stores were all held; its rows say so, with `announce` the time so far
    assert [ph["stores_pending"] for _, ph in a] == [1, 2, 3, 4, 5] and all("announce" in ph for _, ph in a)
    assert [ph["stores_pending"] for _, ph in b] == [0] * 5 and all("announce" in ph for _, ph in b)
    assert waited and not boards["a"]._storing  # closing waited for them, and they were confirmed then


# -- two member lists in one round (a joiner's registration read by some members only) ---------------------


class _Lists(_NothingAhead):
    """The exchange of rounds 6 and 7: in 6, `other` froze round 6 with another member list than this peer
    (scripted as the real exchange reports it: `late` only after its exchange ended), and the slices held
    `got`'s payloads; in 7, everyone's."""

    def __init__(self, got: tuple[str, ...], other: frozenset[str], late: frozenset[str]) -> None:
        self.got, self.other, self.late = got, other, late

    async def run(self, r: int, payload: Any, *, members: Any, **_: Any) -> Exchanged:
        got, other = (self.got, self.other - self.late) if r == 6 else (tuple(members), frozenset())
        return Exchanged(aggregate=payload, kept=payload, contributors=got, dead_owners=frozenset(), bytes_up=10,
                         bytes_down=0, slice_owners=tuple(members), other_lists=other)

    def other_lists(self, r: int) -> frozenset[str]:
        return self.other if r == 6 else frozenset()



@pytest.mark.timeout(10)
@pytest.mark.parametrize("told", ["at-once", "late", "never"])
def test_members_that_froze_a_round_with_two_lists_expect_each_other_in_the_next(told: str) -> None:
    """c registered to join at round 6; b read the registration in time, a did not. So a froze round 6 with
    a and b, and b and c with a, b and c. The parts cut for another list were refused: a's slices held its
    own payload only, b's and c's theirs, and all three aborted the round (no majority of a and b). Each
    then expects the peers that froze otherwise in round 7 as well as its contributors: the three freeze
    round 7 with one list and apply it. ``late``: c's part reached a after a's exchange ended (a knew of b
    only then), and a adds c when it enters round 7. ``never``: what the exchange reported before the
    lists were told apart (dead owners): b and c expect each other only and freeze at once without a,
    which freezes without c, two lists again."""
    lists = {"a": (("a",), frozenset({"b", "c"})), "b": (("b", "c"), frozenset({"a"})),
             "c": (("b", "c"), frozenset({"a"}))}
    exchanges = {p: _Lists(got, other if told != "never" else frozenset(),
                           frozenset({"c"}) if p == "a" and told == "late" else frozenset())
                 for p, (got, other) in lists.items()}
    gatherers = _gatherers(exchanges, {"a": {"a", "b"}, "b": {"a", "b", "c"}, "c": {"a", "b", "c"}}, {"a", "b"})

    async def run(r: int) -> list[Any]:
        return await asyncio.gather(*(g.gather(r, f"payload-{p}", loss=1.0, param_digest=Digest("d"))
                                      for p, g in gatherers.items()))

    assert all(x.aborted for x in asyncio.run(run(6)))
    expected = {p: set(g._board.expected[7]) for p, g in gatherers.items()}
    if told == "never":
        assert expected == {"a": {"a"}, "b": {"b", "c"}, "c": {"b", "c"}}
        return
    assert expected == {"a": {"a", "b"} if told == "late" else {"a", "b", "c"}, "b": {"a", "b", "c"},
                        "c": {"a", "b", "c"}}
    seven = asyncio.run(run(7))
    assert [(x.aborted, x.contributors) for x in seven] == [(False, ("a", "b", "c"))] * 3


# -- a joiner that some members counted in, left out by its own read of the freeze ------------------------


class _LeftOut(_Exchange):
    """A scripted exchange that records what its peer's gatherer tells it of the rounds it was left out of."""

    def __init__(self) -> None:
        super().__init__(("a", "b"))
        self.left: list[tuple[int, tuple[str, ...]]] = []

    async def left_out(self, r: int, members: Any) -> None:
        self.left.append((r, tuple(members)))


@pytest.mark.timeout(10)
def test_a_peer_that_read_a_freeze_without_itself_tells_its_exchange_the_members_it_read() -> None:
    """a and b read c's registration in time and expect it in round 6; c's own read expects a and b only (its
    donors' list), so its freeze is complete without it. c gets `NotMember` (a `FrozeWithout`, naming a and
    b), and its exchange is told, so that it answers a's and b's parts with that list
    (tests/integration/test_dht_lists.py) instead of leaving them to wait for its parts until the deadlines."""
    everyone = ("a", "b", "c")
    exchanges = {p: _LeftOut() for p in everyone}
    gatherers = _gatherers(exchanges, {"a": set(everyone), "b": set(everyone), "c": {"a", "b"}}, {"a", "b"})

    async def run() -> list[Any]:
        return await asyncio.gather(*(g.gather(6, f"payload-{p}", loss=1.0, param_digest=Digest("d"))
                                      for p, g in gatherers.items()), return_exceptions=True)

    a, b, c = asyncio.run(run())
    assert isinstance(c, FrozeWithout) and isinstance(c, NotMember) and c.members == ("a", "b"), c
    assert exchanges["c"].left == [(6, ("a", "b"))]
    assert not a.aborted and not b.aborted and exchanges["a"].left == exchanges["b"].left == []
