"""The round state machine with a fake clock: joins, deadlines, quorum, stragglers, restarts."""

import pytest

from demonet.coordinator.rounds import RoundConfig, Rounds
from demonet.errors import SubmitRejected

CFG = RoundConfig(round_timeout_s=10.0, min_peers=2, heartbeat_timeout_s=5.0)


def test_first_peer_opens_an_idle_run_and_others_wait_for_the_boundary() -> None:
    r = Rounds(cfg=CFG, now=0.0)
    assert not r.due(100.0)  # idle: nobody to wait for, no deadline passes
    assert r.join("a", 100.0) == 0
    assert r.deadline == 110.0
    assert r.join("b", 101.0) == 1  # a round is running: admitted at the next boundary
    r.submit("a", 0, 102.0)
    assert r.due(102.0)  # every member is in
    closed = r.close(102.0)
    assert (closed.round, closed.contributors, closed.aborted) == (0, ("a",), True)  # 1 < min_peers
    assert set(r.members) == {"a", "b"} and r.round == 1 and r.deadline == 112.0


def test_closes_early_when_all_members_submit_and_at_the_deadline_otherwise() -> None:
    r = Rounds(cfg=CFG, now=0.0)
    for p in "abc":
        r.join(p, 0.0)
    r.members.update(dict.fromkeys("bc", 0.0))  # all three are members of round 0, with work done
    r.worked.update("bc")
    r.joiners.clear()
    for p in "ab":
        r.submit(p, 0, 1.0)
    r.heartbeat("c", 4.0)
    assert not r.due(4.0)
    r.heartbeat("c", 8.0)  # alive, but never submits
    assert not r.due(9.99)
    assert r.due(10.0)  # the straggler "c" is not waited on past the deadline
    closed = r.close(10.0)
    assert closed.contributors == ("a", "b") and not closed.aborted
    assert "c" in r.members  # still a member: it may make the next round


def test_silent_peers_are_dropped_but_not_after_submitting() -> None:
    r = Rounds(cfg=CFG, now=0.0)
    r.join("a", 0.0)
    r.members.update({"b": 0.0, "c": 0.0})
    r.submit("a", 0, 1.0)
    r.submit("b", 0, 1.0)
    assert r.due(6.0)  # "c" went silent (> 5 s): dropped, and everyone left has submitted
    assert set(r.members) == {"a", "b"}
    assert not r.heartbeat("c", 6.0)  # it must join again


def test_a_member_that_leaves_is_not_waited_for_and_its_payload_in_still_counts() -> None:
    r = Rounds(cfg=CFG, now=0.0)
    r.join("a", 0.0)
    r.members.update(dict.fromkeys("bcd", 0.0))
    r.worked.update("bcd")
    r.joiners["e"] = 0.0  # admitted for the next round
    r.submit("a", 0, 1.0)
    r.submit("b", 0, 1.0)
    assert not r.due(1.0)  # c and d are members still out
    assert r.leave("c") and not r.due(1.0)
    r.submit("d", 0, 1.5)
    assert r.leave("d")  # its payload is in: it still counts
    assert r.due(1.5)  # well before the deadline (10 s) and before c would have been dropped (5 s)
    assert r.leave("e") and not r.leave("c") and not r.leave("zed")  # a joiner; gone already; never there
    closed = r.close(1.5)
    assert closed.contributors == ("a", "b", "d") and not closed.aborted
    assert set(r.members) == {"a", "b"} and not r.joiners  # d and e must join again
    with pytest.raises(SubmitRejected, match="not a member"):
        r.submit("c", 1, 2.0)


@pytest.mark.parametrize(("peer", "round_", "reason"), [
    ("a", 0, "closed"), ("a", 2, "has not opened"), ("zed", 1, "not a member"),
])
def test_bad_submissions_are_rejected(peer: str, round_: int, reason: str) -> None:
    r = Rounds(cfg=CFG, now=0.0)
    r.join("a", 0.0)
    r.close(1.0)
    with pytest.raises(SubmitRejected, match=reason):
        r.submit(peer, round_, 1.5)
    r.submit("a", 1, 2.0)
    with pytest.raises(SubmitRejected, match="already submitted"):
        r.submit("a", 1, 2.5)
    assert r.submitted == ["a"]  # the rejected ones changed nothing


