"""One peer's replica: its model, DeMo, data stream and loss; one training step, a round's outcome, checkpoints.

Torch work only, called from `demonet.loop.RoundLoop` in a worker thread. Imports the math layer, the config
and the wire digest; no network code.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from demonet.config import PRECISIONS, Config
from demonet.optim import DeMo, LrSchedule, Payload, aggregate
from demonet.wire.digest import param_digest

from .micro_batches import MicroBatchPace, batch_rows
from .replica import Expected, Settled
from .task import build_task

__all__ = ["DeMoSteps", "StepOptions", "Trainer", "autocast", "clip_grads", "settle", "to_device"]

Loss = Callable[[torch.nn.Module, Any], torch.Tensor]


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it (alone, or in tuples, lists or dicts) moved to `device`.

    To a CUDA device a CPU tensor travels from pinned memory without blocking the host: the copy is
    queued on the current stream, ahead of the forward that reads it, while Python goes on.
    """
    if isinstance(batch, torch.Tensor):
        if device.type == "cuda" and batch.device.type == "cpu" and not batch.is_pinned():
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


@dataclass(frozen=True, kw_only=True)
class StepOptions:
    """How a replica takes its step, beyond its model, optimizer and data.

    Attributes:
        lr: the learning rate of round r's apply, a pure function of r (`demonet.optim.LrSchedule`):
            every peer and the coordinator apply round r with the same value. None: the optimizer's own.
        precision: ``fp32``, or ``bf16``: forward (and so backward) under torch.autocast; parameters,
            gradients and the optimizer's state keep their dtype.
        max_grad_norm: clip the gradient to this L2 norm before compress; 0: no clipping.
    """

    lr: Callable[[int], float] | None = None
    precision: str = "fp32"
    max_grad_norm: float = 0.0

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision should be one of {PRECISIONS}, got {self.precision!r}")
        if not self.max_grad_norm >= 0.0:
            raise ValueError(f"max_grad_norm should be >= 0, got {self.max_grad_norm}")

    @classmethod
    def for_run(cls, cfg: Config) -> StepOptions:
        """A run's schedule (`[optim]`, over `train.steps` rounds), precision and clipping (`[train]`)."""
        return cls(lr=LrSchedule.from_settings(cfg.optim, cfg.train.steps), precision=cfg.train.precision,
                   max_grad_norm=cfg.train.max_grad_norm)

    def lr_at(self, round: int) -> float | None:
        return None if self.lr is None else self.lr(round)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """The forward's context: torch.autocast to bfloat16 on `device`'s type for ``bf16``, nothing for ``fp32``."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def clip_grads(params: Iterable[torch.Tensor], max_norm: float) -> None:
    """Scale the gradients down to an L2 norm of at most `max_norm` (0: leave them); DTensors too."""
    if max_norm > 0.0:
        torch.nn.utils.clip_grad_norm_(params, max_norm)


def settle(opt: DeMo, payload: Payload | None, result: Settled, contributed: bool,
           local: Callable[[Payload], Payload] = lambda p: p, lr: float | None = None) -> None:
    """Apply a round's outcome to an optimizer.

    The aggregate may hold only the largest merged coefficients, so a contributor restores the
    entries of its payload that the aggregate dropped; a peer whose payload missed the round
    restores all of it; an aborted round restores the payload and applies nothing; None: this peer had nothing
    in the round (a round it missed while its micro-batch spanned it): the aggregate is applied. `local` maps a
    whole-parameter payload to the optimizer's own rows (a FlexDeMo rank's shard). `lr`: the
    learning rate of the round's apply (`StepOptions.lr_at(result.round)`); None: the optimizer's.
    """
    if result.aggregate is None:
        if payload is not None:
            opt.restore(payload)
        return
    applied = local(result.aggregate)
    kept = local(result.kept) if result.kept is not None else applied
    if payload is not None:
        opt.restore(payload, kept=kept if contributed else None)
    else:
        opt.undo_lookahead()  # a held lookahead's parameters and base state go back first, as `restore` does
    opt.apply(applied, lr=lr)


class DeMoSteps:
    """The replica steps that need only its model, its DeMo and its `StepOptions`: a `Trainer`'s and a
    FlexDeMo rank's alike (`demonet.train.replica.Overlapping`). The class supplies `forward_backward`."""

    model: torch.nn.Module
    opt: DeMo
    options: StepOptions

    def forward_backward(self, until: float | None = None) -> float:
        raise NotImplementedError

    def compress(self, undoable: bool = False, topk: int | None = None) -> Payload:
        """Clip the gradient's norm (DTensors too), fold it into the momentum and take the round's payload;
        zero the gradients. `undoable`: until `commit_compress`, `undo_compress` can take it back; `topk`: this
        round's k (`DeMo.compress`)."""
        clip_grads(self.model.parameters(), self.options.max_grad_norm)
        payload = self.opt.compress(undoable=undoable, topk=topk)
        self.opt.zero_grad(set_to_none=True)
        return payload

    def drop_gradients(self) -> None:
        """Forget the gradients of a forward and backward whose round will not be compressed (they were
        taken on parameters the run does not hold)."""
        self.opt.zero_grad(set_to_none=True)

    def undo_compress(self) -> None:
        """Take the pending undoable `compress` back: the momentum as before it, the gradients gone."""
        self.opt.undo_compress()

    def commit_compress(self) -> None:
        """Keep the pending undoable `compress`: its payload goes out."""
        self.opt.commit_compress()

    def train_step(self, until: float | None = None) -> tuple[float, Payload]:
        """`forward_backward(until)`, then `compress`. Returns (loss, payload)."""
        return self.forward_backward(until), self.compress()

    def hold(self) -> None:
        """Keep the parameters as they are for `canonical_parameters` (`DeMo.hold`), before a `lookahead`."""
        self.opt.hold()

    def lookahead(self, payload: Payload, round: int) -> None:
        """Apply this replica's own payload of `round` at once (`DeMo.lookahead`; a FlexDeMo rank's rows,
        no collective); the round's real aggregate, or the restore of a lost round, replaces it."""
        self.opt.lookahead(aggregate([payload]), lr=self.options.lr_at(round))


