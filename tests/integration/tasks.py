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


SLEEP_ENV = "DEMONET_TEST_SLEEP_S"
"""The seconds a `sleepy` task's loss sleeps per micro-batch, in the process that sets it."""


def sleepy(**table: Any) -> demonet.Task:
    """The example's network, whose loss sleeps `SLEEP_ENV` seconds per micro-batch in a process that sets it:
    a slower accelerator, for the mixed-speed tests (the model and the data are the example's)."""
    import os
    import time

    t = task(**table)
    sleep_s = float(os.environ.get(SLEEP_ENV, "0"))

    def loss(model: Any, batch: Any) -> Any:
        if sleep_s:
            time.sleep(sleep_s)
        return t.loss(model, batch)

    return demonet.Task(model=t.model, batches=t.batches, loss=loss)