def test_the_next_rounds_payload_may_come_early_only_after_the_open_rounds() -> None:
    r = Rounds(cfg=CFG, now=0.0)
    for p in "ab":
        r.join(p, 0.0)
    r.close(1.0)  # both members of round 1
    with pytest.raises(SubmitRejected, match="has not opened") as err:
        r.check_submit("a", 2)  # not early: the next round is not open
    assert err.value.kind == "future"
    with pytest.raises(SubmitRejected, match="a's payload for round 1, which is not in") as err:
        r.check_submit("a", 2, early=True)  # a restarted coordinator lost it: a does round 1 over
    assert err.value.kind == "future"
    r.submit("a", 1, 2.0)
    r.check_submit("a", 2, early=True)
    with pytest.raises(SubmitRejected, match="round 3 has not opened"):
        r.check_submit("a", 3, early=True)  # one round ahead at most
    with pytest.raises(SubmitRejected, match="b's payload for round 1"):
        r.check_submit("b", 2, early=True)
    assert (r.round, r.submitted) == (1, ["a"])  # the checks changed nothing


def test_stale_flag_tells_a_peer_to_catch_up() -> None:
    r = Rounds(cfg=CFG, now=0.0)
    r.join("a", 0.0)
    r.close(1.0)
    with pytest.raises(SubmitRejected) as err:
        r.submit("a", 0, 1.0)
    assert err.value.stale


def test_restart_resumes_the_open_round_with_its_members() -> None:
    r = Rounds(cfg=CFG, now=0.0)
    r.join("a", 0.0)
    r.join("b", 0.0)
    r.close(1.0)
    r.worked.add("b")  # as if its payload had been in before the restart
    back = Rounds.from_state(CFG, r.state_dict(), now=50.0)
    assert back.round == 1 and set(back.members) == {"a", "b"} and back.deadline == 60.0
    assert back.join("a", 51.0) == 1  # a member reconnecting resumes the open round
    slow = RoundConfig(round_timeout_s=2.0, heartbeat_timeout_s=6.0)
    back = Rounds.from_state(slow, r.state_dict(), now=50.0)
    assert back.deadline == 56.0  # reconnecting peers get a heartbeat timeout, not just a round
    back.submit("a", 1, 51.0)
    assert not back.due(55.0)
    back.submit("b", 1, 55.5)
    assert back.due(55.5)  # still closes early once everyone is back


def test_bad_config() -> None:
    with pytest.raises(ValueError, match="min_peers"):
        RoundConfig(min_peers=0)
    with pytest.raises(ValueError, match="round_timeout_s"):
        RoundConfig(round_timeout_s=0)


def test_the_first_round_waits_for_start_peers() -> None:
    r = Rounds(cfg=RoundConfig(round_timeout_s=10.0, start_peers=3), now=0.0)
    assert r.join("a", 0.0) == 0
    assert r.join("b", 5.0) == 0
    r.heartbeat("a", 99.0)
    r.heartbeat("b", 99.0)
    assert not r.due(100.0)  # not started: no deadline runs, nothing closes
    assert r.join("c", 101.0) == 0  # the third peer opens round 0 with all three as members
    assert set(r.members) == {"a", "b", "c"} and r.deadline == 111.0
    assert r.join("d", 102.0) == 1  # after the start, joiners wait for the boundary


def _round_with(r: Rounds, submitters: str, now: float) -> float:
    """Submit `submitters` to the open round at `now`; return when it closes (early, or at its deadline)."""
    for p in submitters:
        r.submit(p, r.round, now)
    for p in r.members:
        r.heartbeat(p, now)
    if not r.due(now):
        now = r.deadline
        for p in r.members:
            r.heartbeat(p, now)
        assert r.due(now)
    r.close(now)
    return now


def _two_members(cfg: RoundConfig) -> Rounds:
    r = Rounds(cfg=cfg, now=0.0)
    r.join("a", 0.0)
    r.members["f"] = 0.0  # "f" had work in (a founding member), heartbeats and never submits again
    r.worked.add("f")
    return r