class Trainer(DeMoSteps):
    """A single-process replica.

    Args:
        model: the replica; its parameters are what the run synchronizes.
        opt: DeMo over `model.named_parameters()`.
        batches: this peer's endless stream of batches; a `state_dict`/`load_state_dict` pair, if it
            has one, goes into the checkpoint so a restart does not see its batches again.
        loss: (model, batch) -> scalar loss tensor.
        device: where the batches go.
        accumulate: micro-batches per round (gradient accumulation) when the round has no cut-off.
        checkpoint: the checkpoint file; None: no checkpoints.
        options: the lr schedule, precision and gradient clipping.
        max_micro_batches: with a cut-off (`forward_backward(until)`), the most micro-batches of a round.
    """

    def __init__(self, model: torch.nn.Module, opt: DeMo, batches: Iterator[Any], loss: Loss, *,
                 device: torch.device, accumulate: int = 1, checkpoint: Path | None = None,
                 options: StepOptions = StepOptions(),  # noqa: B008 (frozen: safe to share)
                 max_micro_batches: int = 16) -> None:
        if accumulate < 1 or max_micro_batches < 1:
            raise ValueError(f"accumulate and max_micro_batches should be >= 1, got {accumulate}, {max_micro_batches}")
        self.model, self.opt, self.batches, self.loss = model, opt, batches, loss
        self.device, self.accumulate, self.checkpoint, self.options = device, accumulate, checkpoint, options
        self.pace = MicroBatchPace(max_micro_batches)
        """How long a micro-batch takes here, and how many the last round trained on how many samples."""
        self._spanning: torch.nn.Module | None = None
        """The copy of the model a micro-batch across rounds trains on (`span_begin`); None until the first."""
        self._span_rows = 0

    @classmethod
    def for_run(cls, cfg: Config, *, data_seed: int, device: torch.device, accumulate: int = 1,
                checkpoint: Path | None = None) -> Trainer:
        """The run's task (`demonet.train.task.build_task`: the built-in GPT unless `[train] task`), its
        model seeded like every other peer's, on this peer's stream of batches."""
        task = build_task(cfg)
        model = task.model.to(device)
        opt = DeMo.from_settings(model.named_parameters(), cfg.optim)
        return cls(model, opt, task.batches(data_seed), task.loss, device=device, accumulate=accumulate,
                   checkpoint=checkpoint, options=StepOptions.for_run(cfg), max_micro_batches=cfg.net.max_micro_batches)

    # -- parameters ----------------------------------------------------------------------------------

    def expected(self) -> Expected:
        return {name: (tuple(p.shape), p.dtype) for name, p in self.model.named_parameters()}

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, p.detach()) for name, p in self.model.named_parameters()]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def digest(self) -> str:
        return param_digest(self.model.named_parameters())

    def canonical_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters the open round started from: those a held lookahead replaced, else the live ones."""
        held = self.opt.held_parameters()
        return self.named_parameters() if held is None else list(held.items())

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Set the parameters (e.g. downloaded ones, already checked against `expected`); a held lookahead
        is dropped first (its base-optimizer state undone)."""
        self.opt.undo_lookahead()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(tensors[name])

    # -- a round -------------------------------------------------------------------------------------

    def forward_backward(self, until: float | None = None) -> float:
        """Forward and backward over the round's micro-batches (under autocast for bf16), adding their mean
        gradient to the gradients. Returns the mean loss.

        Without a cut-off: `accumulate` micro-batches. With `until` (a `time.perf_counter()` time): as many as
        are predicted to end by then (`MicroBatchPace`), at least one, at most its `max_micro_batches`.
        `samples` then says how many samples the round's gradient is the mean of."""
        if until is None:
            total, rows = 0.0, 0
            for _ in range(self.accumulate):
                loss, n = self._micro_batch(self.model, self.accumulate)
                total, rows = total + loss, rows + n
            self.pace.trained(self.accumulate, rows)
            return total / self.accumulate
        losses: list[float] = []
        rows = 0
        while not losses or self.pace.another(until):
            t0 = time.perf_counter()
            loss, n = self._micro_batch(self.model)
            losses.append(loss)
            rows += n
            self.pace.took(time.perf_counter() - t0)
        if len(losses) > 1:  # the sum of the micro-batches' gradients, to their mean
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, 1.0 / len(losses))
        self.pace.trained(len(losses), rows)
        return sum(losses) / len(losses)

    # -- a micro-batch across rounds (`demonet.loop.spanning`) -------------------------------------------

    def span_begin(self) -> None:
        """Copy the parameters into the spanning copy of the model (made at the first call, a second copy of the
        parameters): `span_micro_batch` takes its gradient there while the rounds apply their aggregates here."""
        if self._spanning is None:
            self._spanning = copy.deepcopy(self.model)
        with torch.no_grad():
            for p, q in zip(self.model.parameters(), self._spanning.parameters(), strict=True):
                q.copy_(p)
                q.grad = None

    def span_micro_batch(self) -> tuple[float, float]:
        """One micro-batch's forward and backward on the spanning copy (in a worker thread, beside the rounds);
        returns its loss and seconds."""
        assert self._spanning is not None, "span_begin first"
        t0 = time.perf_counter()
        loss, self._span_rows = self._micro_batch(self._spanning)
        train_s = time.perf_counter() - t0
        self.pace.took(train_s)
        return loss, train_s

    def span_take(self) -> None:
        """Add the spanning copy's gradient to the replica's (the round's compress folds it into the momentum)."""
        assert self._spanning is not None, "span_begin first"
        for p, q in zip(self.model.parameters(), self._spanning.parameters(), strict=True):
            if q.grad is not None:
                p.grad = q.grad if p.grad is None else p.grad.add_(q.grad)
                q.grad = None
        self.pace.trained(1, self._span_rows)

    def span_rows(self) -> int:
        """The samples of a micro-batch: the last one across rounds, else the last round's (at least 1)."""
        return max(1, self._span_rows or self.pace.samples // max(1, self.pace.micro_batches))

    def _micro_batch(self, model: torch.nn.Module, divide: int | None = None) -> tuple[float, int]:
        """The next batch's forward (under autocast for bf16) and backward on `model`, its loss divided by `divide`
        where given (an accumulated round's mean); returns the loss and the batch's samples."""
        batch = to_device(next(self.batches), self.device)
        with autocast(self.device, self.options.precision):
            loss = self.loss(model, batch)
        (loss if divide is None else loss / divide).backward()  # type: ignore[no-untyped-call]
        return float(loss.detach()), batch_rows(batch)

    def samples(self) -> int:
        """How many samples the last `forward_backward`'s gradient is the mean of (the merge's weight)."""
        return self.pace.samples

    def micro_batches(self) -> int:
        """How many micro-batches the last `forward_backward` trained."""
        return self.pace.micro_batches

    def restore(self, payload: Payload) -> None:
        """The payload reached no aggregate: give it back to the momentum (and undo a held lookahead)."""
        self.opt.restore(payload)

    def settle(self, payload: Payload | None, result: Settled, contributed: bool) -> None:
        settle(self.opt, payload, result, contributed, lr=self.options.lr_at(result.round))

    # -- checkpoints ---------------------------------------------------------------------------------

    def save(self, meta: dict[str, Any]) -> None:
        """Model, momentum, data stream and `meta` (peer, round, ...); atomic: a temp file, then a rename."""
        if self.checkpoint is None:
            return
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        state_dict = getattr(self.batches, "state_dict", None)
        tmp = self.checkpoint.with_suffix(self.checkpoint.suffix + ".tmp")
        with self.opt.momentum_before_compress():  # an overlapped peer's next payload is not this round's
            torch.save({**meta, "model": self.model.state_dict(), "optim": self.opt.state_dict(),
                        "data": state_dict() if state_dict is not None else None}, tmp)
        os.replace(tmp, self.checkpoint)

    def saved(self) -> dict[str, Any] | None:
        """The checkpoint's `meta`, None without one."""
        if self.checkpoint is None or not self.checkpoint.exists():
            return None
        body = torch.load(self.checkpoint, map_location="cpu", weights_only=True)
        return {k: v for k, v in body.items() if k not in ("model", "optim", "data")}

    def resume(self, *, momentum: bool) -> None:
        """Continue the data stream where the checkpoint left it, and take its momentum if `momentum`."""
        assert self.checkpoint is not None
        body = torch.load(self.checkpoint, map_location=self.device, weights_only=True)
        load_state_dict = getattr(self.batches, "load_state_dict", None)
        if load_state_dict is not None and body.get("data") is not None:
            with contextlib.suppress(ValueError):  # another data seed: keep the fresh stream
                load_state_dict(body["data"])
        if momentum:
            self.opt.load_state_dict(body["optim"])
