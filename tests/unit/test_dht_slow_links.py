"""`rules.slow_links`: which DHT members own no slice because their link is slow, from the announcements alone;
the digest parts are cut for, which names the owners; and the work an announcement says, for the dashboards."""

from __future__ import annotations

from demonet.dht import rules
from demonet.dht.rules import Announcement


def _announced(paces: dict[str, tuple[float, float, float] | None]) -> dict[str, Announcement]:
    return {p: Announcement(p, 0.0, "d", pace=pace) for p, pace in paces.items()}


def test_a_member_whose_exchange_is_far_over_the_others_owns_no_slice() -> None:
    # (need_s, least_s, train_s): the exchange is least_s - train_s
    announced = _announced({"a": (0.35, 0.35, 0.25), "b": (0.36, 0.36, 0.25), "c": (0.34, 0.34, 0.25),
                            "link": (1.25, 1.25, 0.25)})
    assert rules.slow_links(announced, list(announced)) == {"link"}


def test_a_member_slow_by_its_compute_or_a_little_slower_owns_slices() -> None:
    announced = _announced({"a": (0.35, 0.35, 0.25), "b": (0.36, 0.36, 0.25), "c": (0.34, 0.34, 0.25),
                            "compute": (1.4, 1.4, 1.0),  # its exchange is the others', its micro-batch is 4x
                            "hiccup": (0.44, 0.44, 0.25)})  # 1.9x the median exchange, but over it by 0.09 s
    assert rules.slow_links(announced, list(announced)) == frozenset()
    # An exchange under the member's own micro-batch: its round is slow by its compute as much as its link.
    announced = _announced({"a": (0.15, 0.15, 0.1), "b": (0.15, 0.15, 0.1), "both": (2.2, 2.2, 1.2)})
    assert rules.slow_links(announced, list(announced)) == frozenset()


def test_with_fewer_than_three_paces_none_is_the_norm() -> None:
    announced = _announced({"a": (0.35, 0.35, 0.25), "link": (1.25, 1.25, 0.25), "new": None})
    assert rules.slow_links(announced, list(announced)) == frozenset()
    announced = _announced({"a": (0.35, 0.35, 0.25), "b": (0.35, 0.35, 0.25), "link": (1.25, 1.25, 0.25)})
    assert rules.slow_links(announced, ["a", "b"]) == frozenset()  # only the round's members count
    assert rules.slow_links(announced, ["a", "b", "link"]) == {"link"}


def test_parts_cut_for_other_owners_carry_another_digest() -> None:
    members = ["a", "b", "c"]
    assert rules.members_digest(members) == rules.members_digest(members, members)  # every member owns
    assert rules.members_digest(members, ["a", "b"]) != rules.members_digest(members)
    assert rules.members_digest(members, ["a", "b"]) != rules.members_digest(members, ["a", "c"])
    assert rules.members_digest(["a", "b"]) != rules.members_digest(members, ["a", "b"])


def test_an_announcements_work_is_shown_only_where_it_is_valid() -> None:
    assert rules.announced_work([3, 0.75, 0.2]) == (3, 0.75, 0.2)
    assert rules.announced_work([0, 0, 0]) == (0, 0.0, 0.0)  # a spanning member's round that ended no micro-batch
    for bad in ([2**21, 0.5, 0.0], [3, -1.0, 0.0], [3, float("nan"), 0.0], [3, 0.5, -1.0], [3, 0.5, float("inf")],
                [True, 0.5, 0.0], ["3", 0.5, 0.0], [3, 0.5], [3], None, {"a": 1}):
        assert rules.announced_work(bad) is None, bad
