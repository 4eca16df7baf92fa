"""A DHT peer behind a slow link sizes its parts to its uplink, over the lab (namespaces, tbf-shaped links).

Assertions are about k, membership and digests, not timings; the figures go to `cluster.report`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from demonet.lab import netlab
from tests.chaos.cluster import report, run_config
from tests.chaos.dht_cluster import DhtCluster
from tests.procs import Reaper

pytest.importorskip("hivemind")


@pytest.fixture
def dht(lab: netlab.Lab, tmp_path: Path, reap_children: Reaper) -> DhtCluster:
    return DhtCluster(lab, tmp_path, reap_children)  # reap_children, set up after lab, is torn down before it


def test_dht_a_peer_behind_a_slow_link_sends_a_smaller_k_and_is_in_every_round(dht: DhtCluster) -> None:
    """Nothing set but the model: two peers at 100 Mbit/s and one at 2 Mbit/s, whose parts of 2048 coefficients
    a chunk take most of a second to upload. Each part's receipt times the slow peer's uplink
    (`DHT_KIND_RECEIVED`); once its round is longer than the others', the rounds go by the clock and it sends
    the k its uplink carries in a quarter of the round (`LinkPace`): fewer coefficients, in every round, on
    one digest. Slow by its link, it owns no slice."""
    rounds = 12
    dht.start(run_config(round_timeout_s=20.0, model="small", topk=2048), steps=rounds, start_peers=3,
              exchange_timeout_s=10.0)
    rates = {"a": 100, "b": 100, "slow": 2}
    procs = [dht.peer(name, mbit=mbit) for name, mbit in rates.items()]
    dht.finish(procs, timeout_s=rounds * 20 + 60)

    by_round = dht.by_round(list(rates))  # every round on one digest
    assert sorted(by_round) == list(range(rounds))
    for n, rows in by_round.items():
        assert set(rows) == set(rates) and all(r["contributors"] == 3 for r in rows.values()), (n, rows)
    slow_k = [r["topk"] for r in dht.rows("slow")]
    fast_k = [r["topk"] for p in ("a", "b") for r in dht.rows(p)]
    slow_up = [round(r["phases"].get("upload", 0.0), 3) for r in dht.rows("slow")]
    fast_up = [round(r["phases"].get("upload", 0.0), 3) for r in dht.rows("a")]
    figures = {"rounds": rounds, "slow_k": slow_k, "fast_k": fast_k, "slow_upload_s": slow_up,
               "fast_upload_s": fast_up, "slow_bytes_up": [r["bytes_up"] for r in dht.rows("slow")],
               "fast_bytes_up": [r["bytes_up"] for r in dht.rows("a")]}
    report("dht_slow_link_smaller_k", figures)
    assert slow_k[0] == 2048 and max(slow_k[-4:]) < 2048 and min(slow_k) >= 2048 // 8, figures
    assert min(fast_k) >= 2048 * 3 // 4, figures
    # Its announced exchange (at the full k) is over the others': it owns no slice, so its downlink and uplink
    # carry only its own parts and the merged slices it fetches (`rules.slow_links`).
    for peer in rates:
        assert "slow own no slice: slow by their link" in dht.log(peer), dht.notable(peer)
