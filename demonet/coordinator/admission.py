"""Who may call the coordinator: the run token, peer ids, keys and signatures, and the rate limits, as the gRPC
servicer checks them before any call reaches the round core.

Imports grpc (it aborts calls) and the coordinator's identities and limits; never the servicer or the core,
which own an `Admission` and pass it what it needs.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from demonet.errors import NotJoined, Refused

from .identities import Identities, Replayed, read_allowlist
from .limits import Limits, RateLimits
from .metrics import Metrics
from .parts import Malformed

__all__ = ["Admission", "caller_address"]

logger = logging.getLogger(__name__)

_PEER_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")

Context = grpc.aio.ServicerContext[Any, Any]


def _now() -> float:
    return time.monotonic()


def caller_address(context: Context) -> str:
    """The caller's network address without its port ("ipv4:10.0.0.7", "ipv6:[::1]"): what limits are keyed
    by where no verified key is (a probe, a Submit stream before its first part), never a name in a request."""
    peer = str(context.peer() or "")
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() and host not in ("ipv4", "ipv6") else peer


class Admission:
    """The checks every call passes; a failed one aborts the call with its status code and is counted.

    Args:
        token: the run token ("authorization: Bearer <token>"), needed unless admission is by allowlist alone.
        admission: the run's `[net] admission` policy; allowlist: the file of admitted keys (or "").
        limits: the rate limits of joins and downloads (and the Submit streams' own, used by their reader).
        metrics: where refusals are counted.
        round_of: the open round, for the log lines.
    """

    def __init__(self, *, token: str, admission: str, allowlist: str, limits: Limits, metrics: Metrics,
                 round_of: Callable[[], int]) -> None:
        self.token, self.policy, self.allowlist = token, admission, allowlist
        self.limits, self.metrics, self.round_of = limits, metrics, round_of
        self.identities = Identities(admission, read_allowlist(Path(allowlist)) if allowlist else None)

    async def authorize(self, context: Context) -> None:
        """Refuse (UNAUTHENTICATED) a call without the run token, where the policy needs one."""
        if not self.identities.needs_token:
            return
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(str(given).encode(), f"Bearer {self.token}".encode()):
            self.metrics.add("unauthorized")
            self.metrics.refused("", None, "unauthorized", "missing or wrong run token")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong run token")

    async def admit(self, request: Any, context: Context) -> None:
        """Refuse a call without the run token, then one whose request did not parse (INVALID_ARGUMENT)."""
        await self.authorize(context)
        if isinstance(request, Malformed):
            self.metrics.add("rejected")
            self.metrics.refused("", None, "malformed", str(request))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))

    @staticmethod
    async def peer_id(peer_id: str, context: Context) -> str:
        """The id itself, or INVALID_ARGUMENT for one that is no peer id."""
        if not _PEER_ID.match(peer_id):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "peer_id should be 1-128 characters of letters, digits, '.', '_', '-'")
        return peer_id

    async def signed(self, peer_id: str, signature: bytes, message: bytes, context: Context,
                     counter: int | None = None) -> None:
        """Refuse (PERMISSION_DENIED) a request that `peer_id`'s key did not sign, or (a counted request) whose
        `counter` its session had used (counted as "replay").

        Raises:
            NotJoined: no key joined as `peer_id` (the caller answers so that the peer joins).
        """
        try:
            self.identities.check(peer_id, signature, message, counter)
        except NotJoined:
            raise
        except Refused as e:
            self.metrics.add("unauthorized")
            self.metrics.refused(peer_id, None, "replay" if isinstance(e, Replayed) else "signature", str(e))
            logger.warning("[coordinator round=%d] refused a request as %s: %s", self.round_of(), peer_id, e)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))

    async def limit(self, rates: RateLimits, key: str, what: str, context: Context) -> None:
        """RESOURCE_EXHAUSTED, saying when to try again (also as "retry-after-s"), past `key`'s rate."""
        wait_s = rates.take(key, _now())
        if wait_s > 0:
            self.metrics.refused(key, None, "rate", f"{what} over its rate")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{what}: {key} is over its rate ({rates.burst} at once, then one per "
                                f"{rates.every_s:g} s); try again in {wait_s:.1f} s",
                                trailing_metadata=(("retry-after-s", f"{wait_s:.3f}"),))

    async def refuse_protocol(self, peer_id: str, reason: str, context: Context) -> None:
        """Refuse (FAILED_PRECONDITION) a Join of another protocol version; counted and logged."""
        self.metrics.refused(peer_id, None, "protocol", reason)
        logger.warning("[coordinator round=%d] refused a join as %s: %s", self.round_of(), peer_id, reason)
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)

    async def challenge(self, peer_id: str, public_key: bytes, context: Context) -> bytes:
        """A nonce for `public_key` to sign as `peer_id`, or PERMISSION_DENIED."""
        try:
            return self.identities.challenge(peer_id, public_key, _now())
        except Refused as e:
            self.metrics.refused(peer_id, None, "join", str(e))
            logger.warning("[coordinator round=%d] refused a challenge for %s: %s", self.round_of(), peer_id, e)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
            raise  # not reached: abort raises

    async def join(self, peer_id: str, request: Any, context: Context) -> bytes:
        """Bind `peer_id` to the key that signed the challenge (or PERMISSION_DENIED); the session, after the
        joins' rate limit (per key: only the holder of the key `peer_id` is bound to spends its joins)."""
        try:
            session = self.identities.join(peer_id, request.public_key, request.nonce, request.signature,
                                           _now()).session
        except Refused as e:
            self.metrics.refused(peer_id, None, "join", str(e))
            logger.warning("[coordinator round=%d] refused a join as %s: %s", self.round_of(), peer_id, e)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
            raise  # not reached: abort raises
        await self.limit(self.limits.joins, peer_id, "Join", context)
        return session

    def newcomers_due(self, now: float | None = None) -> list[str]:
        """Let go the peers bound longer than `newcomer_s` that never had a payload accepted (their keys and
        sessions; their ids are free again); returns them, for the caller to drop from the membership."""
        now = _now() if now is None else now
        due = [p for p in self.identities.newcomers()
               if now - self.identities.bound_at.get(p, now) >= self.limits.cfg.newcomer_s]
        for peer_id in due:
            self.identities.forget(peer_id)
        if due:
            logger.info("[coordinator round=%d] let go %d peers that sent no accepted payload in %.0f s since "
                        "they joined: %s", self.round_of(), len(due), self.limits.cfg.newcomer_s, ", ".join(due[:10]))
        return due

    async def room_for(self, peer_id: str, context: Context) -> None:
        """RESOURCE_EXHAUSTED for a new peer id while `max_newcomers` bound peers have never contributed."""
        newcomers = self.identities.newcomers()
        if peer_id in self.identities.bindings or len(newcomers) < self.limits.cfg.max_newcomers:
            return
        self.metrics.refused(peer_id, None, "newcomers", "too many peers without an accepted payload")
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{len(newcomers)} peers joined and have not had a payload accepted yet, the most "
                            f"this coordinator admits; try again later",
                            trailing_metadata=(("retry-after-s", f"{self.limits.cfg.newcomer_s / 4:.3f}"),))

    def reload_allowlist(self) -> list[str] | None:
        """Read the allowlist file again (SIGHUP); the peers whose keys left it (None: nothing reloaded)."""
        if self.policy != "allowlist":
            logger.info("[coordinator] SIGHUP: admission is %r, no allowlist to reload", self.policy)
            return None
        try:
            allowed = read_allowlist(Path(self.allowlist))
        except (OSError, ValueError) as e:
            logger.error("[coordinator] SIGHUP: the allowlist was not reloaded, the old one stays: %s", e)
            return None
        removed = self.identities.reload(allowed)
        logger.info("[coordinator] allowlist reloaded: %d keys%s", len(allowed),
                    f"; dropped {', '.join(removed)}" if removed else "")
        return removed

    def session(self, peer_id: str) -> bytes | None:
        """The session of the key joined as `peer_id` (None: none joined)."""
        return self.identities.session(peer_id)

    def fingerprints(self) -> dict[str, str]:
        """Peer -> the fingerprint of its key, for the dashboard."""
        return {p: b.fingerprint for p, b in self.identities.bindings.items()}
