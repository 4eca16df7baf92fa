"""Bad input at every RPC while honest peers train, intruders with a wrong token, and poisoned but
well-formed updates bounded by median-norm clipping (net.clip_to_median_norm), in coordinator mode and
in DHT mode.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from demonet.lab import netlab
from tests.chaos.cluster import PORT, TOKEN, CoordinatorCluster, loss_fell, report, run_config
from tests.chaos.dht_cluster import DhtCluster
from tests.chaos.intruder import LIAR, POISONER
from tests.procs import Reaper

HONEST = ["a", "b", "c"]


def test_bad_input_at_every_rpc_is_refused_and_harms_nothing(cluster: CoordinatorCluster) -> None:
    rounds = 150
    cluster.start(run_config(round_timeout_s=2.0, heartbeat_interval_s=0.5, heartbeat_timeout_s=4.0),
                  steps=rounds, start_peers=3, delay_ms=20)
    procs = [cluster.peer(p, mbit=100) for p in HONEST]
    cluster.wait_for(lambda: min(cluster.last_round(p) for p in HONEST) >= 3, "the first rounds")
    assert cluster.coord is not None
    host = cluster.lab.add_host("intruder", mbit=100)
    out = cluster.tmp / "fuzz.json"
    fuzz = host.popen([sys.executable, "-m", "tests.chaos.intruder", "--coordinator", f"{cluster.coord.addr}:{PORT}",
                       "--token", TOKEN, "--seed", "7", "--out", str(out)],
                      stdout=cluster._logfile("intruder"), stderr=subprocess.STDOUT, env=cluster.env)
    thieves = []  # real peers with a wrong or no token, at the same time
    for n, token in enumerate(("not-the-token", None)):
        env = {k: v for k, v in cluster.env.items() if k != "DEMONET_TOKEN"}
        if token:
            env["DEMONET_TOKEN"] = token
        thieves.append(cluster.host(f"thief{n}", 100).popen(
            [sys.executable, "-m", "demonet", "peer", "--coordinator", "127.0.0.1:7000", "--peer-id", "thief",
             "--out", str(cluster.out)], stdout=cluster._logfile(f"thief{n}"), stderr=subprocess.STDOUT, env=env))
    assert cluster.wait_exit(thieves, timeout_s=120) == [2, 2], cluster.log("thief0") + cluster.log("thief1")
    assert "refused the call" in cluster.log("thief0") and "no token" in cluster.log("thief1")
    assert cluster.wait_exit([fuzz], timeout_s=150) == [0], cluster.log("intruder")
    at_end_of_fuzz = cluster.last_round("a")
    assert at_end_of_fuzz < rounds - 5, "the run ended before the intruder did"
    cluster.finish(procs)
    assert "thief joins" not in cluster.coordinator_log()

    result: dict[str, Any] = json.loads(out.read_text())
    tried, accepted = result["tried"], result["accepted"]
    assert sum(accepted.values()) == 0, {k: v for k, v in accepted.items() if v}
    assert result["control"] == 1  # the same client's one valid payload was taken: the refusals are real
    for category in ("bad_token", "garbage_Submit", "payload_nan", "payload_inf", "payload_huge_norm",
                     "payload_wrong_shape", "stale_round", "future_round", "replay_same_round", "replay_next_round"):
        assert tried.get(category, 0) >= 1, category
    codes = result["codes"]
    assert codes.get("bad_token:UNAUTHENTICATED") == tried["bad_token"], codes
    for what in ("nan", "inf", "neg_inf", "huge_norm", "wrong_shape", "wrong_name", "missing_tensor",
                 "deflate_overflow", "deflate_cut"):
        assert codes.get(f"payload_{what}:REFUSAL_INVALID") == tried[f"payload_{what}"], (what, codes)
    # The same stream again: the very payload the round holds (DUPLICATE), or, when the round closed right
    # after it took the first (the honest members were in), a closed round (STALE); never a second payload.
    replayed = codes.get("replay_same_round:REFUSAL_DUPLICATE", 0) + codes.get("replay_same_round:REFUSAL_STALE", 0)
    assert replayed == 1, codes
    for method in ("Challenge", "Join", "Heartbeat", "Leave", "GetParameters", "Submit"):  # as "a", its own key
        assert codes.get(f"impersonate_{method}:PERMISSION_DENIED") == 1, (method, codes)
    # None harmed the state: every round closed on one digest that every honest peer holds, loss fell.
    by_round = cluster.by_round(HONEST)
    for p in HONEST:
        assert [r["round"] for r in cluster.rows(p)] == list(range(rounds)), p
    losses = cluster.mean_losses(by_round, HONEST)
    assert loss_fell(losses), losses
    log = cluster.coordinator_log()
    assert log.count("rejected a payload from") >= sum(v for k, v in tried.items() if k.startswith("payload_")) - 2
    report("bad_input", {
        "rounds": rounds, "rounds_completed": {p: len(cluster.rows(p)) for p in HONEST},
        "rounds_lost": sum(1 for r in cluster.canonical().values() if r[2]),
        "bad_inputs_tried": sum(tried.values()), "bad_inputs_accepted": sum(accepted.values()),
        "peers_with_bad_tokens": len(thieves),
        "categories": len(tried), "tried": tried})


def _start_poisoned(cluster: CoordinatorCluster, mode: str, clip: bool, rounds: int) -> list[Any]:
    """Three honest peers and one poisoner (a real peer whose payloads are scaled or random)."""
    cluster.start(run_config(round_timeout_s=3.0, heartbeat_interval_s=0.5, heartbeat_timeout_s=6.0,
                             clip_to_median_norm=clip), steps=rounds, start_peers=4, delay_ms=5)
    procs = [cluster.peer(p, mbit=100) for p in HONEST]
    procs.append(cluster.peer("mallory", mbit=100, script=POISONER, script_args=[mode]))
    return procs


def _poisoned_figures(cluster: CoordinatorCluster) -> dict[str, Any]:
    """The honest peers' losses, and in how many rounds the poisoner was clipped."""
    by_round = cluster.by_round([*HONEST, "mallory"])  # it applies the aggregate too: on the canonical digest
    for n, rows in by_round.items():
        assert rows["a"]["contributors"] == 4, (n, rows["a"])  # well formed: its payloads were taken
    losses = cluster.mean_losses(by_round, HONEST)
    clipped = sum("mallory" in line.split("; clipped", 1)[1]
                  for line in cluster.coordinator_log().splitlines() if "; clipped" in line)
    return {"loss_first5": round(sum(losses[:5]) / 5, 3), "loss_last5": round(sum(losses[-5:]) / 5, 3),
            "mallory_clipped_rounds": clipped}


