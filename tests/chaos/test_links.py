"""Slow links: peers at 100, 20 and 2 Mbit/s, and a late joiner that downloads the parameters over 2 Mbit/s.

Assertions are about progress, digests and losses; the figures go to `cluster.report`.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.chaos.cluster import CoordinatorCluster, loss_fell, report, run_config

ROUNDS = 10


@pytest.mark.parametrize("overlap", [0, 1], ids=["plain", "overlap"])
def test_heterogeneous_links_the_slow_peer_misses_deadlines_without_stalling_the_rest(
        cluster: CoordinatorCluster, overlap: int) -> None:
    # With overlap, a peer trains its next round while its payload crawls over the link; the slow one
    # still misses deadlines, and must drop its lookahead and catch up on the canonical parameters.
    # The small model with 2048 of 4096 coefficients kept per chunk: a payload of about 240 kB (fp32
    # values with a deflated top plane, entropy-coded indices) takes 0.02 s at 100 Mbit/s, 0.1 s at 20
    # and, past the link's 32 KiB burst, 2.4 s at 0.7: the 0.7 Mbit/s peer cannot make a 2 s round, with
    # overlap or without; the others can. Its parameter downloads (475 kB, 5.4 s) hold its heartbeats'
    # replies back: hence a heartbeat timeout of 12 s. (With 1024 coefficients a payload is about 122 kB:
    # at 2 Mbit/s, 0.5 s, and with overlap the slow peer made every round once its first parameter
    # download, 1.9 s, ended before round 0's deadline.) Rounds wait for the slow peer to their deadline
    # every time (max_idle_rounds = 0): with the default, after 3 misses they no longer wait, the other two
    # closed the last 7 rounds in under 3 s, and the run could end before the slow peer's first payload.
    timeout_s = 2.0
    cluster.start(run_config(round_timeout_s=timeout_s, model="small", topk=2048, heartbeat_interval_s=0.5,
                             heartbeat_timeout_s=12.0, max_idle_rounds=0, overlap=overlap),
                  steps=ROUNDS, start_peers=3, delay_ms=10)
    rates = {"fast": 100, "mid": 20, "slow": 0.7}
    procs = [cluster.peer(name, mbit=mbit) for name, mbit in rates.items()]
    t0 = time.monotonic()
    cluster.finish(procs, timeout_s=ROUNDS * timeout_s * 3 + 60)
    elapsed = time.monotonic() - t0

    by_round = cluster.by_round(list(rates))  # every completed round on the coordinator's digest
    assert all(r["overlap"] == overlap for p in rates for r in cluster.rows(p))
    for p in ("fast", "mid"):
        assert [r["round"] for r in cluster.rows(p)] == list(range(ROUNDS)), p  # not stalled by the slow one
    slow_rounds = [r["round"] for r in cluster.rows("slow")]
    missed = sorted(set(range(ROUNDS)) - set(slow_rounds))
    slow_log = cluster.log("slow")
    stale = len(re.findall(r"StaleRound: .*; (?:catching up|caught up by the aggregates)", slow_log))
    assert missed and stale >= 1, slow_log  # it really missed deadlines...
    assert len(re.findall(r"closed without slow", cluster.coordinator_log())) >= len(missed) - 1
    # ...and stayed in sync: it caught up by the aggregates it missed (each checked against its round's canonical
    # digest), or by the parameters, and every parameter download it made carries the canonical digest.
    canonical = cluster.canonical()
    loads = cluster.loaded("slow")
    by_parameters = len(re.findall(r"; (?:catching up|its payload goes back into the momentum)", slow_log))
    assert len(loads) >= 1 + by_parameters, (loads, by_parameters)
    for round_, digest in loads:
        if round_ > 0:
            assert canonical[round_ - 1][0] == digest, (round_, digest, canonical[round_ - 1])
    # The rounds without the slow peer closed at their deadline, not later: the run was never stalled.
    # (Round 0 is left out: it opens only once the last peer has imported torch and joined. With overlap a
    # round's row starts with its compute, during the round before: two deadlines, while the slow peer is
    # waited for.)
    round_times = [r["round_time_s"] for r in cluster.rows("fast")][1:]
    assert max(round_times) < (1 + overlap) * timeout_s + 3.0, round_times
    losses = cluster.mean_losses(by_round, ["fast", "mid"])
    assert loss_fell(losses, margin=0.2), losses
    report(f"heterogeneous_links{'_overlap' if overlap else ''}", {
        "rounds": ROUNDS, "rounds_completed": {p: len(cluster.rows(p)) for p in rates},
        "rounds_lost": sum(1 for r in canonical.values() if r[2]), "slow_missed": len(missed),
        "slow_stale_refusals": stale, "slow_parameter_downloads": len(loads),
        "max_round_time_s": round(max(round_times), 2), "run_s": round(elapsed, 1),
        "loss_first5": round(sum(losses[:5]) / 5, 3), "loss_last5": round(sum(losses[-5:]) / 5, 3)})


def test_a_late_joiner_over_a_slow_link_downloads_the_parameters_while_rounds_go_on(
        cluster: CoordinatorCluster) -> None:
    # The small model's parameters are 475 kB: about 2 s at 2 Mbit/s. Rounds do not wait for a newcomer until its
    # first payload is in (docs/coordinator.md#who-a-round-waits-for): a and b go on, in rounds of about 0.3 s
    # (`round_s`, up to 64 micro-batches of a few ms), and the late joiner's first payload, of the round whose
    # parameters it downloaded, counts in the round open when it arrives (a late payload, after it applies the
    # rounds between); from then on it is waited on, in every round.
    rounds, timeout_s = 60, 4.0
    cluster.start(run_config(round_timeout_s=timeout_s, model="small", heartbeat_interval_s=0.5,
                             heartbeat_timeout_s=6.0, round_s=0.3, max_micro_batches=64), steps=rounds,
                  start_peers=2, delay_ms=10)
    late = cluster.peer("late", mbit=2, gated=True)
    a, b = cluster.peer("a", mbit=100), cluster.peer("b", mbit=100)
    cluster.wait_for(lambda: min(cluster.last_round("a"), cluster.last_round("b")) >= 5, "a and b's first rounds")
    released_at = cluster.last_round("a")
    t0 = time.monotonic()
    cluster.release(late)
    join_s = cluster.wait_for(lambda: cluster.rows("late") != [], "the late joiner's first round")
    went_on = cluster.last_round("a") - released_at
    cluster.finish([a, b, late])

    by_round = cluster.by_round(["a", "b", "late"])
    late_rounds = [r["round"] for r in cluster.rows("late")]
    first = late_rounds[0]
    assert late_rounds == list(range(first, rounds)), late_rounds  # in every round from its first on
    assert first < rounds - 8, first
    loads = cluster.loaded("late")
    assert len(loads) == 1 and loads[0][0] <= first, loads  # one download; after it, the aggregates it missed
    size = int(re.search(r"parameters of round \d+ loaded from \S+ \((\d+) bytes", cluster.log("late"))[1])
    assert size > 400_000
    for n in range(first, rounds):
        assert set(by_round[n]) == {"a", "b", "late"} and by_round[n]["a"]["contributors"] == 3, by_round[n]
    assert max(r["round_time_s"] for r in cluster.rows("a")) < timeout_s + 3.0  # never stalled past a deadline
    losses = cluster.mean_losses(by_round, ["a", "b", "late"])
    assert loss_fell(losses), losses
    report("late_joiner_slow_link", {
        "rounds": rounds, "rounds_completed": {p: len(cluster.rows(p)) for p in ("a", "b", "late")},
        "rounds_lost": sum(1 for r in cluster.canonical().values() if r[2]), "first_round": first,
        "rounds_during_join": went_on, "parameter_bytes": size, "time_to_first_round_s": round(join_s, 2),
        "since_release_s": round(time.monotonic() - t0, 1)})


def test_a_peer_behind_a_slow_link_sends_a_smaller_k_and_is_in_every_round(cluster: CoordinatorCluster) -> None:
    """Nothing set but the model: two peers at 100 Mbit/s and one at 2 Mbit/s, whose payload of 2048 coefficients
    a chunk (about 240 kB) takes a second to upload. The first round is lockstep and measures; from then on the
    coordinator announces rounds by the clock, and the slow peer sends the k its uplink carries in a quarter of
    the round (`LinkPace`): fewer coefficients, in every round, on the canonical digest."""
    rounds = 10
    cluster.start(run_config(round_timeout_s=20.0, model="small", topk=2048, heartbeat_interval_s=0.5,
                             heartbeat_timeout_s=12.0), steps=rounds, start_peers=3, delay_ms=10)
    rates = {"a": 100, "b": 100, "slow": 2}
    procs = [cluster.peer(name, mbit=mbit) for name, mbit in rates.items()]
    cluster.finish(procs, timeout_s=rounds * 20 + 60)

    by_round = cluster.by_round(list(rates))  # every round on the coordinator's digest
    assert sorted(by_round) == list(range(rounds))
    for n, rows in by_round.items():
        assert set(rows) == set(rates) and all(r["contributors"] == 3 for r in rows.values()), (n, rows)
    slow_k = [r["topk"] for r in cluster.rows("slow")]
    fast_k = [r["topk"] for p in ("a", "b") for r in cluster.rows(p)]
    assert set(fast_k) == {2048}, fast_k
    assert slow_k[0] == 2048 and max(slow_k[2:]) < 2048 and min(slow_k) >= 2048 // 8, slow_k
    slow_bytes = [r["bytes_up"] for r in cluster.rows("slow")]
    assert max(slow_bytes[2:]) < slow_bytes[0], slow_bytes
    report("slow_link_smaller_k", {"rounds": rounds, "slow_k": slow_k, "slow_bytes_up": slow_bytes,
                                   "fast_bytes_up": [r["bytes_up"] for r in cluster.rows("a")]})
