"""DHT mode: two members of a round that waited for each other abort it together and go on together.

One of them was held to the exchange deadline of the round before (the third, a slice owner, was cut
off mid-exchange) and announces after the other froze alone. Whichever of the two finds the late
majority first is a round ahead when the other looks. Fake DHT nodes in memory; no sockets, no hivemind.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from demonet.dht.board import RoundBoard
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
