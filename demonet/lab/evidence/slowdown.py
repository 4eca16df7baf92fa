"""A slower peer for `demonet bench`'s mixed swarms: its forward and backward take `factor` times as long.

A bench module: imports torch and the built-in GPT and data. A demonet peer gets it as its run's task
(`[train] task = "demonet.lab.evidence.slowdown:gpt"`), its factor from ``DEMONET_BENCH_SLOWDOWN``; the
baselines' workers call `slow_down` on their model.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from demonet.train.data import Batches, load_corpus, split
from demonet.train.model import GPT, ModelConfig
from demonet.train.task import Task, gpt_loss

__all__ = ["ENV", "TASK", "gpt", "slow_down"]

ENV = "DEMONET_BENCH_SLOWDOWN"
"""The environment variable that holds a demonet peer's slowdown (unset: 1, no slowdown)."""
TASK = "demonet.lab.evidence.slowdown:gpt"
"""`gpt` as a run config names it."""


def slow_down(model: torch.nn.Module, factor: float) -> None:
    """Make each forward and backward through `model` take `factor` times as long.

    Once a backward has computed every parameter's gradient, it sleeps (factor - 1) x the time since the
    forward began: a peer on a slower accelerator, whatever its load, micro-batch by micro-batch.

    Raises:
        ValueError: `factor` is below 1 (a sleep cannot make a peer faster).
    """
    if not factor >= 1:
        raise ValueError(f"a slowdown should be >= 1, got {factor}")
    if factor == 1:
        return
    started = [time.perf_counter()]

    def forward_begins(module: torch.nn.Module, args: Any) -> None:
        started[0] = time.perf_counter()

    def backward_done(grads: Any) -> None:
        time.sleep((factor - 1) * (time.perf_counter() - started[0]))

    model.register_forward_pre_hook(forward_begins)
    params = [p for p in model.parameters() if p.requires_grad]
    torch.autograd.graph.register_multi_grad_hook(params, backward_done, mode="all")


def gpt(*, batch_size: int, batch_seq_len: int, **model: Any) -> Task:
    """The built-in byte-level GPT on the embedded corpus (`model`: `ModelConfig`'s fields; batches of
    `batch_size` x `batch_seq_len` bytes), slowed by the factor in ``DEMONET_BENCH_SLOWDOWN`` of the process
    that builds it (the coordinator: none)."""
    net = GPT(ModelConfig(**model))
    slow_down(net, float(os.environ.get(ENV, "1")))

    def batches(seed: int) -> Iterator[Any]:
        train_data, _ = split(load_corpus())
        return Batches(train_data, batch_size=batch_size, seq_len=batch_seq_len, seed=seed)

    return Task(net, batches, gpt_loss)
