"""A peer process's start and stop: torch's one-time costs paid before joining, and SIGTERM and SIGINT
turned into an event the round loop watches. Imports torch and asyncio only.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

import torch

__all__ = ["stop_on_signals", "warm_up"]


def warm_up() -> None:
    """Pay torch's one-time costs before joining: the first backward takes about a second, and a peer
    admitted at once must train within the round timeout. (DeMo does not import torch._dynamo, as
    torch's own optimizers do at their construction: `demonet.optim.demo`.)"""
    p = torch.zeros(2, requires_grad=True)
    torch.autograd.backward((p * 2).sum())


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set `stop` while inside."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
