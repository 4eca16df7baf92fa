"""One peer's replica: its model, DeMo, data stream and loss; one training step, a round's outcome, checkpoints.

Torch work only, called from `demonet.train.loop.RoundLoop` in a worker thread. Imports the math layer,
the wire digest and the transport's dataclasses; no network code.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from demonet.config import Config
from demonet.optim import DeMo, Payload
from demonet.transport import Expected, RoundResult
from demonet.wire.digest import param_digest

from .data import Batches, load_corpus, split
from .model import GPT
from .tokens import TokenBatches, TokenFile

__all__ = ["Trainer", "settle", "to_device"]

Loss = Callable[[torch.nn.Module, Any], torch.Tensor]


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it (alone, or in tuples, lists or dicts) moved to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def settle(opt: DeMo, payload: Payload, result: RoundResult, contributed: bool,
           local: Callable[[Payload], Payload] = lambda p: p) -> None:
    """Apply a round's outcome to an optimizer.

    The aggregate may hold only the largest merged coefficients, so a contributor restores the
    entries of its payload that the aggregate dropped; a peer whose payload missed the round
    restores all of it; an aborted round restores the payload and applies nothing. `local` maps a
    whole-parameter payload to the optimizer's own rows (a FlexDeMo rank's shard).
    """
    if result.aggregate is None:
        opt.restore(payload)
        return
    aggregate = local(result.aggregate)
    kept = local(result.kept) if result.kept is not None else aggregate
    opt.restore(payload, kept=kept if contributed else None)
    opt.apply(aggregate)


def _gpt_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    _, loss = model(*batch)
    assert loss is not None
    return loss  # type: ignore[no-any-return]


def _token_batches(cfg: Config, data_seed: int) -> TokenBatches:
    """This peer's stream over the train part of the run's token file, once the model's vocab covers the file's."""
    tokens = TokenFile.open(cfg.train.tokens)
    tokens.check_vocab(cfg.model.vocab_size)
    return TokenBatches(tokens.split()[0], batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=data_seed)


class Trainer:
    """A single-process replica.

    Args:
        model: the replica; its parameters are what the run synchronizes.
        opt: DeMo over `model.named_parameters()`.
        batches: this peer's endless stream of batches; a `state_dict`/`load_state_dict` pair, if it
            has one, goes into the checkpoint so a restart does not see its batches again.
        loss: (model, batch) -> scalar loss tensor.
        device: where the batches go.
        accumulate: micro-batches per round (gradient accumulation).
        checkpoint: the checkpoint file; None: no checkpoints.
    """

    def __init__(self, model: torch.nn.Module, opt: DeMo, batches: Iterator[Any], loss: Loss, *,
                 device: torch.device, accumulate: int = 1, checkpoint: Path | None = None) -> None:
        if accumulate < 1:
            raise ValueError(f"accumulate should be >= 1, got {accumulate}")
        self.model, self.opt, self.batches, self.loss = model, opt, batches, loss
        self.device, self.accumulate, self.checkpoint = device, accumulate, checkpoint

    @classmethod
    def for_run(cls, cfg: Config, *, data_seed: int, device: torch.device, accumulate: int = 1,
                checkpoint: Path | None = None) -> Trainer:
        """The built-in GPT on the run's token file or corpus bytes, seeded like every other peer's.

        Raises:
            ValueError: the token file is not one, or its vocab is larger than the model's.
        """
        torch.manual_seed(cfg.train.seed)  # the same initial weights as every peer (downloads replace them)
        model = GPT(cfg.model).to(device)
        opt = DeMo.from_settings(model.named_parameters(), cfg.optim)
        if cfg.train.tokens:
            batches: Iterator[tuple[torch.Tensor, torch.Tensor]] = _token_batches(cfg, data_seed)
        else:
            train_data, _ = split(load_corpus(cfg.train.corpus or None))
            batches = Batches(train_data, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=data_seed)
        return cls(model, opt, batches, _gpt_loss, device=device, accumulate=accumulate, checkpoint=checkpoint)

    # -- parameters ----------------------------------------------------------------------------------

    def expected(self) -> Expected:
        return {name: (tuple(p.shape), p.dtype) for name, p in self.model.named_parameters()}

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, p.detach()) for name, p in self.model.named_parameters()]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def digest(self) -> str:
        return param_digest(self.model.named_parameters())

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Set the parameters (e.g. downloaded ones, already checked against `expected`)."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(tensors[name])

    # -- a round -------------------------------------------------------------------------------------

    def train_step(self) -> tuple[float, Payload]:
        """Forward and backward over `accumulate` micro-batches, then compress. Returns (mean loss, payload)."""
        total = 0.0
        for _ in range(self.accumulate):
            loss = self.loss(self.model, to_device(next(self.batches), self.device))
            (loss / self.accumulate).backward()
            total += float(loss.detach())
        payload = self.opt.compress()
        self.opt.zero_grad(set_to_none=True)
        return total / self.accumulate, payload

    def restore(self, payload: Payload) -> None:
        """The payload reached no aggregate: give it back to the momentum."""
        self.opt.restore(payload)

    def settle(self, payload: Payload, result: RoundResult, contributed: bool) -> None:
        settle(self.opt, payload, result, contributed)

    # -- checkpoints ---------------------------------------------------------------------------------

    def save(self, meta: dict[str, Any]) -> None:
        """Model, momentum, data stream and `meta` (peer, round, ...); atomic: a temp file, then a rename."""
        if self.checkpoint is None:
            return
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        state_dict = getattr(self.batches, "state_dict", None)
        body = {**meta, "model": self.model.state_dict(), "optim": self.opt.state_dict(),
                "data": state_dict() if state_dict is not None else None}
        tmp = self.checkpoint.with_suffix(self.checkpoint.suffix + ".tmp")
        torch.save(body, tmp)
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
