"""Mixed-speed peers in coordinator mode, over real processes and sockets: rounds by the clock (`[net] round_s`),
work sized to each peer, and the samples-weighted merge with its cap.

A peer whose task sleeps 0.3 s a micro-batch (a slower accelerator), with a fixed `round_s`, trains fewer
micro-batches than the fast ones in each round and is in every round's aggregate; with the automatic length, its
micro-batch spans rounds instead: rounds go at the fast peers' pace and its gradient enters a later round, from
parameters some rounds old. All peers end every round they apply on the coordinator's digest.
A peer that claims 10^9 samples is capped and counted; a claim of 0 is refused and changes nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.wire.signed import submit_parts
from tests.integration.common import coordinator_in_process, listening_line, metrics_rows, rows_by_round, tiny_config
from tests.integration.tasks import SLEEP_ENV
from tests.integration.test_coordinator import TOKEN, Peer, _a_and_b

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
PEERS = {"fast-0": 0.0, "fast-1": 0.0, "slow": 0.3}
"""peer id -> the seconds its task sleeps per micro-batch."""


def _run(tmp_path: Path, round_s: float, steps: int, peers: dict[str, float] = PEERS, overlap: int = 0
         ) -> tuple[dict[str, list[dict[str, Any]]], str]:
    """Three peers (id -> seconds its task sleeps a micro-batch) and a coordinator, `steps` rounds: each peer's
    metrics rows, the coordinator's log."""
    (tmp_path / "run.toml").write_text(tiny_config(round_timeout_s=20.0, round_s=round_s, max_micro_batches=6,
                                                   overlap=overlap))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DEMONET_TOKEN": TOKEN}
    out, procs, logs = tmp_path / "out", {}, {}
    try:
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "demonet", "coordinator", "--listen", "127.0.0.1:0", "--config",
             str(tmp_path / "run.toml"), "--task", "tests.integration.tasks:sleepy", "--steps", str(steps),
             "--start-peers", str(len(peers))], stdout=subprocess.PIPE, stderr=open(tmp_path / "c.log", "wb"),
            env=env, cwd=ROOT, start_new_session=True)
        procs["coordinator"] = coordinator
        address = listening_line(coordinator, 60.0).split()[-1]
        for peer_id, sleep_s in peers.items():
            logs[peer_id] = open(tmp_path / f"{peer_id}.log", "wb")
            procs[peer_id] = subprocess.Popen(
                [sys.executable, "-m", "demonet", "peer", "--coordinator", address, "--peer-id", peer_id, "--out",
                 str(out), "--threads", "1", "--checkpoint-every", "0"], stdin=subprocess.DEVNULL,
                stdout=logs[peer_id], stderr=logs[peer_id], env={**env, SLEEP_ENV: str(sleep_s)}, cwd=ROOT,
                start_new_session=True)
        codes = [procs[p].wait(timeout=240) for p in peers]
        assert codes == [0] * len(peers), "\n".join((tmp_path / f"{p}.log").read_text()[-2000:] for p in peers)
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for f in logs.values():
            f.close()
    return {p: metrics_rows(out, p) for p in peers}, (tmp_path / "c.log").read_text()


def test_with_a_fixed_round_s_a_slow_peer_trains_fewer_micro_batches_and_is_in_every_round(tmp_path: Path) -> None:
    rows, _ = _run(tmp_path, 1.0, STEPS)
    by_round = rows_by_round(lambda p: rows[p], list(PEERS))
    assert sorted(by_round) == list(range(STEPS))
    for round_, by_peer in by_round.items():
        assert {row["param_digest"] for row in by_peer.values()} == {by_peer["slow"]["canonical_digest"]}, round_
        assert all(row["contributors"] == len(PEERS) for row in by_peer.values()), (round_, by_peer)
    micro = {p: statistics.median(r["micro_batches"] for r in rows[p]) for p in PEERS}
    samples = {p: statistics.median(r["samples"] for r in rows[p]) for p in PEERS}
    assert micro["slow"] < micro["fast-0"] and micro["slow"] < micro["fast-1"], micro
    assert all(r["micro_batches"] >= 1 for rs in rows.values() for r in rs)
    assert samples["fast-0"] > samples["slow"] >= 1, samples