def test_poisoned_updates_are_bounded_by_median_norm_clipping(cluster: CoordinatorCluster) -> None:
    # Two runs side by side on one lab, the same but for net.clip_to_median_norm.
    rounds, mode = 30, "random"
    unclipped = CoordinatorCluster(cluster.lab, cluster.tmp / "off", cluster.reaper, prefix="off-")
    procs_on = _start_poisoned(cluster, mode, True, rounds)
    procs_off = _start_poisoned(unclipped, mode, False, rounds)
    cluster.finish(procs_on, timeout_s=240)
    unclipped.finish(procs_off, timeout_s=60)
    on, off = _poisoned_figures(cluster), _poisoned_figures(unclipped)
    assert on["mallory_clipped_rounds"] >= rounds - 1, on  # bounded in every round
    assert off["mallory_clipped_rounds"] == 0, off
    assert on["loss_last5"] < on["loss_first5"] - 0.3, on  # the honest peers still learn
    assert off["loss_last5"] > on["loss_last5"] + 0.2, (on, off)  # without clipping: visibly worse
    report("poisoning", {"rounds": rounds, "poison": mode, "clip_on": on, "clip_off": off})


def _dht_poisoned_run(dht: DhtCluster, mode: str, clip: bool, rounds: int) -> dict[str, Any]:
    """Three honest DHT peers and one poisoner, to the end of the run; the honest losses and in how many
    rounds a slice owner clipped the poisoner's part."""
    dht.start(run_config(round_timeout_s=2.0, clip_to_median_norm=clip), steps=rounds, start_peers=4)
    procs = [dht.peer(p, mbit=100) for p in HONEST]
    procs.append(dht.peer("mallory", mbit=100, script=POISONER, script_args=[mode]))
    dht.finish(procs, timeout_s=300)
    by_round = dht.by_round([*HONEST, "mallory"])  # one digest per round: it applies the aggregate too
    for n, rows in by_round.items():
        assert rows["a"]["contributors"] == 4, (n, rows["a"])  # well formed: its parts were taken
    losses = dht.mean_losses(by_round, HONEST)
    text = "".join(dht.log(p) for p in [*HONEST, "mallory"])
    clipped_rounds = {int(m[1]) for m in re.finditer(r"round=(\d+)\] slice \d+: clipped [^\n]*?mallory", text)}
    return {"loss_first5": round(sum(losses[:5]) / 5, 3), "loss_last5": round(sum(losses[-5:]) / 5, 3),
            "mallory_clipped_rounds": len(clipped_rounds)}