def test_a_member_that_never_submits_stops_delaying_rounds_after_max_idle_rounds() -> None:
    r = _two_members(RoundConfig(round_timeout_s=10.0, heartbeat_timeout_s=5.0, max_idle_rounds=3))
    now, waits = 0.0, []
    for _ in range(6):
        opened = r.opened_at
        now = _round_with(r, "a", now + 1.0)
        waits.append(now - opened)
    assert waits == [10.0, 10.0, 10.0, 1.0, 1.0, 1.0]  # three deadlines, then "a" alone closes each round
    assert r.idle == {"f"} and r.missed["f"] == 6
    assert "f" in r.members and r.heartbeat("f", now)  # still connected: its heartbeats answer member
    assert r.active == ["a"]


def test_an_idle_member_is_active_again_once_it_submits() -> None:
    r = _two_members(RoundConfig(round_timeout_s=10.0, heartbeat_timeout_s=5.0, max_idle_rounds=2))
    now = _round_with(r, "a", 1.0)
    now = _round_with(r, "a", now + 1.0)
    assert r.idle == {"f"}
    r.submit("f", r.round, now + 1.0)  # accepted and counted in the open round
    assert r.idle == set() and r.submitted == ["f"]
    assert not r.due(now + 1.0)  # "a" is still out
    r.submit("a", r.round, now + 2.0)
    assert r.due(now + 2.0) and r.close(now + 2.0).contributors == ("a", "f")
    assert "f" not in r.missed
    opened = r.opened_at
    now = _round_with(r, "a", opened + 1.0)
    assert now == opened + 10.0  # active again: the next round waits for it up to its deadline


def test_heartbeats_keep_an_idle_member_connected_but_do_not_make_it_active() -> None:
    r = _two_members(RoundConfig(round_timeout_s=10.0, heartbeat_timeout_s=5.0, max_idle_rounds=1))
    now = _round_with(r, "a", 1.0)
    assert r.idle == {"f"}
    for t in (1.0, 2.0, 3.0):
        assert r.heartbeat("f", now + t)
    assert r.idle == {"f"} and r.join("f", now + 3.5) == r.round  # a rejoin does not make it active either
    r.submit("a", r.round, now + 4.0)
    assert r.due(now + 4.0)
    r.close(now + 4.0)
    assert not r.due(now + 10.0)  # silent for more than the heartbeat timeout: dropped, idle or not
    assert "f" not in r.members and "f" not in r.idle and "f" not in r.missed
    assert not r.heartbeat("f", now + 10.0)


def test_max_idle_rounds_0_waits_for_every_member_as_before() -> None:
    r = _two_members(RoundConfig(round_timeout_s=10.0, heartbeat_timeout_s=5.0, max_idle_rounds=0))
    now = 0.0
    for _ in range(5):
        opened = r.opened_at
        now = _round_with(r, "a", now + 1.0)
        assert now - opened == 10.0
    assert r.idle == set() and r.missed["f"] == 5


def test_a_joiners_count_starts_at_its_first_round_as_a_member() -> None:
    r = Rounds(cfg=RoundConfig(round_timeout_s=10.0, heartbeat_timeout_s=5.0, max_idle_rounds=2), now=0.0)
    r.join("a", 0.0)
    assert r.join("j", 1.0) == 1  # admitted at round 0, a member from round 1
    now = _round_with(r, "a", 2.0)  # round 0 closes early: "j" is not a member yet
    assert now == 2.0 and "j" not in r.missed
    now = _round_with(r, "aj", now + 1.0)  # round 1: its payload is in; from now on rounds wait for it
    now = _round_with(r, "a", now + 1.0)  # round 2: its first miss
    assert r.missed["j"] == 1 and r.idle == set()
    now = _round_with(r, "a", now + 1.0)  # round 3: its second
    assert r.idle == {"j"}
    opened = r.opened_at
    assert _round_with(r, "a", now + 1.0) == opened + 1.0