@pytest.mark.parametrize("overlap", [0, 1], ids=["plain", "overlapped"])
def test_with_the_automatic_length_a_slow_peers_micro_batch_spans_rounds(tmp_path: Path, overlap: int) -> None:
    """Nothing set: the coordinator measures the first round, finds the slow peer slow by its compute (its
    upload is quick), and no longer waits for it. Rounds go at the fast peers' pace; each of the slow peer's
    micro-batches outlasts rounds, and its gradient enters the round open when it is done. Overlapped, the
    payload it trains while a late one is in flight is called off and its gradient kept in the momentum: every
    row is still on the canonical digest."""
    steps = 30 + 20 * overlap  # overlapped, half its micro-batches make payloads: more rounds for two of them
    rows, log = _run(tmp_path, 0.0, steps, {"fast-0": 0.05, "fast-1": 0.05, "slow": 0.3}, overlap=overlap)
    assert "do not wait for the members whose micro-batch spans rounds: slow" in log
    for p in ("fast-0", "fast-1"):
        assert [r["round"] for r in rows[p]] == list(range(steps))
    canonical = {r["round"]: r["canonical_digest"] for r in rows["fast-0"]}
    assert all(r["param_digest"] == canonical[r["round"]] for rs in rows.values() for r in rs)
    late = [r for r in rows["slow"] if r["phases"].get("stale_rounds")]
    # sent from older parameters (overlapped, every other micro-batch of it goes into its momentum instead)
    assert len(late) >= 2, [(r["round"], r["phases"]) for r in rows["slow"]]
    assert all(r["contributors"] == len(PEERS) for r in late)  # ...and merged in the round it came in
    assert len(rows["slow"]) < steps / 2  # it trained fewer rounds than there were, and held none of them
    fast_s = statistics.median(r["round_time_s"] for r in rows["fast-0"][-10:])
    assert fast_s < 0.3, fast_s  # under the slow peer's one micro-batch


async def test_a_claim_of_a_billion_samples_is_capped_and_one_of_zero_is_refused(tmp_path: Path) -> None:
    async with coordinator_in_process(tmp_path, token=TOKEN, steps=4) as (address, _):
        a, b = await _a_and_b(address)  # a trained round 0 alone; both are members of 1

        def parts(peer: Peer, samples: int, need_s: float = 0.0, micro_batches: int = 3,
                  compute_s: float = 0.6) -> list[pb.SubmitPart]:
            x, y = next(peer.batches)
            peer.model(x, y)[1].backward()
            payload = peer.opt.compress()
            return submit_parts(peer.identity, peer.session, peer.peer_id, 1, wire.encode(payload, step=1),
                                param_digest=peer.digest(), loss=1.0, samples=samples, need_s=need_s,
                                micro_batches=micro_batches, compute_s=compute_s)

        before = await a.status()
        zero = await a.stub.Submit(iter(parts(a, 0)), metadata=a.md, timeout=30)
        assert not zero.accepted and zero.refusal == pb.REFUSAL_INVALID and "samples should be" in zero.reason
        for need_s in (-1.0, math.nan, math.inf):  # a round time no peer can have: refused the same way
            odd = await a.stub.Submit(iter(parts(a, 2, need_s)), metadata=a.md, timeout=30)
            assert not odd.accepted and odd.refusal == pb.REFUSAL_INVALID and "need_s" in odd.reason
        for work in ((2**21, 0.6), (3, -1.0), (3, math.nan)):  # what it says of its work, for the dashboard
            odd = await a.stub.Submit(iter(parts(a, 2, 0.0, *work)), metadata=a.md, timeout=30)
            assert not odd.accepted and odd.refusal == pb.REFUSAL_INVALID and "micro_batches" in odd.reason
        after = await a.status()
        assert (after.submitted, after.round, after.rejected) == (before.submitted, before.round, before.rejected + 7)
        with pytest.raises(grpc.aio.AioRpcError) as bad_signature:  # samples are signed: another count is a lie
            lied = parts(a, 2)
            lied[0].samples = 10**9
            await a.stub.Submit(iter(lied), metadata=a.md, timeout=30)
        assert bad_signature.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # b first: a member with no payload accepted yet is not waited on, so a's would close the round
        assert (await b.stub.Submit(iter(parts(b, 2)), metadata=b.md, timeout=30)).accepted
        assert (await a.stub.Submit(iter(parts(a, 10**9)), metadata=a.md, timeout=30)).accepted
        closed, _ = await a.aggregate(1)
        assert set(closed.contributors) == {"a", "b"}
        document = await a.stub.Status(pb.StatusRequest(detail=True), metadata=a.md, timeout=10)
        run = json.loads(document.detail_json)
        assert run["run"]["capped"] == 1
        members = {m["id"]: m for m in run["members"]}  # each one's work, as it said it
        assert [(members[p]["micro_batches"], members[p]["compute_s"]) for p in "ab"] == [(3, 0.6), (3, 0.6)]
        assert any(r["kind"] == "samples_capped" and r["peer"] == "a" for r in run["refusals"]), run["refusals"]
