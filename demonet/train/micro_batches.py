"""A peer's micro-batches: how many samples a batch holds, and how long its micro-batches take (whether another fits
before a round's cut-off). Pure logic and a clock; the `Trainer` (demonet.train.trainer) uses both.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["MicroBatchPace", "batch_rows"]


def batch_rows(batch: Any) -> int:
    """The samples in a batch: the rows of its first tensor (a tensor, or a tuple, list or dict of them); 1
    where it holds none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, list | tuple) else ()
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim():
            return int(item.shape[0])
    return 1


class MicroBatchPace:
    """How long this peer's micro-batches take (an average of the recent ones), whether another fits before a
    cut-off, and what the last round trained.

    Args:
        max_micro_batches: the most micro-batches of one round.
    """

    def __init__(self, max_micro_batches: int) -> None:
        self.max_micro_batches = max_micro_batches
        self.micro_s: float | None = None
        """The recent micro-batches' mean time (an exponential average; None before the first)."""
        self.count = 0
        """Micro-batches trained in the round so far."""
        self.micro_batches = 0
        """Micro-batches the last round trained."""
        self.samples = 0
        """Samples the last round trained."""

    def took(self, seconds: float) -> None:
        """One micro-batch of the round is done, in `seconds`."""
        self.count += 1
        self.micro_s = seconds if self.micro_s is None else 0.7 * self.micro_s + 0.3 * seconds

    def another(self, until: float) -> bool:
        """Whether one more micro-batch fits before `until` (a `time.perf_counter()` time)."""
        if self.count >= self.max_micro_batches:
            return False
        return time.perf_counter() + (self.micro_s or 0.0) <= until

    def trained(self, micro_batches: int, samples: int) -> None:
        """The round's training is done."""
        self.micro_batches, self.samples, self.count = micro_batches, max(1, samples), 0
