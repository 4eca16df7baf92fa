"""A user's own training loop in a run (`demonet.join`), over the in-process coordinator (no sockets).

The run's transport lives on the joined run's background event loop, the user's loop on this
thread: `run.optimizer` loads the run's parameters (or refuses a model that does not fit, leaving it
unchanged), each `opt.step()` is one round, and `run.done` turns true at the run's end, on `stop`,
and the loop can be left early. The same user loop as two processes over gRPC:
tests/integration/test_own_loop.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import demonet
from demonet.config import Config, load_config
from demonet.coordinator.local import LocalCoordinator
from demonet.joined import JoinedDeMo, JoinedRun
from demonet.joining import RunTransport
from demonet.optim import DeMo
from demonet.train.data import Batches, load_corpus, split
from demonet.train.model import GPT
from demonet.transport.coordinated import CoordinatorMembership
from demonet.wire.digest import param_digest

ROUNDS = 4


def _cfg() -> Config:
    return load_config(None, {}, {
        "model": {"d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 16},
        "train": {"seq_len": 16, "batch_size": 2},
        "optim": {"compression_topk": 4, "compression_chunk": 8},
        "net": {"start_peers": 1, "round_timeout_s": 20.0, "heartbeat_timeout_s": 60.0}})


def _join(tmp_path: Path, hubs: list[LocalCoordinator], *, rounds: int = ROUNDS) -> JoinedRun:
    """A joined run of peer "u" over a `LocalCoordinator` made on the run's own event loop."""

    async def make() -> RunTransport:
        hub = LocalCoordinator(_cfg(), total_rounds=rounds)
        hubs.append(hub)
        hub.ticker = asyncio.create_task(hub.tick_forever(max_sleep_s=0.05))  # type: ignore[attr-defined]
        membership = CoordinatorMembership(hub.client("u"))
        info = await membership.join()

        async def prepare(opt: DeMo) -> Any:
            return info

        return RunTransport(membership, membership.client, info, prepare)

    return JoinedRun("u", out=tmp_path, checkpoint_every=0)._open(make)


def _train(run: JoinedRun, model: torch.nn.Module, opt: JoinedDeMo, *, rounds: int | None = None) -> int:
    """The user's loop; returns the number of steps taken."""
    batches = Batches(split(load_corpus(None))[0], batch_size=2, seq_len=16, seed=0)
    steps = 0
    while not run.done and (rounds is None or steps < rounds):
        x, y = next(batches)
        _, loss = model(x, y)
        assert loss is not None
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
        steps += 1
    return steps


def _rows(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "metrics-u.jsonl").read_text().splitlines()]


def test_a_user_loop_trains_every_round_to_the_runs_parameters(tmp_path: Path) -> None:
    hubs: list[LocalCoordinator] = []
    with _join(tmp_path, hubs) as run:
        torch.manual_seed(1234)  # not the run's seed: the optimizer must load the run's parameters
        model = GPT(run.config.model)
        opt = run.optimizer(model)
        assert isinstance(opt, DeMo) and opt.param_groups[0]["lr"] == run.config.optim.lr
        assert param_digest(model.named_parameters()) == hubs[0].state.digest
        assert (run.round, run.done) == (0, False)
        assert _train(run, model, opt) == ROUNDS
        assert run.done and run.reason == "the run is over" and run.round == ROUNDS
        with pytest.raises(RuntimeError, match="the run is done"):
            opt.step()
    rows = _rows(tmp_path)
    assert [r["round"] for r in rows] == list(range(ROUNDS))
    assert all(math.isfinite(r["loss"]) and r["contributors"] == 1 and "time" in r for r in rows)
    assert rows[-1]["param_digest"] == rows[-1]["canonical_digest"] == hubs[0].state.digest == run.digest
    assert param_digest(model.named_parameters()) == run.digest
    assert torch.load(tmp_path / "peer-u.pt", weights_only=True)["round"] == ROUNDS


def test_a_model_that_does_not_fit_is_refused_and_left_unchanged(tmp_path: Path) -> None:
    with _join(tmp_path, []) as run:
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(run.config.model, d_model=8))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(ValueError, match=r"does not fit the run's parameters: .* expected \(\d+, 8\)"):
            run.optimizer(model)
        assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
        assert run.done


def test_names_that_differ_are_named() -> None:
    from demonet.errors import InvalidPayload
    from demonet.wire.params import decode_parameters, encode_parameters

    blob = encode_parameters([("a", torch.zeros(2)), ("b", torch.zeros(3))], round=0)
    with pytest.raises(InvalidPayload, match="parameter 1 is 'c' in the model, 'b' in the parameters"):
        decode_parameters(blob, expected={"a": ((2,), torch.float32), "c": ((3,), torch.float32)})
    with pytest.raises(InvalidPayload, match="the model has 1 more than the parameters, from 'z'"):
        decode_parameters(blob, expected={"a": ((2,), torch.float32), "b": ((3,), torch.float32),
                                          "z": ((1,), torch.float32)})


def test_stop_ends_the_run_and_leaving_early_saves(tmp_path: Path) -> None:
    hubs: list[LocalCoordinator] = []
    with _join(tmp_path, hubs, rounds=0) as run:  # a run with no end
        model = GPT(run.config.model)
        opt = run.optimizer(model)
        assert _train(run, model, opt, rounds=2) == 2
        run.stop()
        assert run.done and _train(run, model, opt) == 0
    assert run.reason == "stopped"
    assert len(_rows(tmp_path)) == 2
    assert torch.load(tmp_path / "peer-u.pt", weights_only=True)["round"] == 2
    assert "u" not in hubs[0].rounds.members  # it told the coordinator it left: no round waits for it


def test_leaving_the_with_block_mid_run_leaves_the_run(tmp_path: Path) -> None:
    hubs: list[LocalCoordinator] = []
    with _join(tmp_path, hubs, rounds=0) as run:
        model = GPT(run.config.model)
        opt = run.optimizer(model)
        assert _train(run, model, opt, rounds=2) == 2
        assert "u" in hubs[0].rounds.members  # the loop waits for the user's next round
    assert run.reason == "left"
    assert "u" not in hubs[0].rounds.members and "u" not in hubs[0].rounds.joiners


def test_join_needs_one_transport() -> None:
    with pytest.raises(ValueError, match="either coordinator"):
        demonet.join(token="t")
    with pytest.raises(ValueError, match="either coordinator"):
        demonet.join("127.0.0.1:1", token="t", dht_initial_peers=[])


def test_join_without_a_token_names_its_own_keyword(monkeypatch: pytest.MonkeyPatch) -> None:
    # join is called from Python: the message names its keyword and the variable, not a command's flag.
    monkeypatch.delenv("DEMONET_TOKEN", raising=False)
    for token in (None, ""):
        with pytest.raises(ValueError, match=r"no token: pass token=\.\.\. or set DEMONET_TOKEN$"):
            demonet.join("127.0.0.1:1", token=token)
