"""Every error path of the one round loop, on cue, over the in-process coordinator (no sockets).

Two peers run `RoundLoop` against `LocalCoordinator` with a fault plan keyed on (peer, round): the
loop must restore the payload that reached no aggregate, get back in step the way each error says,
write no row for the lost round, and end on the canonical digest with the other peer. Every test runs
with plain rounds and with overlapped ones (`overlap` = 1, with the lookahead): the faults must restore
the same payloads either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from demonet.config import Config, load_config
from demonet.coordinator.local import LocalCoordinator
from demonet.errors import InvalidPayload
from demonet.loop import RoundLoop
from demonet.optim import Payload
from demonet.train.trainer import Trainer
from demonet.transport.coordinated import CoordinatorMembership

ROUNDS = 6
FAULTY = "p1"


def _cfg(**net: Any) -> Config:
    return load_config(None, {}, {
        "model": {"d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 16},
        "train": {"seq_len": 16, "batch_size": 2},
        "optim": {"compression_topk": 4, "compression_chunk": 8},
        "net": {"start_peers": 2, "round_timeout_s": 20.0, "heartbeat_timeout_s": 60.0, **net}})


@pytest.fixture(params=[0, 1], ids=["plain", "overlap"])
def overlap(request: pytest.FixtureRequest) -> int:
    return int(request.param)


class _Run:
    """Two peers and their coordinator; `restored[peer]` lists the rounds whose whole payload went back."""

    def __init__(self, tmp_path: Path, faults: dict[tuple[str, int], str], *, overlap: int,
                 stop_at: int | None = None, hold: int | None = None, wrap: Any = None, round_s: float = 0.0,
                 lockstep: bool = False, max_micro_batches: int = 16, slow_s: float = 0.0) -> None:
        self.tmp_path, self.stop_at, self.overlap, self.hold, self.wrap = tmp_path, stop_at, overlap, hold, wrap
        self.round_s, self.slow_s = round_s, slow_s
        self.hub = LocalCoordinator(_cfg(round_s=round_s, lockstep=lockstep, max_micro_batches=max_micro_batches),
                                    total_rounds=ROUNDS, faults=faults,
                                    on_close=self._closed)
        self.loops: dict[str, RoundLoop] = {}
        self.trainers: dict[str, Trainer] = {}
        self.restored: dict[str, list[int]] = {}
        self.codes: dict[str, int] = {}
        self.joins = 0  # the faulty peer's joins (probes left out)
        self.rejoins = "refused" in faults.values()  # the faulty peer is dropped and joins again

    def _closed(self, agg: Any) -> None:
        if self.stop_at is not None and agg.round + 1 >= self.stop_at:
            self.loops[FAULTY].stop.set()  # SIGTERM while the faulty peer hangs in its gather

    async def _peer(self, peer_id: str) -> None:
        client = self.hub.client(peer_id)
        if peer_id != FAULTY and self.hold is not None:
            self._hold(client, self.hold)
        if peer_id == FAULTY:
            self._count_joins(client)
        membership = CoordinatorMembership(client)
        info = await membership.join()
        trainer = self.trainers[peer_id] = Trainer.for_run(self.hub.cfg, data_seed=info.data_seed,
                                                           device=torch.device("cpu"),
                                                           checkpoint=self.tmp_path / f"peer-{peer_id}.pt")
        if peer_id == FAULTY and self.wrap is not None:  # its client's calls and its trainer's steps
            self.wrap(client)
        if peer_id == FAULTY and self.slow_s:  # a slower accelerator: each micro-batch takes slow_s more
            loss, slow_s = trainer.loss, self.slow_s

            def sleeping(model: Any, batch: Any) -> Any:
                time.sleep(slow_s)
                return loss(model, batch)

            trainer.loss = sleeping
        loop = RoundLoop(trainer, membership, membership.client, peer_id, self.tmp_path / f"metrics-{peer_id}.jsonl",
                         checkpoint_every=0, stop_grace_s=0.2, overlap=self.overlap, round_s=self.round_s)
        self.loops[peer_id] = loop
        self.restored[peer_id] = []
        restore = trainer.opt.restore

        def recording(payload: Payload, kept: Payload | None = None) -> None:
            if kept is None:  # all of it went back (with `kept`: what the aggregate dropped)
                self.restored[peer_id].append(loop.round)
            restore(payload, kept)

        trainer.opt.restore = recording  # type: ignore[method-assign]
        self.codes[peer_id] = await loop.run(info)

    def _count_joins(self, client: Any) -> None:
        join = client.join

        async def counted(*, probe: bool = False) -> Any:
            info = await join(probe=probe)
            async with self.hub.core.cond:
                self.joins += not probe
                self.hub.core.cond.notify_all()
            return info

        client.join = counted

    def _hold(self, client: Any, round: int) -> None:
        """p0 submits round `round` only once the faulty peer has joined again: the run waits for a
        rejoining peer no matter how slowly the machine runs it (p0 alone would close rounds at once).
        A dropped peer's second join is what counts: with overlap p0 sends round `round` ahead while the
        faulty peer, not yet refused, is still a member of the round before."""
        hub, gather = self.hub.core, client.gather

        async def held(r: int, payload: Payload, **kwargs: Any) -> Any:
            if r == round:
                async with hub.cond:
                    await hub.wait_for(lambda: self.joins > self.rejoins and (
                        FAULTY in hub.rounds.members or FAULTY in hub.rounds.joiners), f"{FAULTY} to join again")
            return await gather(r, payload, **kwargs)

        client.gather = held

    async def run(self) -> None:
        ticker = asyncio.create_task(self.hub.tick_forever(max_sleep_s=0.05))
        try:
            async with asyncio.timeout(240):
                await asyncio.gather(self._peer("p0"), self._peer(FAULTY))
        finally:
            ticker.cancel()

    def rows(self, peer_id: str) -> list[dict[str, Any]]:
        path = self.tmp_path / f"metrics-{peer_id}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        for row in rows:  # every row: the documented point (after the apply) is on the canonical digest
            assert row["overlap"] == self.overlap and row["wait_s"] >= 0.0
            assert row["param_digest"] == row["canonical_digest"], row
        return rows


@pytest.mark.parametrize(("fault", "rows", "resyncs"), [
    ("refused", [0, 1, 4, 5], 0),  # dropped: joins again in round 3 (or 2), a member from the round after
    ("stale", [0, 1, 3, 4, 5], 0),  # the round closed without it: continue from the open one
    ("resync", [0, 1, 3, 4, 5], 1),  # other parameters: download them, count it
    ("invalid", [0, 1, 3, 4, 5], 0),  # a bad aggregate: the parameters after the round
])
async def test_a_refused_payload_is_restored_and_the_peer_gets_back_in_step(
        tmp_path: Path, fault: str, rows: list[int], resyncs: int, overlap: int) -> None:
    run = _Run(tmp_path, {(FAULTY, 2): fault}, overlap=overlap, hold=3)
    await run.run()
    assert run.codes == {"p0": 0, FAULTY: 0}
    assert run.restored == {"p0": [], FAULTY: [2]}  # the lost round's payload went back, once
    if fault == "refused" and run.rows(FAULTY)[2]["round"] == 3:
        rows = [0, 1, 3, 4, 5]  # its join came before p0's payload of round 2 closed that round
    assert [r["round"] for r in run.rows(FAULTY)] == rows
    assert [r["round"] for r in run.rows("p0")] == list(range(ROUNDS))
    assert [r["contributors"] for r in run.rows("p0")] == [2 if r in rows else 1 for r in range(ROUNDS)]
    assert run.rows(FAULTY)[-1]["resyncs"] == resyncs
    assert run.loops["p0"].digest == run.loops[FAULTY].digest == run.hub.state.digest


async def test_an_aborted_round_restores_every_payload_and_applies_nothing(tmp_path: Path, overlap: int) -> None:
    run = _Run(tmp_path, {("*", 2): "abort"}, overlap=overlap)
    await run.run()
    assert run.codes == {"p0": 0, FAULTY: 0}
    assert run.restored == {"p0": [2], FAULTY: [2]}
    for peer in ("p0", FAULTY):
        rows = run.rows(peer)
        assert [r["round"] for r in rows] == list(range(ROUNDS))
        assert [r["aborted"] for r in rows] == [False, False, True, False, False, False]
        assert rows[2]["param_digest"] == rows[1]["param_digest"] != rows[3]["param_digest"]
    assert run.loops["p0"].digest == run.loops[FAULTY].digest == run.hub.state.digest


async def test_a_peer_whose_last_round_closed_without_it_ends_there_without_catching_up(
        tmp_path: Path, overlap: int, caplog: pytest.LogCaptureFixture) -> None:
    # The run's last round closed without its payload (a slow link): there is no round left to catch up to,
    # and the coordinator serves the last parameters only while it lingers: it ends at once, exit 0.
    run = _Run(tmp_path, {(FAULTY, ROUNDS - 1): "stale"}, overlap=overlap)
    with caplog.at_level("WARNING", logger="demonet.loop.round_loop"):
        await run.run()
    assert run.codes == {"p0": 0, FAULTY: 0}
    assert run.restored[FAULTY] == [ROUNDS - 1]  # its payload went back into its momentum
    assert [r["round"] for r in run.rows(FAULTY)] == list(range(ROUNDS - 1))
    assert run.loops[FAULTY].round == ROUNDS - 1  # no download: it keeps the parameters of its last round
    assert run.loops[FAULTY].digest == run.rows("p0")[-2]["param_digest"] != run.hub.state.digest
    assert any(f"rounds are done: this peer ends at round {ROUNDS - 1}" in r.getMessage() for r in caplog.records)


async def test_an_unreachable_run_ends_the_peer_with_its_checkpoint(tmp_path: Path, overlap: int) -> None:
    run = _Run(tmp_path, {(FAULTY, 2): "down"}, overlap=overlap)
    await run.run()
    assert run.codes == {"p0": 0, FAULTY: 1}
    assert run.restored[FAULTY] == [2]
    assert [r["round"] for r in run.rows(FAULTY)] == [0, 1]
    saved = torch.load(tmp_path / f"peer-{FAULTY}.pt", weights_only=True)
    assert saved["round"] == 2  # the momentum it saved is the one of the round it resumes at
    assert [r["contributors"] for r in run.rows("p0")][2:] == [1, 1, 1, 1]  # the run went on without it


async def test_a_stop_during_a_gather_abandons_the_round_after_the_grace(tmp_path: Path, overlap: int) -> None:
    run = _Run(tmp_path, {(FAULTY, 2): "hang"}, overlap=overlap, stop_at=4)
    await run.run()
    assert run.codes == {"p0": 0, FAULTY: 0}
    assert run.restored[FAULTY] == [2]
    assert [r["round"] for r in run.rows(FAULTY)] == [0, 1]
    saved = torch.load(tmp_path / f"peer-{FAULTY}.pt", weights_only=True)
    assert saved["round"] == 2 and saved["param_digest"] == run.rows(FAULTY)[-1]["param_digest"]


def test_a_fault_plan_names_known_faults() -> None:
    with pytest.raises(ValueError, match="fault 'lost' for"):
        LocalCoordinator(_cfg(), total_rounds=1, faults={("p0", 1): "lost"})


def _momentum(trainer: Trainer) -> list[torch.Tensor]:
    return [t.clone() for state in trainer.opt.state_dict()["state"].values() for t in state.values()
            if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("later", ["comes", "lost", "differs"])
async def test_a_canonical_digest_that_comes_after_the_aggregate_is_checked_before_the_next_compress(
        tmp_path: Path, overlap: int, later: str) -> None:
    """As the gRPC coordinator sends it (the GetAggregate stream's trailer), round 2's digest comes after
    its aggregate. A plain peer settles the round and trains round 3's forward and backward meanwhile,
    then waits for the digest before round 3's compress; an overlapped peer waits for it after the settle.
    One that never comes (the stream broke off: a coordinator that died after its publish) is not
    checked there; the coordinator checks the peer's digest at its next Submit. One that differs: the
    peer loads the run's parameters, and a plain peer drops round 3's gradients, so that the momentum
    round 3 is compressed into is the one the settle of round 2 left."""
    after_settle: list[list[torch.Tensor]] = []
    compressed_from: dict[int, list[torch.Tensor]] = {}  # round -> the momentum of its last compress

    def wrap(client: Any) -> None:
        gather = client.gather

        async def later_digest(r: int, payload: Payload, **kwargs: Any) -> Any:
            result = await gather(r, payload, **kwargs)
            if r != 2:
                return result

            async def digest() -> str:
                loop = run.loops[FAULTY]
                settled = loop.digest
                while loop.digest == settled:  # until the peer has applied the round (an overlapped peer
                    await asyncio.sleep(0.001)  # may still be compressing the next one when it comes)
                after_settle.append(_momentum(trainer))
                while not overlap and backwards[0] < 4:  # a plain peer: until round 3's backward is done
                    await asyncio.sleep(0.001)
                await asyncio.sleep(0.05)
                if later == "lost":
                    raise InvalidPayload("GetAggregate(2): the stream broke off before the canonical digest")
                return "0" * 32 if later == "differs" else await result.canonical_digest()
            return dataclasses.replace(result, param_digest="", digest_later=asyncio.create_task(digest()))

        client.gather = later_digest
        trainer = run.trainers[FAULTY]
        backwards, forward_backward, compress = [0], trainer.forward_backward, trainer.compress

        def counted(until: float | None = None) -> float:
            loss = forward_backward(until)
            backwards[0] += 1
            return loss

        def recorded(undoable: bool = False, topk: int | None = None) -> Payload:
            compressed_from[run.loops[FAULTY].round] = _momentum(trainer)
            return compress(undoable, topk)

        trainer.forward_backward, trainer.compress = counted, recorded  # type: ignore[method-assign]

    run = _Run(tmp_path, {}, overlap=overlap, wrap=wrap)
    await run.run()
    assert run.codes == {"p0": 0, FAULTY: 0}
    path = tmp_path / f"metrics-{FAULTY}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(ROUNDS))
    if overlap:
        assert rows[2]["phases"]["digest"] >= 0.04  # the wait for it, after the settle
    else:  # the wait for it, after round 3's backward (a round 3 trained again after a resync waits for none)
        assert "digest" not in rows[2].get("phases", {})
        if later != "differs":
            assert rows[3]["phases"]["check"] >= 0.04 and rows[3]["wait_s"] >= rows[3]["phases"]["check"]
            assert rows[3]["round_time_s"] > rows[3]["wait_s"]
    assert rows[2]["canonical_digest"] == {"lost": "", "comes": rows[2]["param_digest"], "differs": "0" * 32}[later]
    assert all(r["param_digest"] == r["canonical_digest"] for r in rows if r["round"] != 2)
    assert rows[-1]["resyncs"] == (later == "differs") and rows[2].get("resynced", False) == (later == "differs")
    assert run.restored == {"p0": [], FAULTY: []}  # the aggregate was applied: nothing went back whole
    assert run.loops["p0"].digest == run.loops[FAULTY].digest == run.hub.state.digest
    if not overlap:  # round 3's payload: from the momentum the settle of round 2 left, to the bit
        assert len(after_settle) == 1
        assert all(torch.equal(a, b) for a, b in zip(after_settle[0], compressed_from[3], strict=True))


async def test_an_overlapped_payload_leaves_before_the_round_before_is_settled(tmp_path: Path) -> None:
    """With a gatherer that takes its digest later (`digest_follows`), round r+1's payload is handed over
    before round r's outcome is known, with a digest still to come; when round r does not apply (here:
    refused as stale), that payload is called off and the round is done again from the loaded parameters."""
    calls: list[tuple[int, str]] = []

    def wrap(client: Any) -> None:
        gather = client.gather

        async def recorded(r: int, payload: Payload, *, param_digest: Any, **kwargs: Any) -> Any:
            calls.append((r, "with its digest" if not param_digest.follows else
                          "digest to follow" if not param_digest.is_known else "digest known"))
            try:
                return await gather(r, payload, param_digest=param_digest, **kwargs)
            except asyncio.CancelledError:
                calls.append((r, "called off"))
                raise

        client.gather = recorded

    run = _Run(tmp_path, {(FAULTY, 2): "stale"}, overlap=1, wrap=wrap)
    await run.run()
    assert run.codes == {"p0": 0, FAULTY: 0}
    assert calls == [(0, "with its digest"), (1, "digest to follow"), (2, "digest to follow"),
                     (3, "digest to follow"), (3, "called off"),  # round 2 went stale: round 3's gradient is dropped
                     (3, "with its digest"), (4, "digest to follow"), (5, "digest to follow")], calls
    assert run.restored[FAULTY] == [2]  # round 2's payload went back once; round 3's compress was undone
    assert [r["round"] for r in run.rows(FAULTY)] == [0, 1, 3, 4, 5]
    assert run.loops["p0"].digest == run.loops[FAULTY].digest == run.hub.state.digest


async def test_a_gatherers_encode_ahead_runs_in_the_training_thread_and_is_not_compute(tmp_path: Path) -> None:
    """A gatherer that encodes ahead (`EncodesAhead`: DHT mode's parts) has its function run in the training's
    worker thread, on the very host payload its `gather` then gets, once per plain round. Its time counts in
    the round and in the row's ``phases.encode``, not in the round's compute."""
    encode_s = 0.5  # far longer than a round's compute of this tiny model
    seen: list[tuple[int, bool, Payload]] = []

    def wrap(client: Any) -> None:
        gather = client.gather
        client.digest_follows = False  # each round's digest is checked at its settle: every round is plain

        def encode_ahead(r: int) -> Any:
            def encode(payload: Payload) -> None:
                seen.append((r, threading.current_thread() is threading.main_thread(), payload))
                time.sleep(encode_s)
            return encode

        async def gathered(r: int, payload: Payload, **kwargs: Any) -> Any:
            assert seen[-1][0] == r and seen[-1][2] is payload, "gather got another payload than the encode"
            return await gather(r, payload, **kwargs)

        client.encode_ahead, client.gather = encode_ahead, gathered

    run = _Run(tmp_path, {}, overlap=0, wrap=wrap)
    await run.run()
    assert run.codes == {"p0": 0, FAULTY: 0}
    assert [r for r, _, _ in seen] == list(range(ROUNDS))
    assert not any(on_loop for _, on_loop, _ in seen)  # never on the event loop's thread
    rows = run.rows(FAULTY)
    assert [r["round"] for r in rows] == list(range(ROUNDS))
    for row in rows:
        assert row["phases"]["encode"] >= encode_s
        assert row["compute_s"] < encode_s <= row["round_time_s"], row


async def test_an_encode_ahead_that_fails_leaves_the_round_to_gather(tmp_path: Path) -> None:
    """An encode ahead is a head start only: one that raises is logged, and the round goes on with `gather`
    (which encodes the payload itself): every round applies, on the canonical digest."""
    failed: list[int] = []

    def wrap(client: Any) -> None:
        client.digest_follows = False

        def encode_ahead(r: int) -> Any:
            def encode(payload: Payload) -> None:
                failed.append(r)
                raise ValueError("cannot encode this")
            return encode

        client.encode_ahead = encode_ahead

    run = _Run(tmp_path, {}, overlap=0, wrap=wrap)
    await run.run()
    assert run.codes == {"p0": 0, FAULTY: 0}
    assert failed == list(range(ROUNDS))
    assert [r["round"] for r in run.rows(FAULTY)] == list(range(ROUNDS))
    assert run.restored[FAULTY] == []  # nothing went back: every payload made it into its round
    assert run.loops["p0"].digest == run.loops[FAULTY].digest == run.hub.state.digest


async def test_rounds_by_the_clock_size_each_peers_work_and_weight_its_payload(tmp_path: Path, overlap: int) -> None:
    """`round_s`: the faulty peer's micro-batches take 0.15 s (a slower accelerator), p0's a few ms. Each trains
    until its cut-off: p0 more micro-batches, the slow one fewer (at least one), both in every round, both on the
    canonical digest, each row with the samples its payload was weighted by."""
    run = _Run(tmp_path, {}, overlap=overlap, slow_s=0.15, round_s=0.4)
    await run.run()
    assert run.codes == {"p0": 0, FAULTY: 0}
    fast, slow_rows = run.rows("p0"), run.rows(FAULTY)
    assert [r["round"] for r in fast] == [r["round"] for r in slow_rows] == list(range(ROUNDS))
    assert all(r["contributors"] == 2 for r in fast + slow_rows)
    assert all(r["samples"] == 2 * r["micro_batches"] >= 2 for r in fast + slow_rows)  # batch_size 2
    micro = {p: sorted(r["micro_batches"] for r in rows) for p, rows in (("p0", fast), (FAULTY, slow_rows))}
    assert micro[FAULTY][len(micro[FAULTY]) // 2] < micro["p0"][len(micro["p0"]) // 2], micro


@pytest.mark.parametrize("lockstep", [False, True], ids=["automatic", "lockstep"])
async def test_the_automatic_round_length_turns_to_the_clock_for_a_slow_peer(tmp_path: Path, lockstep: bool) -> None:
    """No `round_s` set: the faulty peer's micro-batches take 0.4 s, p0's a few ms. After the first round, which
    measures them, the coordinator announces rounds by the clock: p0 trains more micro-batches while the slow one
    trains its one, both in every round. With `lockstep` set, every round is one micro-batch each. (The case
    where the slow member sets the length is tests/integration/test_mixed_speed.py's and bench/mixed_speed.py's.)"""
    # 64 micro-batches of p0's few ms cover the slow one's 0.4 s, however loaded the machine (with 16, its
    # round could be out of reach of the median's: `RoundPace` would not stretch the round to it).
    run = _Run(tmp_path, {}, overlap=0, slow_s=0.4, lockstep=lockstep, max_micro_batches=64)
    await run.run()
    assert run.codes == {"p0": 0, FAULTY: 0}
    fast, slow_rows = run.rows("p0"), run.rows(FAULTY)
    assert all(r["contributors"] == 2 for r in fast + slow_rows)
    if lockstep:
        assert [r["micro_batches"] for r in slow_rows] == [1] * ROUNDS
        assert [r["micro_batches"] for r in fast] == [1] * ROUNDS
        assert run.hub.core.pace.round_s == 0.0
    else:
        assert fast[0]["micro_batches"] == 1  # the first round measures
        assert max(r["micro_batches"] for r in fast[2:]) > max(r["micro_batches"] for r in slow_rows[2:]), (
            [r["micro_batches"] for r in fast], [r["micro_batches"] for r in slow_rows])
        assert run.hub.core.pace.round_s > 0.4  # the slow one's round of one micro-batch, and a tenth


async def test_a_round_s_shorter_than_one_micro_batch_warns_and_the_peer_trains_one_a_round(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A fixed `round_s` of 0.05 s, and a peer whose one micro-batch takes 0.3 s: it says so once, trains one
    micro-batch a round, and the round waits for it (a fixed round waits up to the round timeout): both are in
    every round, and the run makes progress."""
    import logging
    run = _Run(tmp_path, {}, overlap=0, slow_s=0.3, round_s=0.05)
    with caplog.at_level(logging.WARNING, logger="demonet.loop.round_loop"):
        await run.run()
    assert run.codes == {"p0": 0, FAULTY: 0}
    slow_rows = run.rows(FAULTY)
    assert [r["micro_batches"] for r in slow_rows] == [1] * ROUNDS
    assert all(r["contributors"] == 2 for r in slow_rows + run.rows("p0"))
    warned = [r.getMessage() for r in caplog.records if "over the round's" in r.getMessage()]
    assert len(warned) == 1 and f"[{FAULTY} " in warned[0], warned