def test_dht_poisoned_updates_are_bounded_by_the_slice_owners_clipping(lab: netlab.Lab, tmp_path: Path,
                                                                      reap_children: Reaper) -> None:
    """The coordinator-mode scenario above in DHT mode: every slice owner merges with the coordinator's
    rules (`demonet.wire.merge`), so the poisoner's part of each slice is scaled to that slice's median norm."""
    pytest.importorskip("hivemind")
    rounds, mode = 30, "random"
    figures = {}
    for clip in (True, False):
        dht = DhtCluster(lab, tmp_path / ("on" if clip else "off"), reap_children, prefix="" if clip else "off-")
        figures[clip] = _dht_poisoned_run(dht, mode, clip, rounds)  # the reaper stops what is left
    on, off = figures[True], figures[False]
    assert on["mallory_clipped_rounds"] >= rounds - 1, on  # bounded in every round
    assert off["mallory_clipped_rounds"] == 0, off
    assert on["loss_last5"] < on["loss_first5"] - 0.3, on  # the honest peers still learn
    assert off["loss_last5"] > on["loss_last5"] + 0.2, (on, off)  # without clipping: visibly worse
    report("dht_poisoning", {"rounds": rounds, "poison": mode, "clip_on": on, "clip_off": off})


def test_dht_a_lying_slice_owner_is_caught_by_verifiers_and_left_out(lab: netlab.Lab, tmp_path: Path,
                                                                      reap_children: Reaper) -> None:
    """Three honest DHT peers and a liar (`LIAR`: its merged slices negated) at the default `verify_slices`:
    a verified slice it owns or verifies disagrees, every peer drops it and reports both peers, and once
    a majority reported it, the liar owns no slice. The digests stay one per round."""
    pytest.importorskip("hivemind")
    rounds = 40
    dht = DhtCluster(lab, tmp_path, reap_children)
    dht.start(run_config(round_timeout_s=2.0, exclude_owner_rounds=rounds), steps=rounds, start_peers=4)
    procs = [dht.peer(p, mbit=100) for p in HONEST]
    procs.append(dht.peer("mallory", mbit=100, script=LIAR))
    dht.finish(procs, timeout_s=300)
    by_round = dht.by_round([*HONEST, "mallory"])  # one digest per round, on every peer
    assert sorted(by_round) == list(range(rounds)), sorted(by_round)
    text = {p: dht.log(p) for p in HONEST}
    disagreements = {p: [(int(m[1]), m[2], m[3]) for m in re.finditer(
        r"round=(\d+)\] slice \d+: its owner (\S+) and its verifier (\S+) disagree", text[p])] for p in HONEST}
    caught = sorted({r for p in HONEST for r, owner, verifier in disagreements[p]})
    assert caught, dht.logs()  # seen, by someone
    for p in HONEST:  # every disagreement had the liar on one side: two honest mergers always agree
        assert all("mallory" in (owner, verifier) for _, owner, verifier in disagreements[p]), disagreements[p]
    excluded = {p: [int(m[1]) for m in re.finditer(r"round=(\d+)\] ([\w, ]+) own no slice", text[p])
                    if "mallory" in m[2]] for p in HONEST}
    assert all(excluded[p] for p in HONEST), excluded  # left out by every honest peer
    first_excluded = min(min(v) for v in excluded.values())
    late = [r for r in caught if r > first_excluded and r <= first_excluded + rounds]
    assert not late, (late, first_excluded)  # once left out (for the rest of this run), nothing more to catch
    losses = dht.mean_losses(by_round, HONEST)
    assert loss_fell(losses), losses
    report("dht_lying_owner", {"rounds": rounds, "first_caught_round": caught[0], "rounds_caught": len(caught),
                               "excluded_from_round": first_excluded,
                               "loss_first5": round(sum(losses[:5]) / 5, 3),
                               "loss_last5": round(sum(losses[-5:]) / 5, 3)})
