"""Crashes and partitions in DHT mode (no coordinator) over the lab: a peer SIGKILLed mid-run with its
p2pd daemon and restarted, and a peer cut off: it applies no round without a majority, and
after the heal catches up from the majority without a restart.

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
from collections.abc import Sequence
from pathlib import Path

import pytest

from demonet.lab import netlab
from tests.chaos.cluster import loss_fell, report, run_config
from tests.chaos.dht_cluster import DhtCluster, digest_after
from tests.integration.common import rows_by_round
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
    dht.kill(c)  # the peer and its p2pd
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
    rounds = end(dht, [a, b, spare], PEERS)

    by_round = dht.by_round(PEERS)  # one digest per round across the peers
    for p in ("a", "b"):
        assert _done(dht, p, rounds) == list(range(rounds)), p
    c_rounds = _done(dht, "c", rounds)
    assert c_rounds == sorted(set(c_rounds)) and c_rounds[c_rounds.index(back):] == list(range(back, rounds)), c_rounds
    # (The round it was killed in may hold its payload: it was sent before the kill.)
    without_c = [n for n in range(killed + 1, back) if set(by_round[n]) == {"a", "b"}]
    assert without_c, "no round went on without c"
    # Where c died after it had served one of the two but not the other, that one was held to the killed
    # round's exchange deadline and announced the next round late: both abort it (docs/dht.md).
    aborted = [n for n in without_c if by_round[n]["a"]["aborted"]]
    assert aborted in ([], [killed + 1]) and all(by_round[n]["b"]["aborted"] for n in aborted), aborted
    for n in without_c:
        assert n in aborted or by_round[n]["a"]["contributors"] == 2, by_round[n]
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


def end(dht: DhtCluster, procs: list, peers: Sequence[str] = ("a", "b")) -> int:
    """Stop the peers gracefully (SIGTERM: at a round boundary, exit 0); returns the rounds every one of
    `peers` did. The signals reach the peers one after the other, so some may do a round or two more
    than another (frozen without the stopped one, a majority without it): those are past the count."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    dht.finish(procs, timeout_s=60)
    return min(dht.last_round(p) for p in peers) + 1


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
    # c writes round n's row before it trains round n+1, so it sent parts for no round past its last row + 1.
    # a's last row may lag c's by a round (its settle in a busy thread): the later of the two bounds the rounds
    # c took part in (seen once in CI: c's parts for a's last row + 2, sent ahead just before the cut).
    cut_round = dht.last_round("c")
    at_cut = max(cut_round, dht.last_round("a"))
    dht.wait_for(lambda: min(dht.last_round("a"), dht.last_round("b")) >= at_cut + cut_rounds,
                 "a and b to go on without c")
    # c may still be in the exchange of the round the cut interrupted (its timeouts): then it waits
    dht.wait_for(lambda: bool(_minority_log(dht, "c")), "c to wait for a majority")
    return procs, cut_round, at_cut, t_cut


def _after_cut(dht: DhtCluster, cut_round: int) -> list[tuple[int, bool]]:
    """(round, aborted) of the rows c wrote after `cut_round` (its last row when its link was down), checking that
    it applied none by itself.

    At most two: the round in flight at the cut (exchanged, its row written a moment later), and one it
    froze with a's and b's announcements stored on its node just before the cut. The exchange of that one
    brings c at most its own slice: it applies it only if that holds a majority's payloads (parts that
    reached c before the cut), and aborts it otherwise (from its own part alone)."""
    rows = [r for r in dht.rows("c") if r["round"] > cut_round]
    assert len(rows) <= 2 and all(r["aborted"] or r["contributors"] >= 2 for r in rows), rows
    return [(r["round"], r["aborted"]) for r in rows]


def _spans(rounds: list[int]) -> list[tuple[int, int]]:
    """Sorted round numbers as (first, last) runs, for a short failure message."""
    spans: list[tuple[int, int]] = []
    for n in rounds:
        spans[-1:] = [(spans[-1][0], n)] if spans and spans[-1][1] == n - 1 else [*spans[-1:], (n, n)]
    return spans


