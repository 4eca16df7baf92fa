"""Retries of the calls to the coordinator: which gRPC failures are tried again, with what backoff, and
the waits a rate-limited call is told to make (`call`, which `GrpcClient` runs every call through).

Net layer: imports grpc and tenacity; never the wire layer, the model or the training loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NoReturn, TypeVar

import grpc
import grpc.aio
import tenacity

from demonet.errors import PeerUnavailable

__all__ = ["AUTH_CODES", "BACKOFF_CAP_S", "BACKOFF_FIRST_S", "RETRY_CODES", "CallRefused", "call"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

RETRY_CODES = (
    grpc.StatusCode.UNAVAILABLE,  # not listening (yet, or restarting), connection lost
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,  # a coordinator that stops with a grace period cancels the calls still open
)
AUTH_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class CallRefused(PermissionError):
    """The coordinator refused the call for who makes it (a token or a signature): `code` says which."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


BACKOFF_FIRST_S = 0.2
"""The first wait before a call is tried again; each next one doubles, up to BACKOFF_CAP_S."""
BACKOFF_CAP_S = 5.0


def _retry_after_s(e: grpc.aio.AioRpcError) -> float | None:
    """The wait a RESOURCE_EXHAUSTED refusal advertises ("retry-after-s"), or None if it names none."""
    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in e.trailing_metadata() or ():
        if key == "retry-after-s":
            with contextlib.suppress(ValueError):
                return max(0.0, float(value))
    return None


def _transient(e: BaseException) -> bool:
    """A failure `call` tries again: the coordinator is unreachable for now, or a stream's write failed as
    its call ended (`_failed_write`)."""
    return isinstance(e, grpc.aio.AioRpcError) and (e.code() in RETRY_CODES or _failed_write(e))


def _failed_write(e: grpc.aio.AioRpcError) -> bool:
    """A client stream's message that gRPC's core could not send because the call had ended (the
    coordinator killed or restarting mid-Submit): grpc.aio reports that as INTERNAL "Internal error from
    Core", with `Failed "execute_batch"` and the send operation in its debug string, in place of the
    call's own status (grpc/grpc#36066). That status is lost, so the call is tried again as the
    UNAVAILABLE it stands for when the connection died; a refusal hidden this way (a bad signature that
    aborted the stream) costs the tries until `reconnect_timeout_s`, then `PeerUnavailable`."""
    if e.code() != grpc.StatusCode.INTERNAL:
        return False
    debug = e.debug_error_string() or ""
    return "execute_batch" in debug and "SendMessageOperation" in debug


def _rpc_error(state: tenacity.RetryCallState) -> grpc.aio.AioRpcError:
    """The error a retried attempt failed with (only `_transient` ones are retried)."""
    assert state.outcome is not None
    e = state.outcome.exception()
    assert isinstance(e, grpc.aio.AioRpcError)
    return e


async def call(what: str, attempt: Callable[[], Awaitable[_T]], *, channel: grpc.aio.Channel, address: str,
               peer_id: str, reconnect_timeout_s: float) -> _T:
    """Run `attempt` (a call over `channel` to the coordinator at `address`) until it succeeds, retrying
    while the coordinator is unreachable.

    A failure with one of `RETRY_CODES` is tried again after a capped exponential backoff, until
    `reconnect_timeout_s` has passed since the first failure: then `PeerUnavailable`. A refused token
    raises PermissionError at once. A call over its rate (RESOURCE_EXHAUSTED with "retry-after-s") is
    tried again after the advertised wait while the waits stay within `reconnect_timeout_s` in all, then
    `PeerUnavailable`; any other error propagates. `what` and `peer_id` name the call in logs and errors.
    """
    waited_s = 0.0
    while True:
        try:
            return await _call_once(what, attempt, channel, address, peer_id, reconnect_timeout_s)
        except grpc.aio.AioRpcError as e:
            wait_s = _retry_after_s(e)
            if wait_s is None:
                raise
            if waited_s + wait_s > reconnect_timeout_s:
                raise PeerUnavailable(f"{what}: the coordinator at {address} limits this peer's calls "
                                      f"({e.details()}); waited {waited_s:.0f} s already") from None
            logger.warning("[%s] %s: %s; waiting %.1f s", peer_id or "-", what, e.details(), wait_s)
            waited_s += wait_s
            await asyncio.sleep(wait_s)


async def _call_once(what: str, attempt: Callable[[], Awaitable[_T]], channel: grpc.aio.Channel, address: str,
                     peer_id: str, reconnect_timeout_s: float) -> _T:
    """`call` without the waits of a call over its rate."""
    give_up_at: list[float] = []  # set at the first failure: the outage is timed from there, not from the call

    def failed(state: tenacity.RetryCallState) -> None:
        if not give_up_at:
            give_up_at.append(time.monotonic() + reconnect_timeout_s)
            e = _rpc_error(state)
            logger.warning("[%s] %s: %s (%s); retrying for up to %.0f s", peer_id or "-", what,
                           e.code().name, e.details(), reconnect_timeout_s)

    def unavailable(state: tenacity.RetryCallState) -> NoReturn:
        e = _rpc_error(state)
        raise PeerUnavailable(f"{what}: the coordinator at {address} was unreachable for "
                              f"{reconnect_timeout_s:.0f} s (last: {e.code().name} {e.details()})")

    async def back_off(delay_s: float) -> None:
        # Wake as soon as the channel reconnects: a restarted coordinator gives its members only a
        # round's grace to come back, so a long sleep could miss it.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay_s):
                await channel.channel_ready()

    backoff = tenacity.wait_exponential(multiplier=BACKOFF_FIRST_S, max=BACKOFF_CAP_S)  # 0.2, 0.4, ... 5 s
    retrying = tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception(_transient), after=failed,
        stop=lambda _: time.monotonic() >= give_up_at[0],
        wait=lambda state: max(0.0, min(backoff(state), give_up_at[0] - time.monotonic())),
        sleep=back_off, retry_error_callback=unavailable)
    try:
        async for tried in retrying:
            with tried:
                result = await attempt()
    except grpc.aio.AioRpcError as e:
        if e.code() in AUTH_CODES:
            raise CallRefused(f"{what}: the coordinator at {address} refused the call "
                              f"({e.code().name}: {e.details()})", e.code()) from None
        raise
    if give_up_at:
        logger.info("[%s] %s: the coordinator answers again", peer_id or "-", what)
    return result
