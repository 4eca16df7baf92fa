"""Leaf helpers of the coordinator's gRPC adapter: a request that did not parse, and the parts of a Submit
stream read until its deadline.

Imports asyncio only; imported by the method table, the servicer and its Submit reader, never importing them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Malformed", "StreamEnd", "parts_until"]


@dataclass(frozen=True)
class Malformed:
    """A request whose bytes are not the message its RPC takes; the RPC refuses it with INVALID_ARGUMENT."""

    message: str
    error: str

    def __str__(self) -> str:
        return f"the request is not a valid {self.message} message ({self.error})"


class StreamEnd:
    """When one Submit stream ends at the latest (event-loop time); `end_now` when its round closes."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.waiting: asyncio.Timeout | None = None  # the wait for the stream's next part

    def end_now(self) -> None:
        self.at = asyncio.get_running_loop().time()
        if self.waiting is not None:
            self.waiting.reschedule(self.at)


async def parts_until(parts: AsyncIterator[Any], ends: StreamEnd) -> AsyncIterator[Any]:
    """The parts of a Submit stream until `ends`: then TimeoutError, and the stream (and its bytes) let go.
    Each wait is bounded on its own, so that nothing but the wait for a part is ever interrupted."""
    iterator = aiter(parts)
    while True:
        try:
            async with asyncio.timeout_at(ends.at) as ends.waiting:
                part = await anext(iterator)
        except StopAsyncIteration:
            return
        finally:
            ends.waiting = None
        yield part