def test_the_idle_survive_a_restart_and_an_old_state_resumes_all_active() -> None:
    cfg = RoundConfig(round_timeout_s=10.0, heartbeat_timeout_s=5.0, max_idle_rounds=2)
    r = _two_members(cfg)
    now = _round_with(r, "a", 1.0)
    now = _round_with(r, "a", now + 1.0)
    state = r.state_dict()
    assert state["missed"] == {"f": 2}
    back = Rounds.from_state(cfg, state, now=100.0)
    assert back.idle == {"f"} and set(back.members) == {"a", "f"}
    back.submit("a", back.round, 101.0)
    assert back.due(101.0)  # the resumed round does not wait for the idle member
    off = Rounds.from_state(RoundConfig(round_timeout_s=10.0, max_idle_rounds=0), state, now=100.0)
    assert off.idle == set()  # the rule turned off: nobody is idle
    old = {"round": 4, "members": ["a", "f"], "joiners": []}  # saved before the rule existed
    back = Rounds.from_state(cfg, old, now=100.0)
    assert back.round == 4 and back.idle == set() and back.missed == {}
    back.submit("a", 4, 101.0)
    assert not back.due(101.0)  # everyone starts active
    with pytest.raises(ValueError, match="max_idle_rounds"):
        RoundConfig(max_idle_rounds=-1)


def test_a_member_with_no_accepted_work_is_not_waited_on_until_its_first_payload() -> None:
    """A newcomer (or a Sybil id that joins and heartbeats and never submits) does not hold a round; once a
    payload of it is in, rounds wait for it. A round that opens with no member that has work waits for all."""
    r = Rounds(cfg=RoundConfig(round_timeout_s=10.0, heartbeat_timeout_s=5.0, start_peers=2), now=0.0)
    r.join("a", 0.0)
    r.join("b", 0.0)  # the first round opens with both: it waits for both
    r.submit("a", 0, 1.0)
    assert not r.due(1.0)
    r.submit("b", 0, 2.0)
    assert r.due(2.0)
    r.close(2.0)
    for i in range(50):
        r.join(f"sybil-{i}", 2.5)
    r.submit("a", 1, 3.0)
    r.submit("b", 1, 3.0)
    r.close(3.0)  # the sybils are members of round 2 now
    r.submit("a", 2, 4.0)
    r.submit("b", 2, 4.0)
    assert r.due(4.0)  # 50 members without work: not waited on
    assert not r.missed and not r.idle  # and not counted as missing either
    r.close(4.0)
    r.submit("a", 3, 5.0)
    r.submit("b", 3, 5.0)
    r.arriving("sybil-1", 3)  # a stream that never completes: waited on until it ends, and only once
    assert not r.due(5.0)
    assert r.arrived("sybil-1") and r.due(5.0)
    r.arriving("sybil-1", 3)
    assert "sybil-1" not in r.incoming and r.due(5.0)
    r.arriving("sybil-0", 3)  # its first payload is on its way (its stream's first part checked): waited on
    assert not r.due(5.0)
    r.submit("sybil-0", 3, 5.0)  # an honest newcomer's first payload: counted; rounds wait for it now
    assert r.due(5.0)
    r.close(5.0)
    assert r.incoming == set()
    r.submit("a", 4, 6.0)
    r.submit("b", 4, 6.0)
    assert not r.due(6.0) and r.active == ["a", "b", "sybil-0"]
    r.spanning.add("sybil-0")  # its micro-batch spans rounds (the pace says so): not waited on either
    assert r.due(6.0)
    r.leave("a")
    r.leave("b")
    r.leave("sybil-0")
    r.close(7.0)  # every member left has no work: the next round waits for them all
    assert len(r.active) == 49


def test_the_members_with_work_survive_a_restart() -> None:
    r = Rounds(cfg=RoundConfig(round_timeout_s=10.0), now=0.0)
    r.join("a", 0.0)
    r.join("new", 0.5)
    r.submit("a", 0, 1.0)
    r.close(1.0)
    back = Rounds.from_state(RoundConfig(round_timeout_s=10.0), r.state_dict(), now=5.0)
    assert back.worked == {"a"} and back.active == ["a"]
    old = {k: v for k, v in r.state_dict().items() if k != "worked"}  # saved before the rule: all had work
    assert Rounds.from_state(RoundConfig(round_timeout_s=10.0), old, now=5.0).worked == {"a", "new"}