def _minority_log(dht: DhtCluster, peer: str) -> list[str]:
    """The peer's log lines saying it has no majority (logged once, then when what it sees changes)."""
    return [line for line in dht.log(peer).splitlines() if "no majority" in line]


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
    # Went on without c. Where c was cut off after it had served one of the two but not the other, that
    # one was held to the cut round's exchange deadline and announced the next round late: both abort it.
    aborted = [n for n in range(at_cut + 2, rounds) if by_round[n]["a"]["aborted"]]
    assert aborted in ([], [at_cut + 2]) and all(by_round[n]["b"]["aborted"] for n in aborted), aborted
    assert all(by_round[n]["a"]["contributors"] == 2 for n in range(at_cut + 2, rounds) if n not in aborted), \
        [by_round[n]["a"]["contributors"] for n in range(at_cut, rounds)]
    for p in ("a", "b"):  # a node that does not answer delays the stores, it does not stop the peer
        assert "ERROR" not in dht.log(p), dht.log(p)
    alone = [n for n, aborted in _after_cut(dht, cut_round) if not aborted]  # nothing alone while cut off
    assert 1 <= len(_minority_log(dht, "c")) <= 3, dht.log("c")
    losses = dht.mean_losses(by_round, ["a", "b"])
    assert loss_fell(losses), losses
    report("dht_partition", {
        "rounds": rounds, "partition_s": round(cut_s, 1), "rounds_during_partition": during,
        "rounds_completed": {p: len(dht.rows(p)) for p in PEERS}, "rounds_lost": rounds - len(by_round),
        "c_applied_after_cut": len(alone), "loss_first5": round(sum(losses[:5]) / 5, 3),
        "loss_last5": round(sum(losses[-5:]) / 5, 3)})


def _agree(dht: DhtCluster, peers: list[str], rounds: int, skip: int) -> dict[int, dict[str, dict]]:
    """round -> peer -> row below `rounds`, checking one digest per round, except that each peer may hold
    up to `skip` rows of its own (the round a partition cut into, applied with the slices it had). A row of
    a round the peer aborted is not one: it applied nothing, and keeps the digest of the round before (a
    healed peer may abort the round it waited in, a late majority, while the others applied it)."""
    by_round = rows_by_round(dht.rows, peers)
    odd: dict[str, int] = {}
    for n, rows in sorted(by_round.items()):
        if n >= rounds:
            continue
        digests = [r["param_digest"] for r in rows.values()]
        if len(set(digests)) > 1:
            main = max(set(digests), key=digests.count)
            for p, r in rows.items():
                if r["param_digest"] != main and not r["aborted"]:
                    odd[p] = odd.get(p, 0) + 1
    assert all(k <= skip for k in odd.values()), (odd, by_round)
    return by_round


def test_dht_a_partitioned_peer_heals_and_is_in_sync_again(dht: DhtCluster) -> None:
    cut_rounds = 8
    procs, cut_round, at_cut, t_cut = _cut(dht, LONG, cut_rounds)
    dht.peers["c"].host.set_link(up=True)
    t_heal = time.monotonic()
    at_heal = dht.last_round("a")
    c_rows_cut = [n for n, _ in _after_cut(dht, cut_round)]  # nothing alone while cut off
    back_rows = lambda: [r for r in dht.rows("c") if r["round"] > at_heal and r["contributors"] == 3]  # noqa: E731
    dht.wait_for(lambda: bool(back_rows()), "c to be in a round with a and b after the heal")
    sync_s = time.monotonic() - t_heal
    back = back_rows()[0]["round"]
    dht.wait_for(lambda: dht.last_round("c") >= back + 5, "c's rounds after the heal")
    rounds = end(dht, procs, PEERS)
    by_round = _agree(dht, PEERS, rounds, skip=1)
    for p in ("a", "b"):
        lost = sorted(set(range(rounds)) - set(_done(dht, p, rounds)))
        assert not lost, (p, _spans(lost), at_heal, back, dht.notable(p))
        # The majority may wait a moment when one of its two is slow to announce (1 of 2 is no majority),
        # but it loses no round and never resyncs.
        assert "Resync" not in dht.log(p) and "NotMember" not in dht.log(p), dht.log(p)
    for n in range(back, rounds):  # back in sync: in every round with a and b, one digest
        assert set(by_round[n]) == set(PEERS) and by_round[n]["a"]["contributors"] == 3, by_round[n]
    c_done = _done(dht, "c", rounds)
    assert c_done == sorted(set(c_done)) and c_done[c_done.index(back):] == list(range(back, rounds)), c_done
    waits = _minority_log(dht, "c")
    assert 1 <= len(waits) <= 3, waits  # said once (then on a change of what it saw)
    # It caught up from the majority (it read that the run went on past its round, that its waiting round
    # froze without it, or that its digest is not the majority's), and loaded the majority's parameters.
    assert "catching up" in dht.log("c"), dht.log("c")
    loads = dht.loaded("c")  # from the majority, without a restart
    assert loads and all(digest == digest_after(by_round, n - 1) for n, digest in loads), loads
    assert len(dht.peers["c"].procs) == 1
    report("dht_partition_heal", {
        "rounds": rounds, "cut_in_round": cut_round + 1, "partition_s": round(t_heal - t_cut, 1),
        "majority_rounds_during_partition": at_heal - at_cut, "c_back_in_round": back,
        "c_rounds_lost": back - cut_round - 1 - len(c_rows_cut), "heal_to_sync_s": round(sync_s, 2),
        "majority_rounds_heal_to_sync": back - at_heal - 1, "c_waits_logged": len(waits),
        "parameter_loads": len(loads)})


