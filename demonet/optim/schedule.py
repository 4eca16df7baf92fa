"""The learning rate of a round: linear warmup, then constant or a cosine decay to a floor.

Math layer: imports torch (for `as_opmath`) and decimal only. Every peer and the coordinator apply
round r's aggregate with `LrSchedule(...)(r)`, so that value must be the same bits on every machine:
it is computed in Python's decimal arithmetic (fully specified: no libm, no FMA) from integers and the
configured floats, with the cosine as a Taylor series (`demonet.optim.dct`), then rounded once to
float32, the precision DeMo's apply multiplies in (`demonet.optim.exact.as_opmath`).
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal, localcontext
from typing import Any

import torch

from .dct import _PI, _cos
from .exact import as_opmath

__all__ = ["SCHEDULES", "LrSchedule", "check_schedule"]

SCHEDULES = ("constant", "cosine")
"""After the warmup: ``constant`` keeps lr; ``cosine`` decays from lr to lr_min, then stays there."""

_DIGITS = 60  # decimal digits of the intermediate values (the cosine series runs to 1e-55); float32 keeps 7


def check_schedule(lr: float, warmup_rounds: int, schedule: str, lr_min: float, decay_rounds: int) -> None:
    """The schedule settings a run's config and `LrSchedule` accept.

    Raises:
        ValueError: the first setting out of range, named in the message.
    """
    checks = [
        (isinstance(warmup_rounds, int) and warmup_rounds >= 0,
         f"warmup_rounds should be an int >= 0, got {warmup_rounds!r}"),
        (schedule in SCHEDULES, f"schedule should be one of {SCHEDULES}, got {schedule!r}"),
        (0.0 <= lr_min <= lr, f"lr_min should be in [0, lr] = [0, {lr}], got {lr_min}"),
        (isinstance(decay_rounds, int) and decay_rounds >= 0,
         f"decay_rounds should be an int >= 0, got {decay_rounds!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


@dataclass(frozen=True, kw_only=True)
class LrSchedule:
    """lr(r) for round r >= 0, a pure function of r (call the schedule: ``schedule(r)``).

    - rounds 0 .. warmup_rounds - 1: ``lr * (r + 1) / warmup_rounds`` (lr / warmup_rounds first, lr last);
    - then ``constant``: lr;
    - or ``cosine``: ``lr_min + (lr - lr_min) * (1 + cos(pi * k / decay_rounds)) / 2`` with
      k = r - warmup_rounds, from lr at k = 0 to lr_min at k = decay_rounds, and lr_min after.

    Every value is a float32 number (as a Python float): the same bits on every machine.

    Attributes:
        lr: the peak learning rate, > 0.
        warmup_rounds: rounds of linear warmup; 0: none.
        schedule: one of `SCHEDULES`.
        lr_min: the cosine's floor, in [0, lr].
        decay_rounds: the cosine's length in rounds, >= 1.
    """

    lr: float
    warmup_rounds: int = 0
    schedule: str = "constant"
    lr_min: float = 0.0
    decay_rounds: int = 1

    def __post_init__(self) -> None:
        if not self.lr > 0.0:
            raise ValueError(f"lr should be > 0, got {self.lr}")
        check_schedule(self.lr, self.warmup_rounds, self.schedule, self.lr_min, self.decay_rounds)
        if self.decay_rounds < 1:
            raise ValueError(f"decay_rounds should be >= 1, got {self.decay_rounds}")

    @classmethod
    def from_settings(cls, settings: Any, total_rounds: int) -> LrSchedule:
        """The schedule of a run's `[optim]` settings (e.g. `demonet.config.OptimConfig`): its
        ``decay_rounds`` of 0 means the rest of the run, ``total_rounds - warmup_rounds`` (at least 1)."""
        decay = settings.decay_rounds or max(total_rounds - settings.warmup_rounds, 1)
        return cls(lr=settings.lr, warmup_rounds=settings.warmup_rounds, schedule=settings.schedule,
                   lr_min=settings.lr_min, decay_rounds=decay)

    def __call__(self, round: int) -> float:
        if round < 0:
            raise ValueError(f"round should be >= 0, got {round}")
        return _lr_at(self, round)


def _lr_at(s: LrSchedule, round: int) -> float:
    with localcontext() as ctx:
        ctx.prec = _DIGITS
        ctx.rounding = ROUND_HALF_EVEN
        lr = Decimal(s.lr)  # the float's exact value
        if round < s.warmup_rounds:
            value = lr * (round + 1) / s.warmup_rounds
        elif s.schedule == "constant":
            value = lr
        else:
            k = min(round - s.warmup_rounds, s.decay_rounds)
            value = Decimal(s.lr_min) + (lr - Decimal(s.lr_min)) * (1 + _cos_pi(k, s.decay_rounds)) / 2
        # Decimal -> float goes through its decimal string (correctly rounded), then once to float32.
        return as_opmath(float(value), torch.float32)


def _cos_pi(k: int, n: int) -> Decimal:
    """cos(pi * k / n) for 0 <= k <= n, folded onto [0, pi/2] where the Taylor series is evaluated."""
    if 2 * k <= n:
        return _cos(_PI * k / n)
    return -_cos(_PI * (n - k) / n)
