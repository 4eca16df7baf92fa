"""The coordinator's state written in the background (demonet.coordinator.persist): a snapshot taken when a
round closes is not changed by the next apply; snapshots submitted while a write runs are coalesced to the
newest, without waiting; a failed write is logged, counted and tried again; `flush` leaves the newest on disk.
Real writes into a temp folder; a write is held back by making it wait for its cue, and made to fail by a
folder where the temp file goes."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from demonet import wire
from demonet.config import Config, load_config
from demonet.coordinator.metrics import Metrics
from demonet.coordinator.persist import Persister, Snapshot
from demonet.coordinator.rounds import ClosedRound
from demonet.coordinator.state import STATE_FILE, CanonicalState, write_state
from demonet.errors import StateNotSaved
from demonet.optim import Payload
from demonet.wire.digest import legacy_param_digest, param_digest
from demonet.wire.merge import decode_contribution

_TINY = {"model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32}, "train": {"seq_len": 32}}


@pytest.fixture(scope="module")
def cfg() -> Config:
    return load_config(None, {}, _TINY)


@pytest.fixture(scope="module")
def payload(cfg: Config) -> Payload:
    """A payload of a seeded gradient, as the coordinator decodes it (reused for every round)."""
    peer = CanonicalState(cfg)  # its optimizer compresses like a peer's
    gen = torch.Generator().manual_seed(1)
    for p in peer.params.values():
        p.grad = torch.randn(p.shape, generator=gen)
    data = wire.encode(peer.opt.compress(), step=0)
    return decode_contribution(data, expected=peer.specs, rules=peer.rules)[1]


def _snapshot(state: CanonicalState, round: int) -> Snapshot:
    return Snapshot(round, {**state.snapshot(), "rounds": {"round": round, "members": ["a"], "joiners": []},
                            "counters": {}})


def _on_disk(state_dir: Path) -> dict[str, Any]:
    return dict(torch.load(state_dir / STATE_FILE, map_location="cpu", weights_only=False))


def test_a_snapshot_keeps_its_round_while_the_next_apply_changes_the_parameters(
        cfg: Config, payload: Payload, tmp_path: Path) -> None:
    state = CanonicalState(cfg)
    state.close(ClosedRound(0, ("a",), False), [payload])
    snap = _snapshot(state, 1)
    kept = {n: t.clone() for n, t in snap.body["params"].items()}
    state.close(ClosedRound(1, ("a",), False), [payload])  # in place, as the next round's apply does
    assert state.digest != snap.body["digest"]
    assert all(torch.equal(kept[n], t) for n, t in snap.body["params"].items())
    assert param_digest(snap.body["params"].items()) == snap.body["digest"]
    write_state(tmp_path, snap.body)
    resumed = CanonicalState(cfg)
    saved = resumed.load(tmp_path)  # checks the parameters against the digest saved with them
    assert saved is not None and saved["rounds"]["round"] == 1 and resumed.digest == snap.body["digest"]


async def test_snapshots_submitted_while_a_write_runs_are_coalesced_to_the_newest(
        cfg: Config, tmp_path: Path) -> None:
    cue, began = threading.Event(), threading.Event()
    attempted: list[int] = []

    def held_write(state_dir: Path, body: dict[str, Any]) -> None:
        attempted.append(body["rounds"]["round"])
        began.set()
        assert cue.wait(10), "the test never gave the cue"
        write_state(state_dir, body)

    metrics = Metrics()
    persister = Persister(tmp_path, metrics, write=held_write)
    state = CanonicalState(cfg)
    snaps = [_snapshot(state, r) for r in (1, 2, 3, 4)]
    persister.submit(snaps[0])
    assert await asyncio.to_thread(began.wait, 10)
    t0 = time.perf_counter()
    for snap in snaps[1:]:  # rounds that close while round 1's state is being written
        persister.submit(snap)
    assert time.perf_counter() - t0 < 0.05, "submit waited for the write in flight"
    assert persister.busy and metrics.totals["persist_coalesced"] == 2  # 2 and 3 replaced before their turn
    cue.set()
    await persister.flush()
    assert attempted == [1, 4] and not persister.busy
    assert persister.written_round == 4 and metrics.persisted_round._value.get() == 4
    assert _on_disk(tmp_path)["rounds"]["round"] == 4
    assert not (tmp_path / (STATE_FILE + ".tmp")).exists()


async def test_a_failed_write_is_logged_counted_and_tried_again(
        cfg: Config, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    persister = Persister(tmp_path, metrics)
    state = CanonicalState(cfg)
    persister.submit(_snapshot(state, 1))
    await persister.flush()
    blocker = tmp_path / (STATE_FILE + ".tmp")
    blocker.mkdir()  # the temp file cannot be created, as on a full disk or a folder without permission
    with caplog.at_level(logging.ERROR, logger="demonet.coordinator.persist"):
        persister.submit(_snapshot(state, 2))
        while persister.busy:
            await asyncio.sleep(0.01)
        assert metrics.totals["persist_failures"] == 1
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert errors and "could not write the state" in errors[0].getMessage() and errors[0].exc_info
        assert "still holds round 1," in errors[0].getMessage()
        with pytest.raises(StateNotSaved, match="round 2"):  # flush tries the newest once more, then says so
            await persister.flush()
    assert metrics.totals["persist_failures"] == 2 and _on_disk(tmp_path)["rounds"]["round"] == 1
    blocker.rmdir()
    await persister.flush()  # the disk is back: the newest snapshot is written now
    assert _on_disk(tmp_path)["rounds"]["round"] == 2 and persister.written_round == 2
    persister.submit(_snapshot(state, 3))  # and the rounds after it as usual
    await persister.flush()
    assert _on_disk(tmp_path)["rounds"]["round"] == 3


async def test_a_snapshot_is_due_only_when_the_writer_is_free_and_the_interval_has_passed(
        cfg: Config, tmp_path: Path) -> None:
    cue, began = threading.Event(), threading.Event()

    def held_write(state_dir: Path, body: dict[str, Any]) -> None:
        began.set()
        assert cue.wait(10), "the test never gave the cue"
        write_state(state_dir, body)

    state = CanonicalState(cfg)
    every = Persister(tmp_path / "every", Metrics(), write=held_write)
    assert every.due()  # nothing written yet
    every.submit(_snapshot(state, 1))
    assert await asyncio.to_thread(began.wait, 10)
    assert not every.due()  # a round closed during the write is not cloned, to be thrown away
    cue.set()
    await every.flush()
    assert every.due()  # every_s=0: the next round's close, once the writer is free
    with pytest.raises(ValueError, match="every_s"):
        Persister(tmp_path, Metrics(), every_s=-1.0)
    sparse = Persister(tmp_path / "sparse", Metrics(), every_s=600.0)
    sparse.submit(_snapshot(state, 1))
    await sparse.flush()
    assert not sparse.due()  # written less than every_s ago
    blocker = tmp_path / "sparse" / (STATE_FILE + ".tmp")
    blocker.mkdir()  # the next write fails ...
    sparse.submit(_snapshot(state, 2))
    while sparse.busy:
        await asyncio.sleep(0.01)
    assert sparse.due()  # ... and the round after tries again at once, whatever the interval


def test_a_state_saved_by_protocol_1_resumes_with_its_digest_recomputed(
        cfg: Config, payload: Payload, tmp_path: Path) -> None:
    state = CanonicalState(cfg)
    closed = state.close(ClosedRound(0, ("a",), False), [payload])
    old = legacy_param_digest(state.params.items())
    older = replace(closed, round=-1, param_digest="0" * 32)  # an earlier round's: its parameters are gone
    body = {**_snapshot(state, 1).body, "digest": old,
            "aggregates": [older, replace(closed, param_digest=old)]}  # as protocol 1 wrote them
    write_state(tmp_path, body)
    resumed = CanonicalState(cfg)
    saved = resumed.load(tmp_path)
    assert saved is not None and resumed.digest == state.digest == param_digest(state.params.items()) != old
    assert [a.param_digest for a in saved["aggregates"]] == ["0" * 32, state.digest]
    write_state(tmp_path, {**body, "digest": "f" * 32})  # neither version's digest of these parameters
    with pytest.raises(ValueError, match="do not match their digest"):
        CanonicalState(cfg).load(tmp_path)
