"""DHT mode's majority rule (no split brain): a round is applied only with more than half of the previous
round's members; silent members leave that base after `leave_after_s`; joiners count from the round after.

Fake announcements and a fake DHT node in memory; no sockets, no hivemind.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from demonet.dht.board import RoundBoard
from demonet.dht.freeze_rules import freeze, late_majority, majority_base, staying
from demonet.dht.options import DhtOptions
from demonet.dht.rules import Announcement, has_majority, next_base
from demonet.transport import NotMember


def _ann(peer: str, t: float) -> Announcement:
    return Announcement(peer, t, "d")


def test_a_majority_of_the_previous_members_freezes_a_minority_does_not() -> None:
    base = {"a", "b", "c"}
    assert has_majority({"a", "b"}, base) and has_majority({"a", "b", "c", "new"}, base)
    assert not has_majority({"c"}, base) and not has_majority({"c", "new", "other"}, base)  # strangers do not count
    assert not has_majority({"a", "b"}, {"a", "b", "c", "d"})  # 2 against 2: neither side
    assert not has_majority({"a"}, {"a", "b"})
    assert has_majority({"a"}, None) and has_majority({"a"}, set())  # no base: the first round

    seen = {"a": _ann("a", 10.0), "b": _ann("b", 10.5)}  # c is cut off
    frozen = freeze(seen, expected=base, start_peers=1, window_s=5.0, base=base)
    assert frozen is not None and frozen.majority and frozen.members == ("a", "b") and frozen.deadline == 15.0
    alone = freeze({"c": _ann("c", 10.2)}, expected=base, start_peers=1, window_s=5.0, base=base)
    assert alone is not None and not alone.majority and alone.members == ("c",)


def test_a_complete_round_without_a_majority_is_not_decided_early() -> None:
    # a was expected alone (b's payload missed the last round), but b is still a member of the base
    seen = {"a": _ann("a", 10.0), "b": _ann("b", 11.0)}
    frozen = freeze(seen, expected={"a"}, start_peers=1, window_s=5.0, base={"a", "b"})
    assert frozen is not None and not frozen.settled and frozen.deadline == 15.0
    assert frozen.members == ("a", "b") and frozen.majority
    assert freeze(seen, expected={"a"}, start_peers=1, window_s=5.0, base={"a"}).settled  # type: ignore[union-attr]


def test_members_not_heard_from_leave_the_base_after_the_timeout() -> None:
    previous = {"a", "b", "c"}
    seen = {"a": 100.0, "b": 100.0, "c": 1000.0}
    assert majority_base(previous, seen, now=650.0, leave_after_s=600.0) == previous
    assert majority_base(previous, seen, now=1000.0, leave_after_s=600.0) == {"c"}  # the survivor goes on
    assert majority_base(previous, {"c": 1000.0}, now=1000.0, leave_after_s=600.0) == {"c"}  # never seen
    # the survivor of a mass failure: stuck with 1 of 3 until the others leave its base
    assert not has_majority({"c"}, majority_base(previous, seen, now=700.0, leave_after_s=600.0))
    assert has_majority({"c"}, majority_base(previous, seen, now=701.0, leave_after_s=600.0))


def test_joiners_count_from_the_round_after_their_admission() -> None:
    # Round r: members a, b; the joiners x, y, z admitted for r+1 are expected but not in its base.
    expected, base = {"a", "b", "x", "y", "z"}, {"a", "b"}
    joiners_only = {p: _ann(p, 10.0) for p in ("x", "y", "z")}
    frozen = freeze(joiners_only, expected=expected, start_peers=1, window_s=5.0, base=base)
    assert frozen is not None and not frozen.majority  # three joiners are no majority of a and b
    with_a = freeze({**joiners_only, "a": _ann("a", 10.1), "b": _ann("b", 10.2)}, expected=expected,
                    start_peers=1, window_s=5.0, base=base)
    assert with_a is not None and with_a.majority and with_a.complete
    # Round r+2: its base is round r+1's members, joiners included; two of five are not a majority.
    assert not has_majority({"a", "b"}, set(with_a.members))
    assert has_majority({"x", "y", "z"}, set(with_a.members))


def test_a_split_two_against_two_does_not_shrink_either_sides_base_to_a_majority_of_its_own() -> None:
    # Round r of a, b, c, d is cut into {a, b} | {c, d}. Each side reads, besides its own announcements,
    # one of the far side stored before the cut: both freeze with 3 of 4 at the deadline and apply the
    # round with the slices of their side only.
    base = {"a", "b", "c", "d"}
    one = freeze({p: _ann(p, 10.0) for p in ("a", "b", "c")}, expected=base, start_peers=1, window_s=2.0, base=base)
    other = freeze({p: _ann(p, 10.0) for p in ("b", "c", "d")}, expected=base, start_peers=1, window_s=2.0, base=base)
    assert one is not None and one.majority and one.members == ("a", "b", "c")
    assert other is not None and other.majority and other.members == ("b", "c", "d")
    # 2 contributors of 4 on each side: neither holds a majority of the next round's base
    next_one = next_base(base, one.members, contributors=("a", "b"))
    next_other = next_base(base, other.members, contributors=("c", "d"))
    assert next_one == next_other == base
    assert not has_majority({"a", "b"}, next_one) and not has_majority({"c", "d"}, next_other)


def test_the_members_become_the_next_base_when_a_majority_of_the_base_contributed() -> None:
    # c died before announcing: a and b, 2 of 3, froze at the deadline, exchanged, and go on without it
    assert next_base({"a", "b", "c"}, ("a", "b"), contributors=("a", "b")) == {"a", "b"}
    # c died after the freeze: a member, but its payload is in no slice; a and b are still 2 of 3
    assert next_base({"a", "b", "c"}, ("a", "b", "c"), contributors=("a", "b")) == {"a", "b", "c"}
    # a joiner x counts from the round after its admission, whatever came through
    assert next_base({"a", "b"}, ("a", "b", "x"), contributors=("a", "b", "x")) == {"a", "b", "x"}
    assert next_base({"a", "b", "c"}, ("a", "b", "x"), contributors=("a",)) == {"a", "b", "c", "x"}
    assert next_base(None, ("a", "b"), contributors=()) == {"a", "b"}  # the first round: no base before it


# -- the board: a minority waits, writes nothing more, and catches up once the run is ahead -------------


class _FakeNode:
    """The part of `DhtNode` the board uses: records in a dict, the DHT time a counter."""

    def __init__(self, peer_id: str, records: dict[str, dict[str, dict[str, Any]]]) -> None:
        self.peer_id, self.address, self.records = peer_id, "addr-" + peer_id, records
        self.opts = DhtOptions(run="r", token="t", window_s=0.2, settle_s=0.0, leave_after_s=0.6)
        self.stored: list[str] = []
        self.reconnected: list[list[str]] = []  # the addresses a waiting minority pinged
        self.not_here: set[str] = set()  # peers whose stores never reached this node: only a search finds them
        self.searches: list[str] = []  # `get` (a search of the DHT), by key
        self.looks = 0  # `get_local` (this node's storage only)
        self.everywhere = True  # stores reach every node (a run of a few peers)
        self.also: list[list[str]] = []  # the member addresses each store also went to

    def key(self, *parts: object) -> str:
        return "/".join(str(p) for p in parts)

    async def store(self, key: str, value: dict[str, Any]) -> None:
        self.stored.append(key)
        self.records.setdefault(key, {})[self.peer_id] = value

    async def store_many(self, values: dict[str, dict[str, Any]], also: Any = ()) -> bool:
        self.also.append(sorted(also))
        for key, value in values.items():
            await self.store(key, value)
        return True

    async def get(self, key: str) -> dict[str, dict[str, Any]]:
        self.searches.append(key)
        return dict(self.records.get(key, {}))

    async def get_local(self, key: str, wait_for: Any = (), wait_s: float = 0.0) -> dict[str, dict[str, Any]]:
        self.looks += 1
        until = time.monotonic() + wait_s
        while True:
            here = {p: v for p, v in self.records.get(key, {}).items() if p not in self.not_here}
            if set(wait_for) <= set(here) or time.monotonic() >= until:
                return here
            await asyncio.sleep(0.005)

    async def reconnect(self, addresses: Any) -> int:
        self.reconnected.append(sorted(addresses))
        return len(self.reconnected[-1])


def _board(records: dict[str, dict[str, dict[str, Any]]], round: int) -> tuple[RoundBoard, _FakeNode]:
    node = _FakeNode("c", records)
    board = RoundBoard(node)  # type: ignore[arg-type]
    board.expected[round] = board.previous[round] = {"a", "b", "c"}
    return board, node


@pytest.mark.timeout(5)
def test_a_minority_waits_then_catches_up_once_the_majority_is_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    import demonet.dht.board as board_module

    monkeypatch.setattr(board_module, "_WAIT_POLL_S", 0.02)
    records: dict[str, dict[str, dict[str, Any]]] = {}
    board, node = _board(records, 5)
    told: list[tuple[int, bool]] = []
    board.on_minority = lambda r, minority: told.append((r, minority))

    async def heal() -> None:
        await asyncio.sleep(0.4)  # shorter than leave_after_s: a and b are still in c's base
        records["head"] = {"a": {"round": 9}}

    async def run() -> None:
        healing = asyncio.create_task(heal())
        with pytest.raises(NotMember, match="went on to round 9"):
            await board.enter(5, "d")
        await healing

    asyncio.run(run())
    assert node.stored == ["members/5", "state/5", "head"]  # nothing but its announcement (with its state)
    assert told == [(5, True), (5, False)] and 5 not in board.waited
    assert node.reconnected and all(set(r) <= {"addr-a", "addr-b"} for r in node.reconnected)  # not itself


@pytest.mark.timeout(5)
def test_a_lone_survivor_goes_on_once_the_silent_leave_its_base(monkeypatch: pytest.MonkeyPatch) -> None:
    import demonet.dht.board as board_module

    monkeypatch.setattr(board_module, "_WAIT_POLL_S", 0.02)
    board, _ = _board({}, 5)
    frozen, _ = asyncio.run(board.enter(5, "d"))  # a and b never seen: out of the base after leave_after_s
    assert frozen.members == ("c",) and frozen.majority and 5 in board.waited


def test_peers_that_left_are_neither_waited_for_nor_counted_in_the_base_unless_they_announced() -> None:
    here = staying({"a", "b", "c", "j"}, {"a", "b", "c"}, {"c": 1.0}, left={"a", "b"})
    assert here.expected == {"c", "j"} and here.previous == {"c"}
    assert has_majority({"c"}, here.previous) and not has_majority({"c"}, {"a", "b", "c"})
    # One that announced the round is in it, whatever it said after: the same members for every reader.
    assert staying({"a", "c"}, {"a", "c"}, {"a", "c"}, left={"a"}).expected == {"a", "c"}
    assert staying(None, None, {}, left={"a"}) == staying(None, None, {}, left=())  # the first round: no base


@pytest.mark.timeout(5)
def test_a_round_freezes_at_once_without_the_members_that_said_they_leave() -> None:
    records: dict[str, dict[str, dict[str, Any]]] = {}
    leaving = {name: RoundBoard(_FakeNode(name, records)) for name in ("a", "b")}  # type: ignore[arg-type]
    for board in leaving.values():
        assert asyncio.run(board.leave(5))
    board, _ = _board(records, 5)
    frozen, _ = asyncio.run(board.enter(5, "d"))  # 1 of a base of 3 without the leaves: no majority
    assert frozen.members == ("c",) and frozen.complete and frozen.majority and 5 not in board.waited
    assert board.left == {"a": 5, "b": 5}

    # a comes back (a restart): its registration for round 7, read with round 6's records, undoes its leave.
    records["members/6"] = {"a": {"join": 100.0}}
    asyncio.run(board._announced(6))
    assert board.left == {"b": 5}


def test_a_peer_that_leaves_a_round_it_announced_keeps_its_announcement() -> None:
    records: dict[str, dict[str, dict[str, Any]]] = {}
    board = RoundBoard(_FakeNode("a", records))  # type: ignore[arg-type]
    board._announcements[5] = {"t": 1.0, "digest": "d", "address": "addr-a", "client": False}
    asyncio.run(board.leave(5))
    record = records["members/5"]["a"]
    assert record["digest"] == "d" and isinstance(record["left"], float)
    reader, _ = _board(records, 5)
    assert set(asyncio.run(reader._announced(5))) == {"a"}  # still a member of round 5


def test_late_announcements_rescue_a_round_that_had_no_majority_at_its_deadline() -> None:
    # a and b both alive, announced 3 s apart (a heal, a slow store): at the deadline a is alone
    seen = {"a": _ann("a", 10.0), "b": _ann("b", 13.0)}
    frozen = freeze(seen, expected={"a", "b"}, start_peers=1, window_s=2.0, base={"a", "b"})
    assert frozen is not None and frozen.members == ("a",) and not frozen.majority
    assert late_majority(seen, {"a", "b"}) == ("a", "b")
    assert late_majority({"c": _ann("c", 10.0)}, {"a", "b", "c"}) is None


def test_base_members_registered_to_join_the_next_round_count_for_a_late_majority() -> None:
    # After a split two against two, c and d wait a round ahead of a and b, which registered to join
    # the round after: c and d abort their round and admit them; strangers registered do not count
    base, waiting = {"a", "b", "c", "d"}, {p: _ann(p, 10.0) for p in ("c", "d")}
    assert late_majority(waiting, base) is None
    assert late_majority(waiting, base, following={"a", "b"}) == ("c", "d")
    assert late_majority(waiting, base, following={"x", "y", "z"}) is None


def test_registrations_are_read_with_the_freeze_and_keep_a_resyncing_peers_announcement() -> None:
    from demonet.dht.deadlines import now

    records: dict[str, dict[str, dict[str, Any]]] = {}
    board, node = _board(records, 5)
    joiner = RoundBoard(_FakeNode("j", records))  # type: ignore[arg-type]
    asyncio.run(joiner.register([6, 7]))  # among the announcements of rounds 5 and 6, as no announcement
    assert set(records) == {"members/5", "members/6"} and "digest" not in records["members/5"]["j"]
    for p in ("a", "b"):
        records["members/5"][p] = {"t": now(), "digest": "d", "address": "addr-" + p, "client": False}
    frozen, announced = asyncio.run(board.enter(5, "d"))
    assert frozen.members == ("a", "b", "c") and set(announced) == {"a", "b", "c"}  # the registration is no member
    assert node.stored == ["members/5", "state/5", "head"]  # one store (of three keys), no read but the freeze's
    assert board.joiners(6, frozen.deadline) == {"j"}
    assert board.joiners(6, records["members/5"]["j"]["join"]) == set()  # registered too late for that freeze
    assert board.joiners(7, frozen.deadline) == set()  # round 6's records not read yet

    # c resyncs after round 5 and registers for 6: its record keeps its announcement of round 5
    asyncio.run(board.register([6]))
    mine = records["members/5"]["c"]
    assert mine["digest"] == "d" and mine["address"] == "addr-c" and mine["join"] >= mine["t"]


# -- the freeze searches the DHT once a round ----------------------------------------------------------


def _announce(records: dict[str, dict[str, dict[str, Any]]], peer: str, r: int) -> None:
    from demonet.dht.deadlines import now

    records.setdefault(f"members/{r}", {})[peer] = {"t": now(), "digest": "d", "address": "addr-" + peer,
                                                     "client": False}


@pytest.mark.timeout(5)
def test_the_freeze_looks_here_while_it_waits_and_decides_without_a_search_once_all_are_here() -> None:
    records: dict[str, dict[str, dict[str, Any]]] = {}
    board, node = _board(records, 5)
    board._steady = True  # its last round froze complete at once

    async def run() -> Any:
        async def others() -> None:  # a and b announce while c waits for them
            await asyncio.sleep(0.1)
            _announce(records, "a", 5)
            await asyncio.sleep(0.05)
            _announce(records, "b", 5)

        arriving = asyncio.create_task(others())
        frozen, _ = await board.enter(5, "d")
        await arriving
        return frozen

    frozen = asyncio.run(run())
    assert frozen.members == ("a", "b", "c") and frozen.complete
    assert node.searches == []  # its own storage held every expected announcement: no DHT search
    assert 1 <= node.looks <= 3  # a look waits for the missing announcements, it does not poll


@pytest.mark.timeout(5)
def test_an_announcement_stored_elsewhere_only_is_found_by_the_search_at_the_deadline() -> None:
    records: dict[str, dict[str, dict[str, Any]]] = {}
    board, node = _board(records, 5)
    board._steady = True  # its last round froze complete at once
    node.not_here = {"b"}  # b's store to this node failed; the other nodes hold it
    _announce(records, "a", 5)
    _announce(records, "b", 5)
    frozen, announced = asyncio.run(board.enter(5, "d"))
    # Its own storage never looked complete: the search at the deadline finds b, and the round freezes
    # with the members the others froze it with.
    assert frozen.members == ("a", "b", "c") and set(announced) == {"a", "b", "c"}
    assert node.searches == ["members/5"]


@pytest.mark.timeout(5)
def test_a_search_every_second_finds_what_was_stored_elsewhere_before_the_deadline(monkeypatch: pytest.MonkeyPatch
                                                                                   ) -> None:
    import demonet.dht.board as board_module

    monkeypatch.setattr(board_module, "_SEARCH_EVERY_S", 0.1)
    records: dict[str, dict[str, dict[str, Any]]] = {}
    board, node = _board(records, 5)
    board._steady = True  # its last round froze complete at once
    node.opts = DhtOptions(run="r", token="t", window_s=30.0, settle_s=0.0, leave_after_s=60.0)
    node.not_here = {"b"}
    _announce(records, "a", 5)
    _announce(records, "b", 5)
    frozen, _ = asyncio.run(board.enter(5, "d"))  # long before the 30 s deadline
    assert frozen.members == ("a", "b", "c") and frozen.complete and node.searches == ["members/5"]


def test_a_registration_is_stored_again_once_this_node_met_the_members_it_did_not_know() -> None:
    records: dict[str, dict[str, dict[str, Any]]] = {}
    records["state/4"] = {p: {"digest": "d", "address": "addr-" + p, "client": False, "expected": ["a", "b"]}
                          for p in ("a", "b")}
    node = _FakeNode("j", records)
    joiner = RoundBoard(node)  # type: ignore[arg-type]
    asyncio.run(joiner.register([5, 6]))
    # stored at once (before meeting anyone), then again after the members' nodes were met
    assert node.stored == ["members/4", "members/5"] * 2
    assert node.reconnected == [["addr-a", "addr-b"]] and node.searches == ["state/4"]


def test_after_a_round_that_was_not_complete_at_once_or_in_a_large_run_every_look_is_a_search() -> None:
    for steady, everywhere in ((False, True), (True, False)):
        records: dict[str, dict[str, dict[str, Any]]] = {}
        board, node = _board(records, 5)
        board._steady, node.everywhere = steady, everywhere
        for p in ("a", "b"):
            _announce(records, p, 5)
        frozen, _ = asyncio.run(board.enter(5, "d"))
        assert frozen.complete and node.looks == 0 and set(node.searches) == {"members/5"}, (steady, everywhere)
        assert board._steady  # complete at once: the next round may decide from its own node


def test_an_announcement_also_goes_to_the_nodes_of_the_members_it_expects() -> None:
    records: dict[str, dict[str, dict[str, Any]]] = {}
    board, node = _board(records, 5)
    board.addresses = {"a": "addr-a", "b": "addr-b", "c": "addr-c", "gone": "addr-gone"}
    for p in ("a", "b"):
        _announce(records, p, 5)
    asyncio.run(board.enter(5, "d"))
    assert node.also == [["addr-a", "addr-b"]]  # not itself, not a peer outside the round



# -- a registration names rounds far enough ahead of a fast run -----------------------------------------


@pytest.mark.timeout(10)
def test_a_rejoining_peer_registers_ahead_of_rounds_shorter_than_the_settle_time() -> None:
    from demonet.dht.membership import DhtMembership
    from demonet.transport import JoinInfo, Parameters

    class _Run:
        """Rounds of 20 ms; a registration counts only for a round that starts settle_s after it."""

        opts = DhtOptions(run="r", token="t", window_s=2.0, exchange_timeout_s=1.0, settle_s=0.2)

        def __init__(self) -> None:
            self.start, self.registered = time.monotonic(), {}

        def _head(self) -> int:
            return int((time.monotonic() - self.start) / 0.02)

        async def head_round(self) -> int:
            return self._head()

        async def register(self, rounds: list[int]) -> None:
            self.registered.update({r: time.monotonic() for r in rounds})

        async def admitted(self, r: int, timeout_s: float) -> bool:
            while self._head() < r:
                await asyncio.sleep(0.005)
            return self.registered[r] < self.start + r * 0.02 - self.opts.settle_s

        async def load_parameters(self, r: int, expected: Any) -> tuple[dict, int, list[str]]:
            return {}, 0, ["a"]

    run = _Run()
    info = JoinInfo(peer_id="c", round=0, run_config={}, data_seed=0, round_timeout_s=2.0, heartbeat_interval_s=0.0,
                    total_rounds=0)
    got = asyncio.run(DhtMembership(run, info).rejoin({}))  # type: ignore[arg-type]
    assert isinstance(got, Parameters) and got.round - min(run.registered) >= 10  # named 10+ rounds ahead
    assert len(run.registered) <= 6  # found on its second try: the first one measured the pace
