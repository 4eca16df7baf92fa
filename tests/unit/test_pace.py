"""The round length a coordinator announces, and a DHT peer computes from the announcements
(`demonet.wire.pace.RoundPace`, `demonet.dht.rules.announced_pace`): pure logic."""

from __future__ import annotations

import pytest

from demonet.coordinator.rounds import RoundConfig, Rounds
from demonet.dht.rules import announced_pace
from demonet.wire.pace import MIN_GAP_S, MOST_S, RoundPace


def _pace(**kw: float) -> RoundPace:
    return RoundPace(max_micro_batches=16, round_timeout_s=30.0, **kw)  # type: ignore[arg-type]


def test_alike_members_stay_lockstep() -> None:
    pace = _pace()
    for peer, need in (("a", 1.0), ("b", 1.1), ("c", 1.2), ("d", 1.4)):
        pace.report(peer, need, need)
    assert pace.close("abcd") == 0.0
    assert pace.deadline_s(30.0) == 30.0  # lockstep rounds wait up to the round timeout


def test_a_hiccup_of_milliseconds_does_not_turn_rounds_over() -> None:
    pace = _pace()
    for peer, need in (("a", 0.01), ("b", 0.01), ("c", 0.05)):  # 5x the median, but 40 ms
        pace.report(peer, need, need)
    assert pace.close("abc") == 0.0
    assert 0.05 - 0.01 < MIN_GAP_S


def test_a_hiccup_of_milliseconds_does_not_make_a_member_span() -> None:
    """Rounds of 20 ms: one member's round and forward and backward twice the others' for a round is noise, not a
    slower accelerator; the rounds keep waiting for it."""
    pace = _pace()
    for peer in "abc":
        pace.report(peer, 0.02, 0.02, train_s=0.01)
    pace.report("d", 0.05, 0.05, train_s=0.03)
    assert pace.close("abcd") == 0.0 and pace.spanning == set()


def test_a_slow_link_turns_rounds_to_the_clock_long_enough_for_its_one_micro_batch() -> None:
    """Three peers of 0.35 s a round and one of 1.1 s of which its forward and backward are 0.25 s (a slow link,
    one micro-batch each): the round is the slow one's one micro-batch and exchange and a tenth, so it is in every
    round and the others train four."""
    pace = _pace()
    for peer in "abc":
        pace.report(peer, 0.35, 0.35)
    pace.report("slow", 1.1, 1.1, train_s=0.25)
    assert pace.close(["a", "b", "c", "slow"]) == pytest.approx(1.21)
    assert pace.deadline_s(30.0) == pytest.approx(3.42)  # twice the length and a second
    # The next close moves halfway toward a new target (the slow one got slower), never jumps.
    pace.report("slow", 2.1, 2.1, train_s=0.25)
    assert pace.close(["a", "b", "c", "slow"]) == pytest.approx(1.21 + 0.5 * (2.31 - 1.21))
    assert pace.spanning == set()


def test_a_member_too_slow_for_any_round_is_not_waited_for() -> None:
    """One micro-batch round of 100 s (99.75 s of it its link), over 16 median rounds of 0.35 s (5.6 s): the round
    is not stretched toward it."""
    pace = _pace()
    for peer in "abc":
        pace.report(peer, 0.35, 0.35)
    pace.report("glacial", 100.0, 100.0, train_s=0.25)
    assert pace.close(["a", "b", "c", "glacial"]) == pytest.approx(1.1 * 0.35)  # as if it were not there


def test_a_member_slow_by_its_compute_spans_rounds_and_rounds_stay_lockstep() -> None:
    """Three peers of 0.35 s a round and one whose round is 1.1 s, 1.0 s of it its forward and backward: it spans rounds
    (its payload enters the round open when it comes) and rounds stay as short as the three need. Its report
    stays, so once it is as fast as the others it is waited on again."""
    pace = _pace()
    for peer in "abc":
        pace.report(peer, 0.35, 0.35, train_s=0.25)
    pace.report("slow", 1.1, 1.1, train_s=1.0)
    assert pace.close(["a", "b", "c", "slow"]) == 0.0 and pace.spanning == {"slow"}
    pace.report("slow", 0.5, 0.5, train_s=0.4)  # under SPAN times the median: alike again, waited on
    assert pace.close(["a", "b", "c", "slow"]) == 0.0 and pace.spanning == set()
    two = _pace()  # of two members neither is the norm: the clock covers the slower one
    two.report("a", 0.35, 0.35)
    two.report("slow", 1.1, 1.1, train_s=1.0)
    assert two.close(["a", "slow"]) > 0 and two.spanning == set()


