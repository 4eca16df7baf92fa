"""What a run trains: a model, each peer's batches and a loss (`demonet.Task`), built-in or a user's.

A user's task is `MODULE:FUNCTION` (`[train] task`, `--task`): ``FUNCTION(**table)`` returns a `Task`,
where `table` is the run config's `[task]` table. The built-in task is the byte-level GPT on the
run's corpus. Training layer: imports torch, the model and the data; no network code.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .data import Batches, load_corpus, split
from .model import GPT
from .token_data import open_tokens

__all__ = ["Task", "build_task", "first_difference", "gpt_loss", "param_specs", "pin_tokenizer"]

Specs = list[tuple[str, tuple[int, ...], str]]
"""A model's parameters as (name, shape, dtype name), in `named_parameters` order."""


@dataclass
class Task:
    """A model, each peer's batches and a loss.

    Attributes:
        model: the module whose parameters the run synchronizes (buffers are each peer's own).
        batches: ``batches(seed)`` returns an endless iterator of one peer's batches; demonet gives
            every peer its own seed (from the run seed and the peer id) and moves the tensors in a
            batch (alone, or in tuples, lists or dicts) to the peer's device.
        loss: ``loss(model, batch)`` returns a scalar tensor.
    """

    model: torch.nn.Module
    batches: Callable[[int], Iterator[Any]]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]


def gpt_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The built-in GPT's next-byte cross-entropy."""
    _, loss = model(*batch)
    assert loss is not None
    return loss  # type: ignore[no-any-return]


def _builtin(cfg: Any) -> Task:
    """The byte-level GPT on the run's token file (`[train] tokens`: a path or URL) or corpus bytes.

    Raises:
        ValueError: the token file is not one, its vocab is larger than the model's, or it was made with
            another tokenizer than `[train] tokenizer`.
    """
    if cfg.train.tokens:
        tokens = open_tokens(cfg.train.tokens, pin=cfg.train.tokens_pin or None)
        tokens.check_vocab(cfg.model.vocab_size)
        tokens.check_tokenizer(cfg.train.tokenizer)

    def batches(seed: int) -> Iterator[Any]:
        if cfg.train.tokens:
            return tokens.batches(batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=seed)
        train_data, _ = split(load_corpus(cfg.train.corpus or None))
        return Batches(train_data, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=seed)

    return Task(GPT(cfg.model), batches, gpt_loss)


def _load(spec: str) -> Callable[..., Any]:
    module_name, _, function_name = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # the user's own modules, where the command runs
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"task {spec}: cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"task {spec}: {module_name} has no function {function_name!r}")
    return function  # type: ignore[no-any-return]


def pin_tokenizer(cfg: Any) -> Any:
    """`cfg` with `[train] tokenizer` set from its token file's header, and `[train] tokens_pin` from its
    sidecar (where it has one), when it has `[train] tokens` and they are not set yet: a coordinator hands this
    to its peers, whose token files must then match it (the same file, wherever each peer reads it from).

    Raises:
        ValueError: the token file cannot be read (as `build_task` would), or has another pin than a set one.
    """
    if not cfg.train.tokens or (cfg.train.tokenizer and cfg.train.tokens_pin):
        return cfg
    tokens = open_tokens(cfg.train.tokens, pin=cfg.train.tokens_pin or None)
    tokenizer, pin = cfg.train.tokenizer or tokens.header.tokenizer, tokens.pin or ""
    if (tokenizer, pin) == (cfg.train.tokenizer, cfg.train.tokens_pin):
        return cfg  # a file without a sidecar has no pin: nothing more to set
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, tokenizer=tokenizer, tokens_pin=pin))


def build_task(cfg: Any) -> Task:
    """The run's task (`cfg.train.task`, called with `cfg.task`), its model seeded with the run seed.

    Every peer and the coordinator build it the same way, so a run starts from the same parameters
    everywhere. The coordinator uses only the model.

    Raises:
        ValueError: the task cannot be imported, its function fails or returns no `Task`, or the
            model has no parameters.
    """
    torch.manual_seed(cfg.train.seed)
    spec = cfg.train.task
    if not spec:
        return _builtin(cfg)
    function = _load(spec)
    try:
        task = function(**cfg.task)
    except Exception as e:
        raise ValueError(f"task {spec}({', '.join(f'{k}={v!r}' for k, v in cfg.task.items())}) failed: "
                         f"{type(e).__name__}: {e}") from e
    if not isinstance(task, Task):
        raise ValueError(f"task {spec} returned a {type(task).__name__}, not a demonet.Task")
    if not isinstance(task.model, torch.nn.Module):
        raise ValueError(f"task {spec}: model should be a torch.nn.Module, got {type(task.model).__name__}")
    if not any(p.requires_grad for p in task.model.parameters()):
        raise ValueError(f"task {spec}: the model has no trainable parameters")
    if not callable(task.batches) or not callable(task.loss):
        raise ValueError(f"task {spec}: batches and loss should be callables")
    return task


def param_specs(named: Mapping[str, torch.Tensor] | Any) -> Specs:
    """(name, shape, dtype) of named tensors, e.g. `model.named_parameters()` or a state's params."""
    items = named.items() if isinstance(named, Mapping) else named
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in items]


def first_difference(mine: Specs, run: Specs) -> str | None:
    """The first way `mine` differs from the run's parameters (a message), or None."""
    theirs = {name: (shape, dtype) for name, shape, dtype in run}
    ours = {name: (shape, dtype) for name, shape, dtype in mine}
    for name, shape, dtype in run:
        if name not in ours:
            return f"the run has parameter {name!r} {list(shape)} {dtype}; this model has none of that name"
        if ours[name] != (shape, dtype):
            return (f"parameter {name!r} is {list(ours[name][0])} {ours[name][1]} here, "
                    f"{list(shape)} {dtype} in the run")
    for name, shape, dtype in mine:
        if name not in theirs:
            return f"this model has parameter {name!r} {list(shape)} {dtype}, which the run does not"
    if [n for n, _, _ in mine] != [n for n, _, _ in run]:
        return "the parameters are the run's but in another order"
    return None
