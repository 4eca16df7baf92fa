"""Crashes and partitions over the lab: a peer SIGKILLed at a random point of several rounds and
restarted, the coordinator SIGKILLed and restarted, a peer cut off for several rounds and healed.

Assertions are about progress, digests and losses; the figures go to `cluster.report`.
"""

from __future__ import annotations

import random
import time

from demonet.loop.runfolder import final_rows
from tests.chaos.cluster import CoordinatorCluster, loss_fell, report, run_config

SEED = 1234  # the random kill points; printed with the figures


def _config(timeout_s: float = 2.0) -> str:
    return run_config(round_timeout_s=timeout_s, heartbeat_interval_s=0.5, heartbeat_timeout_s=4.0)


def test_a_peer_killed_at_random_points_of_several_rounds_rejoins_and_catches_up(cluster: CoordinatorCluster) -> None:
    rounds, kills = 70, 3
    rng = random.Random(SEED)
    cluster.start(_config(), steps=rounds, start_peers=3, delay_ms=25)
    # The restarts are warmed up (torch imported) before the run starts, so each enters it at once.
    spares = [cluster.peer("c", mbit=100, gated=True) for _ in range(kills)]
    for spare in spares:
        cluster.release_ready(spare)
    a, b = cluster.peer("a", mbit=100), cluster.peer("b", mbit=100)
    c = cluster.peer("c", extra=["--checkpoint-every", "1"])
    events = []
    for spare in spares:
        cluster.wait_for(lambda: cluster.last_round("c") >= max(cluster.last_round("a"), 0), "c to be in the run")
        before = cluster.last_round("c")
        cluster.wait_for(lambda b=before: cluster.last_round("c") > b, "c to finish a round")  # a round just began
        time.sleep(rng.uniform(0.0, 0.2))  # somewhere in it: training, submitting or waiting for the aggregate
        cluster.kill(c)
        t_kill = time.monotonic()
        killed = cluster.last_round("c") + 1
        ahead = cluster.last_round("a")
        cluster.wait_for(lambda ahead=ahead: min(cluster.last_round("a"), cluster.last_round("b")) >= ahead + 2,
                         "a and b to carry on without c")
        assert cluster.last_round("c") == killed - 1  # nothing from c while it is dead
        t_release = time.monotonic()
        cluster.release(spare)
        c = spare
        cluster.wait_for(lambda killed=killed: cluster.last_round("c") >= killed, "c to be back")
        back = time.monotonic()
        events.append({"killed_in_round": killed, "back_in_round": cluster.last_round("c"),
                       "dead_s": round(t_release - t_kill, 2), "rejoin_s": round(back - t_release, 2)})
    assert cluster.last_round("c") < rounds - 5, "the run was too short to see c train after its last restart"
    cluster.finish([a, b, c])

    by_round = cluster.by_round(["a", "b", "c"])
    for p in ("a", "b"):
        assert [r["round"] for r in cluster.rows(p)] == list(range(rounds)), p
    c_rounds = [r["round"] for r in cluster.rows("c")]
    assert c_rounds == sorted(set(c_rounds)) and c_rounds[-1] == rounds - 1, c_rounds
    for e in events:  # back in the run: it contributes from its first round after the restart
        assert by_round[e["back_in_round"]]["a"]["contributors"] == 3, e
    for n in range(rounds - 5, rounds):
        assert set(by_round[n]) == {"a", "b", "c"}, by_round[n]
    losses = cluster.mean_losses(by_round, ["a", "b", "c"])
    assert loss_fell(losses), losses
    canonical = cluster.canonical()
    report("peer_sigkill_restart", {
        "seed": SEED, "rounds": rounds, "kills": kills,
        "rounds_completed": {p: len(cluster.rows(p)) for p in ("a", "b", "c")},
        "rounds_lost": sum(1 for r in canonical.values() if r[2]),
        "rejoin_s_max": max(e["rejoin_s"] for e in events), "events": events})