def test_without_late_payloads_a_member_slow_by_its_compute_is_covered_not_spanning() -> None:
    """DHT mode (`spans` False): the member that would span in coordinator mode sets the round instead, its one
    micro-batch and exchange and a tenth, so it is in every round and the others train more meanwhile."""
    pace = _pace(spans=False)
    for peer in "abc":
        pace.report(peer, 0.35, 0.35, train_s=0.25)
    pace.report("slow", 1.1, 1.1, train_s=1.0)
    # 1.21 s made up to the others' exchange (0.1 s) and five whole micro-batches of theirs, with 5% to spare
    assert pace.close(["a", "b", "c", "slow"]) == pytest.approx(0.1 + 1.05 * 5 * 0.25) and pace.spanning == set()


@pytest.mark.parametrize("value", [None, "1,1,1", [1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, -0.5, 0.1],
                                   [1.0, float("nan"), 0.1], [1.0, float("inf"), 0.1], [MOST_S * 2, 1.0, 0.5],
                                   [True, 1.0, 0.5], ["1", 1.0, 0.5], {"need_s": 1.0}])
def test_an_announced_pace_that_is_not_three_seconds_counts_is_ignored(value: object) -> None:
    assert announced_pace(value) is None


def test_an_announced_pace_is_read_as_floats() -> None:
    assert announced_pace([1, 0.5, 0.25]) == (1.0, 0.5, 0.25)
    assert announced_pace((0.0, 0.0, 0.0)) == (0.0, 0.0, 0.0)  # not measured yet: `report` ignores it


def test_a_member_slow_by_its_link_is_covered_by_the_clock_not_spanning() -> None:
    """Its one-micro-batch round is 1.6x the others' (its upload 0.2 s of it) but its forward and backward are theirs:
    it does not span (it would send a payload every few rounds); the clock covers its round and its k shrinks to
    its link (`demonet.loop.link.LinkPace`). The round, 1.1x its own (0.528 s), is made up to two whole
    micro-batches of the others and their exchange, with 5% to spare: they train two, not one and a wait."""
    pace = _pace()
    for peer in "abc":
        pace.report(peer, 0.3, 0.3, train_s=0.27)
    pace.report("far", 0.48, 0.48, train_s=0.27)
    assert pace.close(["a", "b", "c", "far"]) == pytest.approx(0.03 + 1.05 * 2 * 0.27) and pace.spanning == set()


def test_rounds_go_back_to_lockstep_once_the_slow_member_leaves() -> None:
    pace = _pace()
    for peer in "abc":
        pace.report(peer, 0.35, 0.35)
    pace.report("slow", 1.1, 1.1, train_s=0.25)
    assert pace.close(["a", "b", "c", "slow"]) > 0
    assert pace.close(["a", "b", "c"]) == 0.0  # its report goes with its membership


def test_fixed_and_lockstep_ignore_the_reports() -> None:
    fixed, lockstep = _pace(fixed_s=2.0), RoundPace(lockstep=True)
    for pace in (fixed, lockstep):
        pace.report("a", 0.1, 0.1)
        pace.report("slow", 5.0, 5.0)
    assert fixed.close(["a", "slow"]) == 2.0 and fixed.deadline_s(30.0) == 30.0
    assert lockstep.close(["a", "slow"]) == 0.0
    with pytest.raises(ValueError, match="exclude"):
        RoundPace(fixed_s=1.0, lockstep=True)


def test_unmeasured_reports_are_ignored() -> None:
    pace = _pace()
    pace.report("a", 0.0, 0.0)
    assert pace.close(["a"]) == 0.0 and not pace.reports


def test_the_round_waits_for_its_members_as_long_as_its_limit() -> None:
    rounds = Rounds(cfg=RoundConfig(round_timeout_s=30.0), now=0.0)
    rounds.join("a", 0.0)
    assert rounds.deadline == 30.0
    rounds.limit_s = 3.2
    assert rounds.deadline == pytest.approx(3.2)


def test_without_late_payloads_a_spanning_member_gets_rounds_by_the_clock_of_the_others() -> None:
    """DHT mode with spanning (`late` False): the member slow by its compute spans, and where the others are alike
    (lockstep among themselves), the rounds still go by the clock, as long as the median other's own round, so the
    spanning member has a cut-off to send what it has by; it spans no more once it is as fast as the others."""
    pace = _pace(late=False)
    for peer in "abc":
        pace.report(peer, 0.35, 0.35, train_s=0.25)
    pace.report("slow", 1.1, 1.1, train_s=1.0)
    assert pace.close(["a", "b", "c", "slow"]) == pytest.approx(0.35) and pace.spanning == {"slow"}
    pace.report("slow", 0.4, 0.4, train_s=0.3)
    assert pace.close(["a", "b", "c", "slow"]) == 0.0 and pace.spanning == set()
