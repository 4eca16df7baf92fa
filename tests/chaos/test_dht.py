"""Crashes and partitions in DHT mode (no coordinator) over the lab: a peer SIGKILLed mid-run with its
DHT and p2pd processes and restarted, and a peer cut off (the heal is an expected failure: no quorum).

The coordinator-mode scenarios that have no DHT counterpart are not run here: a coordinator restart
(there is none), RPC fuzzing and the token checks of the coordinator's gRPC service (the DHT's
wrong-token records and messages are tested in tests/integration/test_dht.py).

Assertions are about progress, digests (every peer that did a round has the same digest after it)
and losses, not timings; the figures go to `cluster.report`.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from demonet.lab import netlab
from tests.chaos.cluster import loss_fell, report, run_config
from tests.chaos.dht_cluster import DhtCluster, digest_after
from tests.procs import Reaper

pytest.importorskip("hivemind")

SEED = 1234  # the kill point; printed with the figures
PEERS = ["a", "b", "c"]
LONG = 2000  # rounds of the run: more than a scenario lasts; its peers are stopped with SIGTERM


@pytest.fixture
def dht(lab: netlab.Lab, tmp_path: Path, reap_children: Reaper) -> DhtCluster:
    return DhtCluster(lab, tmp_path, reap_children)  # reap_children, set up after lab, is torn down before it


def _config() -> str:
    return run_config(round_timeout_s=2.0)


def test_dht_a_peer_killed_mid_run_rejoins_from_the_others_and_agrees(dht: DhtCluster) -> None:
    rng = random.Random(SEED)
    dht.start(_config(), steps=LONG, start_peers=3)
    spare = dht.peer("c", mbit=100, gated=True)  # the restart, warmed up beforehand
    dht.release_ready(spare)
    a, b, c = (dht.peer(p, mbit=100) for p in PEERS)
    dht.wait_for(lambda: dht.last_round("c") >= 4, "c's first rounds")
    before = dht.last_round("c")
    dht.wait_for(lambda: dht.last_round("c") > before, "c to finish a round")  # a round just began
    time.sleep(rng.uniform(0.0, 0.3))
    dht.kill(c)  # the peer, its DHT process and its p2pd
    t_kill = time.monotonic()
    killed = dht.last_round("c") + 1
    ahead = dht.last_round("a")
    dht.wait_for(lambda: min(dht.last_round("a"), dht.last_round("b")) >= ahead + 3, "a and b to carry on without c")
    assert dht.last_round("c") == killed - 1  # nothing from c while it is dead
    t_release = time.monotonic()
    dht.release(spare)
    dht.wait_for(lambda: dht.last_round("c") >= killed, "c to be back")
    rejoin_s = time.monotonic() - t_release
    back = [r["round"] for r in dht.rows("c") if r["round"] >= killed][0]
    dht.wait_for(lambda: dht.last_round("c") >= back + 5, "c's rounds after the restart")
    rounds = end(dht, [a, b, spare])

    by_round = dht.by_round(PEERS)  # one digest per round across the peers
    for p in ("a", "b"):
        assert _done(dht, p, rounds) == list(range(rounds)), p
    c_rounds = _done(dht, "c", rounds)
    assert c_rounds == sorted(set(c_rounds)) and c_rounds[c_rounds.index(back):] == list(range(back, rounds)), c_rounds
    # (The round it was killed in may hold its payload: it was sent before the kill.)
    without_c = [n for n in range(killed + 1, back) if set(by_round[n]) == {"a", "b"}]
    assert without_c, "no round went on without c"
    for n in without_c:
        assert by_round[n]["a"]["contributors"] == 2, by_round[n]
    # The restart loaded the parameters from the others: the digest they agreed on after the round before.
    loads = dht.loaded("c")
    assert loads and loads[0][0] <= back, loads
    for round_, digest in loads:
        assert digest == digest_after(by_round, round_ - 1), (round_, digest)
    for n in range(back, rounds):
        assert set(by_round[n]) == set(PEERS) and by_round[n]["a"]["contributors"] == 3, by_round[n]
    losses = dht.mean_losses(by_round, PEERS)
    assert loss_fell(losses), losses
    report("dht_peer_sigkill_restart", {
        "seed": SEED, "rounds": rounds, "kills": 1, "killed_in_round": killed, "back_in_round": back,
        "rounds_completed": {p: len(dht.rows(p)) for p in PEERS}, "rounds_without_c": len(without_c),
        "rounds_lost": rounds - len(by_round), "parameter_loads": len(loads),
        "dead_s": round(t_release - t_kill, 2), "rejoin_s": round(rejoin_s, 2),
        "loss_first5": round(sum(losses[:5]) / 5, 3), "loss_last5": round(sum(losses[-5:]) / 5, 3)})


def end(dht: DhtCluster, procs: list) -> int:
    """Stop the peers gracefully (SIGTERM: at a round boundary, exit 0); returns the rounds both a and b
    did. The signals reach the peers one after the other, so one may do a round or two more than the
    other (frozen without the stopped one): those are past the returned count."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    dht.finish(procs, timeout_s=60)
    return min(dht.last_round("a"), dht.last_round("b")) + 1


