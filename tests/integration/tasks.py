"""Tasks the task tests import by name (`tests.integration.tasks:FUNCTION`)."""

from __future__ import annotations

from typing import Any

import demonet
from examples.custom_task import task


def five_classes(**table: Any) -> demonet.Task:
    """The example's network with a fifth class: its last layer's shapes differ from the run's."""
    return task(**{**table, "classes": 5})


def broken(**table: Any) -> demonet.Task:
    raise RuntimeError("no data here")


def no_parameters(**table: Any) -> demonet.Task:
    t = task(**table)
    return demonet.Task(model=demonet_identity(), batches=t.batches, loss=t.loss)


def demonet_identity() -> Any:
    import torch

    return torch.nn.Identity()


def not_a_task(**table: Any) -> object:
    return {"model": None}
