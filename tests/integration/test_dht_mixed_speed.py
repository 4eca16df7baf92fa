"""Mixed-speed peers in DHT mode, over real hivemind DHT nodes and their p2pd daemons on loopback.

- Three `demonet peer --dht` processes with rounds by the clock (`[net] round_s`, plain and overlapped): a peer
  whose task sleeps 0.3 s a micro-batch (a slower accelerator) trains fewer micro-batches than the fast ones in
  each round, is in every round's aggregate, and every peer ends every round on one digest; the rows' samples
  (the weights of the merges) differ between the fast peers and the slow one.
- The same with nothing set: the slow peer spans rounds (`demonet.loop.spanning`): the rounds keep the fast peers'
  pace, it is in every one of them, its micro-batches end rounds after they began and enter the round then open,
  and the rounds of one micro-batch weigh its samples together.
- In one process: a round whose member claims 10^9 samples gives every member the same aggregate, the
  slices merged with the capped weight, and each owner counts the claim once; a part claiming 0 samples,
  or more than the run's bound, is refused by its owner over the link, counted, and keeps no state there.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.integration.common import run_coroutine
from tests.integration.tasks import SLEEP_ENV
from tests.integration.test_dht import WAIT_S, _Peers, gatherers_on_loopback, wait_for
from tests.procs import Reaper

pytest.importorskip("hivemind")
pytestmark = pytest.mark.slow

STEPS = 8
PEERS = {"fast-0": 0.0, "fast-1": 0.0, "slow": 0.3}
"""peer id -> the seconds its task sleeps per micro-batch."""


@pytest.mark.parametrize("overlap", [0, 1], ids=["fixed", "fixed-overlapped"])
def test_a_slow_dht_peer_trains_fewer_micro_batches_and_is_in_every_round(tmp_path: Path, overlap: int,
                                                                            reap_children: Reaper) -> None:
    rows = _run(tmp_path, reap_children, STEPS, overlap=overlap, round_s=1.0)
    micro = {p: statistics.median(r["micro_batches"] for r in rows[p]) for p in PEERS}
    samples = {p: statistics.median(r["samples"] for r in rows[p]) for p in PEERS}
    assert micro["slow"] < micro["fast-0"] and micro["slow"] < micro["fast-1"], micro
    assert all(r["micro_batches"] >= 1 for rs in rows.values() for r in rs)
    assert samples["fast-0"] > samples["slow"] >= 1 and samples["fast-1"] > samples["slow"], samples


def test_with_nothing_set_a_dht_peer_slower_than_a_round_spans_rounds_and_is_in_every_one(
        tmp_path: Path, reap_children: Reaper) -> None:
    steps = 24
    rows = _run(tmp_path, reap_children, steps, overlap=0, round_s=0.0)
    slow, full = rows["slow"], rows["slow"][0]["samples"]  # round 0 is lockstep: one whole micro-batch
    spanned = [r for r in slow if r["micro_batches"] == 0]  # rounds that ended before its micro-batch did
    ended = [r for r in slow if r["phases"].get("stale_rounds", 0) >= 1]  # micro-batches that spanned rounds
    assert spanned and ended, slow
    assert all(1 <= r["samples"] < full for r in spanned), slow  # the part of a micro-batch that ran in the round
    weighed = 0
    for r in slow:  # the rounds of one micro-batch weigh its samples together
        if r["micro_batches"] == 0:
            weighed += r["samples"]
        elif r["phases"].get("stale_rounds", 0) >= 1:
            assert weighed + r["samples"] == full, (weighed, r, slow)
            weighed = 0
    # The rounds keep the fast peers' pace once the slow one spans: shorter than its micro-batch alone.
    later = [r["round_time_s"] for r in rows["fast-0"][steps // 2:]]
    assert statistics.median(later) < PEERS["slow"], later


def _run(tmp: Path, reaper: Reaper, steps: int, *, overlap: int, round_s: float) -> dict[str, list[dict[str, Any]]]:
    """The three peers of `PEERS` for `steps` rounds; their rows, each peer in every round, every round whole and on
    one digest."""
    peers = _Peers(tmp, reaper, steps=steps, start_peers=len(PEERS), overlap=overlap, round_timeout_s=20.0,
                   round_s=round_s, max_micro_batches=6)
    task = ("--task", "tests.integration.tasks:sleepy", "--checkpoint-every", "0")
    first, *others = PEERS
    peers.bootstrap(first, *task, env={SLEEP_ENV: str(PEERS[first])})
    for name in others:
        peers.start(name, *task, env={SLEEP_ENV: str(PEERS[name])})
    wait_for(lambda: all(peers.procs[p].poll() is not None for p in PEERS), "the run's end", peers, 3 * WAIT_S)
    assert [peers.procs[p].returncode for p in PEERS] == [0] * len(PEERS), peers.dump()
    rows = {p: peers.rows(p) for p in PEERS}
    for p in PEERS:
        assert [r["round"] for r in rows[p]] == list(range(steps)), (p, rows[p])
    for round_ in range(steps):
        at = {p: rows[p][round_] for p in PEERS}
        assert len({r["param_digest"] for r in at.values()}) == 1, (round_, at)
        assert all(r["contributors"] == len(PEERS) and not r["aborted"] for r in at.values()), (round_, at)
    return rows


async def _claims() -> None:
    """Run by the test in a fresh interpreter."""
    import asyncio

    import torch

    from demonet._proto import demonet_pb2 as pb
    from demonet.dht import rules
    from demonet.dht.ahead import encode_parts
    from demonet.dht.deadlines import now
    from demonet.errors import PeerUnavailable
    from demonet.wire.merge import decode_contribution, merge
    from tests.payloads import random_payload

    specs = {"w": ((64, 64), (16, 16)), "b": ((64,), (1, 64))}
    names = ["a", "b", "c"]
    claims = {"a": 2, "b": 2, "c": 10**9}
    nodes, addresses = await gatherers_on_loopback("claims", names, specs, exchange_timeout_s=5.0, slice_entries=0)
    payloads = {p: random_payload(specs, i, k=8) for i, p in enumerate(names)}
    opts = nodes["a"]._node.opts
    try:
        r = 7
        plan = nodes["a"]._exchange.plan_for(specs, names)
        done = await asyncio.gather(*(nodes[p]._exchange.run(r, payloads[p], specs=specs, members=names, owners=names,
                                                             addresses=addresses, frozen_at=now(), samples=claims[p])
                                      for p in names))
        parts = {p: encode_parts(r, plan, payloads[p]) for p in names}
        expected = plan.join([merge([decode_contribution(parts[p][s], expected=plan.slice_specs(s), rules=opts.rules)[1]
                                     for p in names], step=r, rules=opts.rules, expected=plan.slice_specs(s),
                                    samples=[claims[p] for p in names]).payload for s in range(plan.n)])
        for p, d in zip(names, done, strict=True):
            assert d.contributors == tuple(names) and not d.disagreed, (p, d)
            assert d.aggregate is not None and all(
                torch.equal(d.aggregate.tensors[n].idx, expected.tensors[n].idx)
                and torch.equal(d.aggregate.tensors[n].val, expected.tensors[n].val) for n in specs), p
            owns = p in d.slice_owners
            assert d.capped == (frozenset({"c"}) if owns else frozenset()), (p, d.capped)
            assert nodes[p].capped == int(owns), p
        # A part claiming no samples, or more than the run's bound, is refused at its owner: counted, nothing kept.
        part = encode_parts(r + 1, plan, payloads["a"])[0]
        for samples in (0, opts.rules.max_samples + 1):
            refused = nodes["b"].refused
            try:
                await nodes["a"]._node.streams.call(addresses["b"], pb.DHT_KIND_PART, r + 1, slice=0, data=part,
                                                    members_digest=rules.members_digest(names), samples=samples,
                                                    timeout_s=WAIT_S)
            except PeerUnavailable as e:
                assert "samples should be between 1 and the run's max_samples_per_round" in str(e), e
            else:
                raise AssertionError(f"a part claiming {samples} samples was taken")
            assert nodes["b"].refused == refused + 1
            assert r + 1 not in nodes["b"]._exchange._rounds  # no state for the round it named
    finally:
        for p in names:
            await asyncio.wait_for(nodes[p].close(), 30)


def test_a_claim_of_a_billion_samples_is_capped_alike_everywhere_and_one_of_zero_is_refused(reap_children: Reaper
                                                                                             ) -> None:
    run_coroutine(__name__, "_claims", reap_children, WAIT_S)