def _done(dht: DhtCluster, peer: str, rounds: int) -> list[int]:
    """The rounds the peer did, before `rounds`."""
    return [r["round"] for r in dht.rows(peer) if r["round"] < rounds]


def _cut(dht: DhtCluster, rounds: int, cut_rounds: int) -> tuple[list, int, int, float]:
    # A DHT store waits up to 3 s (hivemind's wait_timeout) for a node that does not answer: the
    # exchange timeout is longer, so the others' stores go on while c is cut off.
    dht.start(_config(), steps=rounds, start_peers=3, exchange_timeout_s=5.0)
    procs = [dht.peer(p, mbit=100) for p in PEERS]
    dht.wait_for(lambda: min(dht.last_round(p) for p in PEERS) >= 4, "the first rounds")
    dht.peers["c"].host.set_link(up=False)
    t_cut = time.monotonic()
    cut_round, at_cut = dht.last_round("c"), dht.last_round("a")
    dht.wait_for(lambda: min(dht.last_round("a"), dht.last_round("b")) >= at_cut + cut_rounds,
                 "a and b to go on without c")
    return procs, cut_round, at_cut, t_cut


def test_dht_a_partitioned_peer_leaves_the_majority_training_on_one_digest(dht: DhtCluster) -> None:
    cut_rounds = 8
    (a, b, c), cut_round, at_cut, t_cut = _cut(dht, LONG, cut_rounds)
    during = dht.last_round("a") - at_cut
    rounds = end(dht, [a, b])  # the majority stops while c is still cut off
    cut_s = time.monotonic() - t_cut
    dht.kill(c)

    by_round = dht.by_round(["a", "b"])  # a and b agree on every round, none resynced
    for p in ("a", "b"):
        assert _done(dht, p, rounds) == list(range(rounds)), p
    assert all(by_round[n]["a"]["contributors"] == 2 for n in range(at_cut + 2, rounds)), \
        [by_round[n]["a"]["contributors"] for n in range(at_cut, rounds)]  # went on without c
    for p in ("a", "b"):  # a node that does not answer delays the stores, it does not stop the peer
        assert "ERROR" not in dht.log(p), dht.log(p)
    alone = [r["round"] for r in dht.rows("c") if r["round"] > cut_round]
    assert all(r["contributors"] == 1 for r in dht.rows("c") if r["round"] > cut_round + 1), dht.rows("c")
    losses = dht.mean_losses(by_round, ["a", "b"])
    assert loss_fell(losses), losses
    report("dht_partition", {
        "rounds": rounds, "partition_s": round(cut_s, 1), "rounds_during_partition": during,
        "rounds_completed": {p: len(dht.rows(p)) for p in PEERS}, "rounds_lost": rounds - len(by_round),
        "c_rounds_alone": len(alone), "loss_first5": round(sum(losses[:5]) / 5, 3),
        "loss_last5": round(sum(losses[-5:]) / 5, 3)})


@pytest.mark.xfail(run=False, reason="DHT mode has no quorum: cut off, c freezes its rounds alone (a split "
                                     "brain); after the heal its records of later rounds make a and b refuse "
                                     "themselves (NotMember) or resync to c. Run it with --runxfail.")
def test_dht_a_partitioned_peer_heals_and_is_in_sync_again(dht: DhtCluster) -> None:
    rounds, cut_rounds = 60, 8
    procs, cut_round, at_cut, _ = _cut(dht, rounds, cut_rounds)
    dht.peers["c"].host.set_link(up=True)
    dht.wait_for(lambda: any(r["round"] > cut_round and r["contributors"] == 3 for r in dht.rows("c")),
                 "c to be in a round with a and b after the heal")
    dht.finish(procs)
    by_round = dht.by_round(PEERS)  # one digest per round, c's included
    for p in ("a", "b"):
        assert _done(dht, p, rounds) == list(range(rounds)), p
    for n in range(rounds - 5, rounds):
        assert by_round[n]["a"]["contributors"] == 3, by_round[n]