def test_the_coordinator_killed_and_restarted_mid_run_loses_no_round(cluster: CoordinatorCluster) -> None:
    rounds = 40
    rng = random.Random(SEED)
    cluster.start(_config(), steps=rounds, start_peers=3)
    peers = ["a", "b", "c"]
    procs = [cluster.peer(p, mbit=100) for p in peers]
    cluster.wait_for(lambda: min(cluster.last_round(p) for p in peers) >= 8, "the first rounds")
    time.sleep(rng.uniform(0.0, 0.3))
    cluster.kill(cluster.coordinator)
    t_kill = time.monotonic()
    killed = max(cluster.last_round(p) for p in peers) + 1
    time.sleep(1.0)  # down for a while: the peers' calls fail and retry
    cluster.start_coordinator()  # same address, port and state folder
    t_up = time.monotonic()
    recover_s = cluster.wait_for(lambda: min(cluster.last_round(p) for p in peers) >= killed, "the round after")
    assert killed < rounds - 10, killed
    cluster.finish(procs)

    assert "resumed from" in cluster.log("coordinator-2")
    by_round = cluster.by_round(peers)  # no peer diverged: the coordinator's digest, no resync
    for p in peers:
        assert [r["round"] for r in final_rows(cluster.rows(p))] == list(range(rounds)), p  # no gap past the kill
    canonical = cluster.canonical()
    lost = sorted(n for n, r in canonical.items() if r[2])
    assert lost == [], lost  # the restarted coordinator asked for the payloads it lost
    losses = cluster.mean_losses(by_round, peers)
    assert loss_fell(losses), losses
    report("coordinator_sigkill_restart", {
        "seed": SEED, "rounds": rounds, "killed_in_round": killed,
        "rounds_completed": {p: len(cluster.rows(p)) for p in peers}, "rounds_lost": len(lost),
        "down_s": round(t_up - t_kill, 2), "time_to_recover_s": round(t_up - t_kill + recover_s, 2)})


def test_a_partitioned_peer_is_dropped_then_heals_and_catches_up(cluster: CoordinatorCluster) -> None:
    # 25 ms each way: a round takes a few round trips, so the run lasts long enough to heal within it.
    rounds, cut_rounds = 100, 10
    cluster.start(_config(), steps=rounds, start_peers=3, delay_ms=25)
    peers = ["a", "b", "c"]
    procs = [cluster.peer(p, mbit=100) for p in peers]
    cluster.wait_for(lambda: min(cluster.last_round(p) for p in peers) >= 5, "the first rounds")
    host = cluster.peers["c"].host
    host.set_link(up=False)
    t_cut = time.monotonic()
    cut_round = cluster.last_round("c")
    cluster.wait_for(lambda: "dropped c" in cluster.coordinator_log(), "the coordinator to drop c")
    dropped_at = cluster.last_round("a")
    cluster.wait_for(lambda: cluster.last_round("a") >= dropped_at + cut_rounds, "a and b to go on without c")
    during = cluster.last_round("a") - cut_round
    assert cluster.last_round("c") <= cut_round + 1  # at most the round it was already submitting
    host.set_link(up=True)
    t_heal = time.monotonic()
    recover_s = cluster.wait_for(lambda: cluster.last_round("c") > cut_round + 1, "c to be back after the heal")
    back = cluster.last_round("c")
    assert back < rounds - 5, back
    cluster.finish(procs)

    by_round = cluster.by_round(peers)
    for p in ("a", "b"):
        assert [r["round"] for r in cluster.rows(p)] == list(range(rounds)), p
    c_rounds = [r["round"] for r in cluster.rows("c")]
    assert c_rounds[-1] == rounds - 1 and len(c_rounds) < rounds - cut_rounds, c_rounds  # missed the cut, back
    for n in range(rounds - 5, rounds):
        assert by_round[n]["a"]["contributors"] == 3, by_round[n]
    assert "closed without c" in cluster.coordinator_log()
    losses = cluster.mean_losses(by_round, peers)
    assert loss_fell(losses), losses
    report("partition_heal", {
        "rounds": rounds, "partition_s": round(t_heal - t_cut, 1), "rounds_during_partition": during,
        "rounds_completed": {p: len(cluster.rows(p)) for p in peers},
        "rounds_lost": sum(1 for r in cluster.canonical().values() if r[2]),
        "time_to_recover_s": round(recover_s, 2)})
