"""A slow link in DHT mode: a peer behind 2 Mbit/s among two at 100 sends the k its uplink carries, timed by the
owners that read its parts (`DhtMessage.received_s`), in every round, on the digest every peer agrees on.

Assertions are about k, bytes, membership and digests; the figures go to `cluster.report`.
"""

from __future__ import annotations

import statistics

import pytest

from tests.chaos.cluster import report, run_config
from tests.chaos.dht_cluster import DhtCluster

pytest.importorskip("hivemind")


def test_dht_a_peer_behind_a_slow_link_sends_a_smaller_k_and_is_in_every_round(dht: DhtCluster) -> None:
    """Nothing set but the model: the payload at 2048 coefficients a chunk (about 240 kB) takes a second to go up
    at 2 Mbit/s. The first rounds are lockstep and measure; then the rounds go by the clock (the peers' speeds
    differ), and the slow peer sends fewer coefficients, at least the floor (k / 8)."""
    rounds = 12
    dht.start(run_config(round_timeout_s=20.0, model="small", topk=2048), steps=rounds, start_peers=3,
              exchange_timeout_s=10.0)
    rates = {"a": 100.0, "b": 100.0, "slow": 2.0}
    procs = [dht.peer(name, mbit=mbit) for name, mbit in rates.items()]
    dht.finish(procs, timeout_s=rounds * 30 + 120)

    by_round = dht.by_round(list(rates))  # one digest per round across the peers
    assert sorted(by_round) == list(range(rounds))
    for n, rows in by_round.items():
        assert set(rows) == set(rates) and all(r["contributors"] == 3 and not r["aborted"] for r in rows.values()), (
            n, rows)
    slow_k = [r["topk"] for r in dht.rows("slow")]
    fast_k = [r["topk"] for p in ("a", "b") for r in dht.rows(p)]
    assert slow_k[0] == 2048 and min(slow_k) >= 2048 // 8, slow_k
    later = slow_k[rounds // 2:]
    assert max(later) < 2048, slow_k  # sized to its link once the rounds go by the clock
    assert statistics.median(later) < statistics.median(fast_k), (slow_k, fast_k)
    uploads = [r["phases"].get("upload", 0.0) for r in dht.rows("slow")]
    assert all(s > 0 for s in uploads[1:]), uploads  # the owners timed every round's parts
    slow_bytes = [r["bytes_up"] for r in dht.rows("slow")]
    assert max(slow_bytes[rounds // 2:]) < slow_bytes[0], slow_bytes
    report("dht_slow_link_smaller_k", {"rounds": rounds, "slow_k": slow_k, "fast_k": fast_k,
                                       "slow_bytes_up": slow_bytes, "slow_upload_s": [round(s, 2) for s in uploads],
                                       "fast_bytes_up": [r["bytes_up"] for r in dht.rows("a")]})
