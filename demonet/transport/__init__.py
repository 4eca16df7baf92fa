"""Transports: how a peer gets into a run and how its payload for a round becomes the round's aggregate.

A transport is a `Membership` (join, parameters, heartbeat, catch up) and a `Gatherer` (submit a payload,
get the round's outcome); `demonet.loop.RoundLoop` drives any pair of them. Imports torch, the math
layer's dataclasses and demonet.errors only: no grpc, no hivemind, no service module. The
implementations (`demonet.transport.grpc`, `demonet.coordinator.local`, `demonet.dht.membership`,
`demonet.flex.link`) are imported by name, never from here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from demonet.errors import DemonetError, NotMember, PeerUnavailable, Rejected, Resync, StaleRound
from demonet.optim import Expected, Payload

__all__ = ["Digest", "EncodesAhead", "Expected", "Gatherer", "JoinInfo", "Membership", "NotMember", "Pace",
           "Parameters", "Rejected", "Resync", "RoundResult", "StaleRound", "catch_up", "catch_up_timeout_s",
           "keep_alive", "refusal_error"]

class Digest:
    """A peer's parameter digest at the start of a round: known when the payload leaves, or to follow it (an
    overlapped peer has its payload for round r+1 before it has applied round r: `Gatherer.digest_follows`).

    `Digest(value)` is known; `Digest.to_follow()` is not yet (`follows`): `set` gives it once the peer is on
    the round's parameters, `cancel` calls it off (the peer will not start the round from them).
    """

    __slots__ = ("_future", "_value", "follows")

    def __init__(self, value: str) -> None:
        self.follows = False
        """Whether the digest was still to come when the payload was handed over."""
        self._future: asyncio.Future[str] | None = None
        self._value = value

    @classmethod
    def to_follow(cls) -> Digest:
        """A digest still to come (made in the running event loop)."""
        digest = cls("")
        digest.follows, digest._future = True, asyncio.get_running_loop().create_future()
        return digest

    @property
    def is_known(self) -> bool:
        return self._future is None or (self._future.done() and not self._future.cancelled()
                                        and self._future.exception() is None)

    @property
    def value(self) -> str:
        """The digest, once known.

        Raises:
            RuntimeError: not known (yet, or ever: called off).
        """
        if self._future is None:
            return self._value
        if not self.is_known:
            raise RuntimeError("the parameter digest is not known")
        return self._future.result()

    async def known(self) -> str:
        """The digest, once it is known (a transport that sends it with the payload's first part waits for it).

        Raises:
            asyncio.CancelledError: it was called off.
        """
        return self._value if self._future is None else await asyncio.shield(self._future)

    def waiter(self) -> asyncio.Future[str]:
        """What to wait on beside other things (a digest still to come); a done future for a known one."""
        if self._future is None:
            done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            done.set_result(self._value)
            return done
        return self._future

    def set(self, value: str) -> None:
        """The digest has come."""
        assert self._future is not None and not self._future.done(), "a known digest is not set again"
        self._future.set_result(value)

    def cancel(self) -> None:
        """Call it off: the peer will not start the round from the round before (the gather is cancelled too)."""
        if self._future is not None:
            self._future.cancel()


@dataclass(frozen=True)
class JoinInfo:
    """Where a run stands for a peer that joins it."""

    peer_id: str
    round: int
    """The first round this peer is a member of."""
    run_config: dict[str, Any]
    """{"model": {...}, "optim": {...}, "train": {...}, "net": {...}}: overrides for `demonet.config.load_config`."""
    data_seed: int
    round_timeout_s: float
    heartbeat_interval_s: float
    """0: the transport needs no heartbeats (a DHT peer's announcements each round are its heartbeat)."""
    total_rounds: int
    """The run ends after this many rounds; 0: no end."""
    fresh: bool = False
    """No round has closed yet: every peer starts from the seeded initial parameters, nothing to download."""
    param_specs: tuple[tuple[str, tuple[int, ...], str], ...] | None = None
    """The run's parameters as (name, shape, dtype), which a peer's model must match; None: not said."""
    task_files: tuple[tuple[str, int, str], ...] = ()
    """The files the run's task is built from that the coordinator ships, as (name, size, SHA-256 hex)
    (`demonet.wire.task_files.TaskFile`); (): none."""


@dataclass(frozen=True)
class Pace:
    """What a peer tells the coordinator of its speed with a payload, from which the coordinator sets the
    automatic round length (`demonet.wire.pace`); zeros: not measured yet."""

    need_s: float = 0.0
    """Seconds for a round of this peer's own micro-batches: training, compress, upload and apply."""
    least_s: float = 0.0
    """The same for a round of one micro-batch."""
    train_s: float = 0.0
    """One micro-batch's forward and backward alone: what of `least_s` is compute, not the link."""
    micro_batches: int = 0
    """The micro-batches of the payload it comes with (for the dashboards; 0: not said)."""
    compute_s: float = 0.0
    """Their forward and backward seconds (for the dashboards; 0: not said)."""
    upload_s: float = 0.0
    """Its last upload measured, in seconds (for a DHT peer's dashboards; 0: none; a coordinator times its own)."""


@dataclass(frozen=True)
class Parameters:
    """Downloaded parameters at the start of a round."""

    round: int
    tensors: dict[str, torch.Tensor] = field(repr=False)
    size: int
    """Bytes received."""
    source: str = "the coordinator"
    """Where they came from, for the log."""


@dataclass(frozen=True)
class RoundResult:
    """How one round ended, as this peer saw it."""

    round: int
    aggregate: Payload | None
    """What every member applies; None when the round was aborted."""
    contributors: tuple[str, ...]
    """Peers whose payloads are in the aggregate."""
    param_digest: str
    """The canonical parameter digest after applying the aggregate ("" in DHT mode: checked at the next round)."""
    aborted: bool
    bytes_up: int
    """Bytes of this peer's serialized payload."""
    bytes_down: int
    """Bytes of the serialized aggregate (0 when aborted)."""
    kept: Payload | None = None
    """What of this peer's payload the aggregate holds, when that is not simply the aggregate (DHT mode:
    a slice merged without this payload); None: the aggregate."""
    data: bytes = field(default=b"", repr=False)
    """The aggregate's validated wire bytes as received, for relaying (a FlexDeMo node to its ranks)."""
    phases: Mapping[str, float] = field(default_factory=dict)
    """Where the round's time went in the transport (name -> seconds, or a count), for the metrics rows;
    empty: not measured (DHT mode: docs/dht.md#where-the-time-goes)."""
    next_round_s: float | None = None
    """The next round's length, as the coordinator announced it with the aggregate (0: lockstep, each peer
    trains its own micro-batches); None: the transport does not say (the peer's own `[net] round_s` holds)."""
    spans: bool = False
    """Whether this peer's micro-batch spans the next rounds (DHT mode: the members' announced speeds say it is
    slower than a round by its compute; it trains across rounds on a copy of the parameters,
    `demonet.loop.spanning`). A coordinator-mode peer that spans needs no telling: its payload counts late."""
    before: tuple[RoundResult, ...] = field(default=(), repr=False, compare=False)
    """A late payload (computed for an earlier round, counted in this one: bounded staleness): the results of the
    rounds from its own to this one, not included, which the peer applies first, as rounds it had nothing in."""
    digest_later: asyncio.Task[str] | None = field(default=None, repr=False, compare=False)
    """The canonical digest when it comes after the aggregate (coordinator mode: the GetAggregate stream's
    trailer, sent once the coordinator applied the round); `param_digest` is "" then. Settle first, then
    `canonical_digest`: the coordinator's apply runs while this peer decodes and applies."""

    async def canonical_digest(self) -> str:
        """`param_digest`, or what `digest_later` gives once it comes.

        Raises:
            DemonetError: the digest could not be had (the stream broke or was malformed): the peer cannot
                tell whether it is on the canonical parameters.
        """
        return self.param_digest if self.digest_later is None else await self.digest_later


class Gatherer(Protocol):
    """Takes this peer's payload for a round and returns the round's aggregate."""

    digest_follows: bool
    """Whether `gather` sends the payload before its digest is known (coordinator mode: the payload of
    round r+1 travels while round r is still merged and downloaded). Where False, an overlapped peer
    calls `gather` only once the digest is known."""

    async def gather(self, round: int, payload: Payload, *, loss: float, param_digest: Digest,
                     samples: int = 1, pace: Pace | None = None) -> RoundResult:
        """Send `payload` for `round` and wait for the round to close.

        Args:
            round: the round the payload belongs to.
            payload: what `DeMo.compress()` returned for this round.
            loss: this peer's training loss on its batch for the round.
            param_digest: this peer's parameter digest at the start of the round; one still to follow only
                where `digest_follows` (called off if the peer will not start the round from the round
                before: the call is then cancelled too).
            samples: how many samples the payload was computed from: its weight in the merge (DHT mode
                does not weight yet: every payload weighs the same there).
            pace: this peer's speed, for the automatic round length (the coordinator's; None: not measured).

        Raises:
            Rejected: the payload was not taken (see its subclasses for what to do).
            PeerUnavailable: the other side could not be reached in time.
            InvalidPayload: the aggregate failed validation.
        """
        ...

    async def close(self) -> None:
        """Release connections; the gatherer is of no further use."""
        ...


@runtime_checkable
class EncodesAhead(Protocol):
    """A `Gatherer` that can encode a round's payload in the training's thread, right after its compress."""

    def encode_ahead(self, round: int) -> Callable[[Payload], None] | None:
        """Called on the event loop before `round`'s training: a function to run in the training's worker
        thread on the round's host payload once it is compressed, which encodes what `gather` will send
        (it keeps the result; `gather` uses it where it still fits and it is given that very payload, and
        encodes anew otherwise), or None (nothing to encode ahead). `RoundLoop` times it apart from the
        compute (the row's ``phases.encode``)."""
        ...


class Membership(Protocol):
    """How a peer gets into a run, gets its parameters, stays a member and gets back in step."""

    async def join(self) -> JoinInfo:
        """Enter the run (or learn that it is over); raises `PeerUnavailable` if it cannot be reached."""
        ...

    async def first_parameters(self, info: JoinInfo, expected: Expected) -> Parameters | None:
        """The parameters to start from after `join` (None: the seeded initial ones)."""
        ...

    async def parameters(self, round: int, expected: Expected, *, resync: bool = False) -> Parameters:
        """The canonical parameters at the start of `round` (or a later one); `resync`: because this
        peer's digest after applying round - 1 differed from the canonical one."""
        ...

    async def catch_up(self, reason: DemonetError, round: int, expected: Expected) -> Parameters:
        """Get back in step after the payload of `round` was refused (`reason`); bounded by time.

        Raises:
            PeerUnavailable: not back in step in time.
        """
        ...

    async def heartbeat(self, round: int) -> None:
        """Say this peer is alive at `round`; join again if the run dropped it (`keep_alive` calls it)."""
        ...

    async def moved_on(self, round: int, like: Payload, most: int) -> list[RoundResult] | None:
        """After the forward, backward and compress of `round` that outlasted rounds (a peer whose micro-batch
        spans rounds): where the run has moved past `round`, the aggregates of the rounds since (`round` to the
        open one, not included), decoded against `like` (the payload), for the peer to apply before it sends its
        payload in the open round; None where it has not, or where the transport's rounds do not let a peer
        span them (DHT mode, a FlexDeMo node).

        Raises:
            StaleRound: over `most` rounds have passed, or an aggregate is no longer kept (the peer catches up).
            PeerUnavailable: the run could not be reached.
        """
        ...

    async def leave(self, round: int) -> None:
        """A graceful stop at `round`: tell the run, so that its rounds stop waiting for this peer (best effort:
        a run that cannot be told drops the peer as it drops a silent one)."""
        ...

    async def begin_round(self, round: int, digest: str,
                          named_parameters: Callable[[], list[tuple[str, torch.Tensor]]]) -> None:
        """Called before a round's training with the digest the peer starts it with."""
        ...

    async def agree(self, value: bool) -> bool:
        """One decision for every rank of a multi-rank member (its rank 0's); `value` elsewhere."""
        ...

    async def close(self) -> None:
        """Release what the membership holds (tasks, connections)."""
        ...


def refusal_error(kind: str, reason: str, *, round: int, open_round: int) -> Rejected | None:
    """What a coordinator's refusal of this peer's payload for `round` means for the peer: the one mapping of
    every coordinator client (gRPC and in-process). `kind` is the refusal's name, as proto/demonet.proto's
    `Refusal` has it without its prefix, lower case ("stale", "future", ...).

    Returns:
        None where the payload is in after all ("duplicate": a retry whose first try got in); else the error
        that sends the peer to get back in step.

    Raises:
        RuntimeError: "invalid" or "conflict": this peer sent what no correct peer sends (a bug: crash).
    """
    if kind == "duplicate":
        return None
    if kind == "resync":
        return Resync(f"round {round}: {reason or 'parameter digest differs from the canonical one'}")
    if kind in ("not_member", "future"):  # future: a coordinator that lost its state
        return NotMember(f"round {round}: {reason}")
    if kind in ("stale", "busy"):  # busy past the retries: past the round's deadline by now
        return StaleRound(f"round {round}: {reason}", open_round=open_round)
    raise RuntimeError(f"the coordinator refused this peer's payload for round {round} ({kind}): {reason}")


CATCH_UP_MIN_S = 30.0
"""Getting back in step is bounded by time, never by a count: at least this long, and at least
`CATCH_UP_ROUNDS` round timeouts (rounds of milliseconds can outrun several tries in a row)."""
CATCH_UP_ROUNDS = 10


def catch_up_timeout_s(round_timeout_s: float) -> float:
    return max(CATCH_UP_MIN_S, CATCH_UP_ROUNDS * round_timeout_s)


async def catch_up(reason: Exception, *, join: Callable[[], Awaitable[JoinInfo]],
                   download: Callable[[int], Awaitable[Parameters]], round: int, timeout_s: float) -> Parameters:
    """Get back in step with a coordinator after a round's payload was refused (the caller restored it):
    download the parameters of the round to continue at, joining again first if it dropped this member.

    Args:
        reason: why: `NotMember` (join, then the round the coordinator names), `StaleRound` (its open
            round), `Resync` (this round's parameters), anything else (an aggregate that failed
            validation: the parameters after the round).
        join: joins the run again.
        download: downloads the parameters at the start of a round.
        round: the round the member is at.
        timeout_s: the run moving on while this member catches up restarts the attempt; past this
            long, it gives up.

    Raises:
        PeerUnavailable: not back in step within `timeout_s` (or the coordinator stayed unreachable).
    """
    give_up_at = time.monotonic() + timeout_s
    while True:
        try:
            if isinstance(reason, NotMember):
                return await download((await join()).round)
            if isinstance(reason, StaleRound):
                return await download(reason.open_round)
            if isinstance(reason, Resync):
                return await download(round)
            return await download(round + 1)
        except (NotMember, StaleRound) as e:  # the run moved on while this member caught up
            if time.monotonic() >= give_up_at:
                raise PeerUnavailable(f"could not get back in step with the coordinator in {timeout_s:.0f} s: "
                                      f"{e}") from None
            reason = e


async def keep_alive(membership: Membership, round_of: Callable[[], int], interval_s: float,
                     log: logging.LoggerAdapter[logging.Logger]) -> None:
    """`membership.heartbeat` every `interval_s` until cancelled; a failed beat is logged, not raised.

    Start it before the first parameter download: a joiner on a slow link is alive while it downloads.
    """
    while True:
        await asyncio.sleep(max(interval_s, 0.1))
        try:
            await membership.heartbeat(round_of())
        except DemonetError as e:
            log.warning("heartbeat: %s", e)
