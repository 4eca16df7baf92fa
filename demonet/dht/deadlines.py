"""DHT time (`now`), the clock every peer's deadlines use, and `retry` of a call until such a deadline.

Net layer: imports hivemind's clock; must not import grpc, demonet.transport.grpc or any other
demonet.dht module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.utils import get_dht_time

from demonet.errors import InvalidPayload, PeerUnavailable

__all__ = ["NoAnswer", "now", "retry"]


def now() -> float:
    """DHT time: the clock every peer's deadlines use."""
    return float(get_dht_time())


class NoAnswer(PeerUnavailable):
    """A call that timed out: the peer is silent (cut off, or stalled), not gone (its stream did not break)."""


async def retry(attempt: Callable[[float], Awaitable[Any]], deadline: float) -> PeerUnavailable | InvalidPayload | None:
    """Run `attempt(timeout_s)` until it succeeds or `deadline` (DHT time) passes; returns the last
    error (None on success). A stream can break while both peers are fine, so one failure is not final."""
    delay_s = 0.05
    while True:
        try:
            await attempt(max(0.1, deadline - now()))
            return None
        except (PeerUnavailable, InvalidPayload) as e:
            error = e
        if now() + delay_s >= deadline:
            return error
        await asyncio.sleep(delay_s)
        delay_s = min(2 * delay_s, 0.5)
