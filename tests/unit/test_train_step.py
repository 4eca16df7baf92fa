"""A replica's step options: the round's lr reaches the apply, bf16 autocast, gradient clipping before compress."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from demonet.config import Config, load_config
from demonet.optim import LrSchedule, Payload, aggregate
from demonet.train.trainer import StepOptions, Trainer, to_device
from demonet.transport import RoundResult


def _cfg(tmp_path: Path, **train: object) -> Config:
    return load_config(None, {}, {
        "model": {"seq_len": 32, "d_model": 32, "n_layers": 1, "n_heads": 2},
        "optim": {"compression_chunk": 16, "compression_topk": 4},
        "train": {"batch_size": 2, "seq_len": 32, "out": str(tmp_path), **train}})


def _trainer(cfg: Config, options: StepOptions | None = None) -> Trainer:
    trainer = Trainer.for_run(cfg, data_seed=0, device=torch.device("cpu"))
    if options is not None:
        trainer.options = options
    return trainer


def _result(round: int, agg: Payload) -> RoundResult:
    return RoundResult(round=round, aggregate=agg, contributors=("p0",), param_digest="", aborted=False,
                       bytes_up=0, bytes_down=0)


def _flat(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


def test_settle_applies_with_the_lr_of_the_result_round(tmp_path: Path) -> None:
    schedule = LrSchedule(lr=1e-3, warmup_rounds=10)
    trainer = _trainer(_cfg(tmp_path), StepOptions(lr=schedule))
    _, payload = trainer.train_step()
    agg = aggregate([payload])
    moved = {}
    for round in (0, 4):
        t = copy.deepcopy(trainer)
        before = _flat(t)
        t.settle(payload, _result(round, agg), contributed=True)
        moved[round] = float((_flat(t) - before).abs().max())
    # the sign base moves a parameter by exactly lr (up to the rounding of p + lr): lr(0) = lr / 10, lr(4) = lr / 2
    assert moved[0] == pytest.approx(schedule(0), rel=1e-3)
    assert moved[4] == pytest.approx(schedule(4), rel=1e-3)


def test_apply_lr_is_the_group_lr_of_that_step(tmp_path: Path) -> None:
    """apply(agg, lr=x) gives the bits of a group lr of x: the coordinator and the peers may use either."""
    trainer = _trainer(_cfg(tmp_path))
    _, payload = trainer.train_step()
    agg = aggregate([payload])
    a, b = copy.deepcopy(trainer), copy.deepcopy(trainer)
    lr = LrSchedule(lr=3e-3, warmup_rounds=7)(2)
    a.opt.apply(agg, lr=lr)
    for group in b.opt.param_groups:
        group["lr"] = lr
    b.opt.apply(agg)
    assert torch.equal(_flat(a), _flat(b))
    assert a.opt.param_groups[0]["lr"] == 3e-3  # apply's lr does not stick


def _grad_norm_at_compress(trainer: Trainer) -> list[float]:
    seen: list[float] = []
    compress = trainer.opt.compress

    def spy(undoable: bool = False, topk: int | None = None) -> Payload:
        seen.append(float(torch.linalg.vector_norm(torch.stack(
            [p.grad.norm() for p in trainer.model.parameters() if p.grad is not None]))))
        return compress(undoable=undoable, topk=topk)

    trainer.opt.compress = spy  # type: ignore[method-assign]
    return seen


def test_max_grad_norm_bounds_the_gradient_entering_compress(tmp_path: Path) -> None:
    free, clipped = _trainer(_cfg(tmp_path)), _trainer(_cfg(tmp_path, max_grad_norm=0.05))
    assert clipped.options.max_grad_norm == 0.05
    free_norms, clipped_norms = _grad_norm_at_compress(free), _grad_norm_at_compress(clipped)
    loss_free, payload_free = free.train_step()
    loss_clipped, payload_clipped = clipped.train_step()
    assert loss_free == loss_clipped  # the same forward
    assert free_norms[0] > 0.05  # the gradient is above the bound ...
    assert clipped_norms[0] <= 0.05 * (1 + 1e-5)  # ... and clipped to it before compress
    assert clipped_norms[0] == pytest.approx(0.05, rel=1e-4)
    assert not torch.equal(payload_free.tensors["blocks.0.mlp.fc.weight"].val,
                           payload_clipped.tensors["blocks.0.mlp.fc.weight"].val)


def test_a_large_max_grad_norm_changes_nothing(tmp_path: Path) -> None:
    free, loose = _trainer(_cfg(tmp_path)), _trainer(_cfg(tmp_path, max_grad_norm=1e6))
    _, a = free.train_step()
    _, b = loose.train_step()
    assert all(torch.equal(a.tensors[n].val, b.tensors[n].val) for n in a.tensors)


def test_bf16_runs_under_autocast_with_float32_parameters_and_state(tmp_path: Path) -> None:
    fp32, bf16 = _trainer(_cfg(tmp_path)), _trainer(_cfg(tmp_path, precision="bf16"))
    assert bf16.options.precision == "bf16"
    loss32, payload32 = fp32.train_step()
    loss16, payload16 = bf16.train_step()
    assert torch.isfinite(torch.tensor(loss16))
    assert loss16 != loss32  # bfloat16 matmuls round differently ...
    assert loss16 == pytest.approx(loss32, abs=0.05)  # ... but compute the same loss
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert all(s["momentum"].dtype == torch.float32 for s in bf16.opt.state.values())
    assert all(c.val.dtype == torch.float32 for c in payload16.tensors.values())
    assert any(not torch.equal(payload16.tensors[n].val, payload32.tensors[n].val) for n in payload16.tensors)
    bf16.settle(payload16, _result(0, aggregate([payload16])), contributed=True)
    assert all(p.dtype == torch.float32 and bool(torch.isfinite(p).all()) for p in bf16.model.parameters())


def test_bad_step_options_raise() -> None:
    with pytest.raises(ValueError, match="precision should be one of"):
        StepOptions(precision="fp16")
    with pytest.raises(ValueError, match="max_grad_norm should be >= 0"):
        StepOptions(max_grad_norm=-1.0)


def _nested() -> dict[str, object]:
    return {"ids": torch.arange(6).view(2, 3), "pair": (torch.ones(2), [torch.zeros(1), "tag"]), "n": 3}


def test_to_device_moves_every_tensor_and_keeps_the_structure() -> None:
    batch = _nested()
    moved = to_device(batch, torch.device("cpu"))
    assert moved.keys() == batch.keys() and moved["n"] == 3 and moved["pair"][1][1] == "tag"
    assert isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list)
    assert torch.equal(moved["ids"], batch["ids"]) and torch.equal(moved["pair"][0], batch["pair"][0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_device_copies_to_cuda_from_pinned_memory() -> None:
    batch = _nested()
    moved = to_device(batch, torch.device("cuda"))
    torch.cuda.current_stream().synchronize()
    assert moved["ids"].is_cuda and moved["pair"][1][0].is_cuda
    assert torch.equal(moved["ids"].cpu(), batch["ids"])
    assert not batch["ids"].is_pinned()  # the caller's tensor stays as it was


def test_a_checkpoint_written_while_the_next_compress_is_pending_holds_the_settled_momentum(tmp_path: Path) -> None:
    """An overlapped peer compresses round r+1 before it settles round r and may checkpoint in between:
    the file must hold round r's settled momentum (the round it resumes at is r+1, to be compressed again),
    and the live momentum must be left as it was."""
    trainer = Trainer.for_run(_cfg(tmp_path), data_seed=0, device=torch.device("cpu"),
                              checkpoint=tmp_path / "peer.pt")
    _, payload = trainer.train_step()
    settled = copy.deepcopy(trainer)
    settled.settle(payload, _result(0, aggregate([payload])), contributed=False)  # restores all of it
    trainer.forward_backward()
    trainer.compress(undoable=True)
    trainer.settle(payload, _result(0, aggregate([payload])), contributed=False)
    live = [s["momentum"].clone() for s in trainer.opt.state.values()]
    trainer.save({"round": 1})
    saved = torch.load(tmp_path / "peer.pt", weights_only=True)["optim"]["state"]
    want = [s["momentum"] for s in settled.opt.state.values()]
    by_index = settled.opt.state_dict()["state"]
    assert by_index.keys() == saved.keys()
    assert all(torch.equal(saved[i]["momentum"], by_index[i]["momentum"]) for i in saved)
    assert any(not torch.equal(a, b) for a, b in zip(live, want, strict=True)), "the compress changed nothing"
    assert all(torch.equal(s["momentum"], m) for s, m in zip(trainer.opt.state.values(), live, strict=True))
    trainer.undo_compress()
    assert all(torch.equal(s["momentum"], m) for s, m in zip(trainer.opt.state.values(), want, strict=True))


def test_a_round_with_a_cut_off_trains_micro_batches_until_it_at_least_one_and_their_mean_gradient(
        tmp_path: Path) -> None:
    import time

    cfg = _cfg(tmp_path)
    trainer = _trainer(cfg)
    trainer.pace.max_micro_batches = 3
    loss = trainer.forward_backward(until=time.perf_counter() + 60.0)  # room for more than the most
    assert trainer.micro_batches() == 3 and trainer.samples() == 3 * cfg.train.batch_size
    assert loss == loss  # a number
    grads = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
    twin = _trainer(cfg)  # the same seed and data stream: its 3 micro-batches' mean gradient, by hand
    for p in twin.model.parameters():
        p.grad = None
    total = [torch.zeros_like(g) for g in grads]
    for _ in range(3):
        batch = to_device(next(twin.batches), torch.device("cpu"))
        twin.loss(twin.model, batch).backward()
        total = [p.grad.clone() for p in twin.model.parameters() if p.grad is not None]
    for g, t in zip(grads, total, strict=True):
        assert torch.allclose(g, t / 3, rtol=1e-5, atol=1e-7)
    trainer.opt.zero_grad()
    trainer.forward_backward(until=time.perf_counter() - 1.0)  # a cut-off already past: one micro-batch still
    assert trainer.micro_batches() == 1 and trainer.samples() == cfg.train.batch_size
    trainer.opt.zero_grad()
    trainer.forward_backward()  # no cut-off: the fixed accumulate (1)
    assert trainer.micro_batches() == 1


def test_the_pace_stops_before_a_micro_batch_that_would_end_past_the_cut_off() -> None:
    import time

    from demonet.train.micro_batches import MicroBatchPace

    pace = MicroBatchPace(16)
    pace.took(0.5)
    assert not pace.another(time.perf_counter() + 0.2)  # the next one would end in about 0.5 s
    assert pace.another(time.perf_counter() + 5.0)
    for _ in range(15):
        pace.took(0.001)
    assert pace.count == 16 and not pace.another(time.perf_counter() + 60.0)  # the most a round trains
    pace.trained(16, 32)
    assert (pace.micro_batches, pace.samples, pace.count) == (16, 32, 0)


def test_a_micro_batch_across_rounds_takes_its_gradient_from_the_parameters_it_began_on(tmp_path: Path) -> None:
    """`span_begin` copies the parameters; rounds applied meanwhile change the replica, not the micro-batch's
    gradient, which is bit for bit the one a forward and backward on the parameters it began on gives; `span_take`
    adds it to the replica's gradients."""
    cfg = _cfg(tmp_path)
    trainer, twin = _trainer(cfg), _trainer(cfg)  # the same seed and data stream
    trainer.span_begin()
    with torch.no_grad():  # a round applied while the micro-batch runs
        for p in trainer.model.parameters():
            p.add_(0.5)
    loss, seconds = trainer.span_micro_batch()
    assert all(p.grad is None for p in trainer.model.parameters())  # nothing on the replica until it is taken
    trainer.span_take()
    expected = twin.forward_backward()  # on the parameters the micro-batch began on
    assert loss == expected and seconds > 0
    for p, q in zip(trainer.model.parameters(), twin.model.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad)
    assert trainer.micro_batches() == 1 and trainer.samples() == cfg.train.batch_size
    assert trainer.span_rows() == cfg.train.batch_size
    trainer.span_begin()  # the next one starts from the replica's parameters as they are now
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), trainer._spanning.parameters(),
                                                 strict=True))
