"""Verified slices in DHT mode (demonet.dht.rules): which slices a second owner merges, and which
owners a majority's reports leave out. Pure logic; the lying owner over real processes is in
tests/chaos/test_security.py."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from demonet.dht import rules

OWNERS = ["a", "b", "c", "d"]


def _announced(reports: dict[str, dict[str, int]]) -> dict[str, rules.Announcement]:
    return {p: rules.Announcement(p, 0.0, "d0", reports=reports.get(p, {})) for p in OWNERS}


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 1.0])
def test_a_seeded_fraction_of_slices_gets_a_second_owner_that_is_not_its_own(fraction: float) -> None:
    counts: Counter[int] = Counter()
    for r in range(400):
        chosen = rules.verifiers(r, "m1", OWNERS, len(OWNERS), fraction)
        assert chosen == rules.verifiers(r, "m1", OWNERS, len(OWNERS), fraction)  # every peer draws the same
        assert len(chosen) == math.ceil(fraction * len(OWNERS))
        for s, verifier in chosen.items():
            assert verifier in OWNERS and verifier != OWNERS[s]
        counts.update(chosen.keys())
    expected = 400 * math.ceil(fraction * len(OWNERS)) / len(OWNERS)
    assert all(abs(counts[s] - expected) < 0.25 * expected + 1 for s in range(len(OWNERS))), counts
    # Another round or member list draws otherwise.
    draws = {tuple(rules.verifiers(r, m, OWNERS, len(OWNERS), 0.25).items()) for r in range(20) for m in ("m1", "m2")}
    assert len(draws) > 4


def test_no_verification_without_a_second_owner_or_with_fraction_zero() -> None:
    assert rules.verifiers(3, "m", ["a"], 1, 1.0) == {}
    assert rules.verifiers(3, "m", OWNERS, 4, 0.0) == {}
    assert rules.verifiers(3, "m", OWNERS, 2, 1.0).keys() == {0, 1}  # fewer slices than owners (a tiny model)


def test_an_owner_reported_by_more_than_half_of_the_members_is_left_out() -> None:
    two = _announced({"a": {"d": 5}, "b": {"d": 5}})
    assert rules.excluded_owners(two, OWNERS, 6, 10) == frozenset()  # 2 of 4 is no majority
    three = _announced({"a": {"d": 5}, "b": {"d": 5, "c": 5}, "c": {"d": 4}})
    assert rules.excluded_owners(three, OWNERS, 6, 10) == {"d"}
    # Reports from peers that are not members of the round do not count.
    assert rules.excluded_owners(three, ["a", "b", "d"], 6, 10) == {"d"}
    assert rules.excluded_owners(three, ["a", "c", "d"], 6, 10) == {"d"}
    assert rules.excluded_owners(three, ["c", "d"], 6, 10) == frozenset()


def test_a_report_counts_for_the_given_number_of_rounds_after_its_round() -> None:
    announced = _announced({p: {"d": 5} for p in OWNERS})
    assert rules.excluded_owners(announced, OWNERS, 5, 3) == frozenset()  # not in the round it was seen in
    assert [r for r in range(4, 12) if rules.excluded_owners(announced, OWNERS, r, 3)] == [6, 7, 8]
    assert rules.excluded_owners(announced, OWNERS, 6, 0) == frozenset()  # exclusion off
