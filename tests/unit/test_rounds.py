"""The round state machine with a fake clock: joins, deadlines, quorum, stragglers, restarts."""

import pytest

from demonet.coordinator.rounds import RoundConfig, Rounds, SubmitRejected

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
    r.members.update(dict.fromkeys("bc", 0.0))  # all three are members of round 0
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