def _split(dht: DhtCluster, one: tuple[str, ...], other: tuple[str, ...], *, heal: bool = False) -> None:
    """Cut (or heal) every path between the two groups: blackhole routes on both ends, each group's own
    links untouched."""
    for side, far in ((one, other), (other, one)):
        for p in side:
            for q in far:
                dht.peers[p].host.run(["ip", "route", "del" if heal else "add", "blackhole",
                                       f"{dht.peers[q].host.addr}/32"], check=True)


def test_dht_four_split_two_against_two_both_wait_and_go_on_together_after_the_heal(dht: DhtCluster) -> None:
    peers = ["a", "b", "c", "d"]
    dht.start(_config(), steps=LONG, start_peers=4, exchange_timeout_s=5.0)
    procs = [dht.peer(p, mbit=100) for p in peers]
    dht.wait_for(lambda: min(dht.last_round(p) for p in peers) >= 4, "the first rounds")
    _split(dht, ("a", "b"), ("c", "d"))
    t_cut = time.monotonic()
    at_cut = {p: dht.last_round(p) for p in peers}
    dht.wait_for(lambda: all(_minority_log(dht, p) for p in peers), "every peer to wait for a majority")
    time.sleep(10.0)  # five round windows: neither side applies a round
    during = {p: dht.last_round(p) for p in peers}
    # Applied while split: at most the round the split cut into. A side may also abort a round together
    # (a late majority that counted a far-side announcement stored just before the cut), which applies
    # nothing and keeps the base of four (docs/dht.md). A peer writes a round's row before it trains the
    # next, so no part crossed for a round past the latest row + 1; a peer's own row may lag that (`_cut`).
    cut = max(at_cut.values())
    applied = max(sum(1 for r in dht.rows(p) if cut < r["round"] <= during[p] and not r["aborted"]) for p in peers)
    assert applied <= 1, (at_cut, during, {p: [(r["round"], r["aborted"]) for r in dht.rows(p)[-4:]] for p in peers})
    _split(dht, ("a", "b"), ("c", "d"), heal=True)
    t_heal = time.monotonic()
    top = max(during.values())
    together = lambda: [r["round"] for r in dht.rows("a") if r["round"] > top and r["contributors"] == 4]  # noqa: E731
    dht.wait_for(lambda: bool(together()), "the four peers in one round after the heal")
    heal_s = time.monotonic() - t_heal
    first = together()[0]
    dht.wait_for(lambda: min(dht.last_round(p) for p in peers) >= first + 5, "rounds of the four after the heal")
    rounds = end(dht, procs, peers)
    # A pair may hold its own digest for two rows: the round the split cut into (one pair applied it, with
    # the parts of a majority that crossed before the cut; the other aborted it) and the round after the
    # heal, which all four abort together; then the smaller digest wins and the other pair loads it.
    by_round = _agree(dht, peers, rounds, skip=2)
    for n in range(first + 1, rounds):
        assert set(by_round[n]) == set(peers) and by_round[n]["a"]["contributors"] == 4, by_round[n]
    assert all(len(dht.peers[p].procs) == 1 for p in peers)  # no restart
    report("dht_split_two_two", {
        "rounds": rounds, "split_in_round": min(at_cut.values()) + 1, "split_s": round(t_heal - t_cut, 1),
        "rounds_applied_while_split": applied, "together_in_round": first, "heal_to_together_s": round(heal_s, 2),
        "waits_logged": {p: len(_minority_log(dht, p)) for p in peers}})
