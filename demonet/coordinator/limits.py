"""What the coordinator lets one caller cost it: submission sizes, open Submit streams, bytes in flight, and
the rate of parameter downloads and joins. Pure logic.

No network and no asyncio: the caller passes the time (`now`, seconds) into every call, so tests drive it
with a fake clock. The servicer (`demonet.coordinator.server`) holds one `Limits` and asks it before it
reads a payload or streams the parameters.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from demonet.errors import Busy
from demonet.optim.payload import num_chunks
from demonet.wire.parts import DEFAULT_PART_BYTES

__all__ = ["DEFAULT_INFLIGHT_FLOOR_BYTES", "MESSAGE_MARGIN_BYTES", "Limits", "LimitsConfig", "RateLimits", "RoundCalls",
           "StreamCount", "SubmitSlots", "submission_bound"]

DEFAULT_INFLIGHT_FLOOR_BYTES = 256 << 20
"""`max_inflight_bytes` is at least this much by default (and 8 submissions' worth where those are larger)."""
_TENSOR_HEADER_BYTES = 96
"""A `SparseTensor`'s fields besides its data (tags, lengths, chunk, k, codings); its name and shape come on top."""
_MARGIN_BYTES = 4096
"""The `Payload` header and digest trailer, and room to spare."""
_MAX_KEYS = 4096
MESSAGE_MARGIN_BYTES = 16 << 10
"""A SubmitPart's fields besides its data (ids, digests, signature), with room to spare: the server's largest
message is the largest part plus this."""
"""Rate buckets kept; past this, the full ones (callers that have been quiet) are forgotten."""


def submission_bound(specs: Mapping[str, tuple[tuple[int, ...], tuple[int, int]]], topk: int,
                     cap: int | None = None) -> int:
    """The largest serialized payload a valid submission for this run can be (`demonet.wire.encode`'s layout).

    Per tensor: its C chunks keep k = min(topk, h*w) coefficients each, at most 32-bit values and 32-bit
    indices (no coding is wider: packed indices take ceil(log2(h*w)) <= 20 bits, Elias-Fano and bitmaps
    are chosen only where smaller), a 32-bit scale per chunk, and its header; plus a margin.

    Args:
        specs: name -> (shape, chunk) of the run's parameters (`DeMo.param_specs`).
        topk: the run's `compression_topk`.
        cap: the operator's cap (`CoordinatorOptions.max_payload_bytes`); the bound never exceeds it.
    """
    total = _MARGIN_BYTES
    for name, (shape, chunk) in specs.items():
        chunks, k = num_chunks(shape, chunk), min(topk, chunk[0] * chunk[1])
        total += chunks * k * 8 + chunks * 4 + _TENSOR_HEADER_BYTES + len(name.encode()) + 11 * len(shape)
    return total if cap is None else min(total, cap)


@dataclass
class _Stream:
    round: int
    declared: int
    handle: Any  # the servicer's: what ends the stream when its round closes


@dataclass
class SubmitSlots:
    """One open Submit stream per peer and round, and a budget of the bytes all open streams declared.

    A stream holds its slot from its first part to its end (any end: `release` in a `finally`). A peer has
    streams for two rounds at most (the open one, and the next one from an overlapped peer whose digest
    follows: `Rounds.check_submit`), so two slots times the per-submission bound is the peer's budget.
    """

    max_inflight_bytes: int
    streams: dict[tuple[str, int], _Stream] = field(default_factory=dict)
    inflight_bytes: int = 0

    def open(self, peer_id: str, round: int, declared: int, handle: Any = None) -> None:
        """Reserve `peer_id`'s slot of `round` for a stream of `declared` bytes.

        Raises:
            Busy: the peer has a stream for this round open, or this one would take the bytes in flight
                over the budget.
        """
        if (peer_id, round) in self.streams:
            raise Busy(f"{peer_id} has a Submit stream open for round {round}: one at a time")
        if self.inflight_bytes + declared > self.max_inflight_bytes:
            raise Busy(f"the coordinator has {self.inflight_bytes} bytes of submissions in flight; {declared} more "
                       f"would exceed its budget of {self.max_inflight_bytes}")
        self.streams[peer_id, round] = _Stream(round, declared, handle)
        self.inflight_bytes += declared

    def release(self, peer_id: str, round: int, handle: Any = None) -> None:
        """End `peer_id`'s stream for `round` (the one opened with `handle`; a refused stream holds none)."""
        stream = self.streams.get((peer_id, round))
        if stream is not None and stream.handle is handle:
            del self.streams[peer_id, round]
            self.inflight_bytes -= stream.declared

    def outlived(self, open_round: int) -> list[Any]:
        """The handles of the streams for rounds before `open_round`: their round has closed."""
        return [s.handle for s in self.streams.values() if s.round < open_round]


@dataclass
class StreamCount:
    """Submit calls open at once, in total and per caller address, counted from the call's start (before its
    first message is read), so that streams which never send a part cannot pile up.

    Where the total is reached, a new call takes the place of the oldest open call that has sent no part yet
    (`ends_now`: it ends at once), so that streams from many addresses that never send a part cannot hold off
    an honest peer's Submit (whose first part comes within milliseconds) either; only calls that are sending
    their payload make a new one BUSY."""

    most: int
    most_per_address: int
    open: dict[str, int] = field(default_factory=dict)
    total: int = 0
    waiting: OrderedDict[int, Callable[[], None]] = field(default_factory=OrderedDict)
    """The calls that have sent no part yet, oldest first: their `ends_now`, by their token."""
    _next: int = 0

    def enter(self, address: str, ends_now: Callable[[], None]) -> int:
        """Count one more open Submit call from `address`; returns its token (`started`, `leave`).

        Raises:
            Busy: over the address's share, or over the total with every open call sending (nothing counted).
        """
        if self.open.get(address, 0) >= self.most_per_address:
            raise Busy(f"{address} has {self.most_per_address} Submit streams open, the most one address may; "
                       "try again once one ends")
        if self.total - len(self.waiting) >= self.most:
            raise Busy(f"the coordinator has {self.total} Submit streams open, its most; try again")
        if self.total >= self.most:  # the oldest call with no part yet gives way (it leaves once it has ended)
            _, oldest = self.waiting.popitem(last=False)
            oldest()
        self.open[address] = self.open.get(address, 0) + 1
        self.total += 1
        self._next += 1
        self.waiting[self._next] = ends_now
        return self._next

    def started(self, token: int) -> None:
        """The call's first part came: it no longer gives way to a new one."""
        self.waiting.pop(token, None)

    def leave(self, address: str, token: int) -> None:
        """One Submit call from `address` ended (after a successful `enter`)."""
        self.waiting.pop(token, None)
        left = self.open[address] - 1
        if left:
            self.open[address] = left
        else:
            del self.open[address]
        self.total -= 1


@dataclass
class RoundCalls:
    """Calls per caller and round, at most `most` (a member's GetAggregate of a round: one, and retries)."""

    most: int
    calls: dict[tuple[str, int], int] = field(default_factory=dict)

    def take(self, key: str, round: int, oldest: int) -> bool:
        """Count a call of `key` for `round`; False past `most`. Rounds before `oldest` are forgotten."""
        if len(self.calls) > _MAX_KEYS:
            self.calls = {k: n for k, n in self.calls.items() if k[1] >= oldest}
        n = self.calls.get((key, round), 0)
        if n >= self.most:
            return False
        self.calls[key, round] = n + 1
        return True


@dataclass
class RateLimits:
    """A token bucket per caller: `burst` calls at once, then one every `every_s`."""

    burst: int
    every_s: float
    buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # key -> (tokens, at)

    def take(self, key: str, now: float) -> float:
        """Spend one call of `key`'s; returns 0.0 if it may go ahead, else the seconds until it may."""
        tokens, at = self.buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - at) / self.every_s)
        if tokens < 1.0:
            self.buckets[key] = (tokens, now)
            return (1.0 - tokens) * self.every_s
        self.buckets[key] = (tokens - 1.0, now)
        if len(self.buckets) > _MAX_KEYS:
            self._forget_full(now)
        return 0.0

    def _forget_full(self, now: float) -> None:
        for key in [k for k, (t, at) in self.buckets.items() if t + (now - at) / self.every_s >= self.burst]:
            del self.buckets[key]


@dataclass(frozen=True, kw_only=True)
class LimitsConfig:
    """The coordinator's limits (docs/coordinator.md, Limits)."""

    max_submission_bytes: int
    """Declared size of one Submit stream's payload, at most: `submission_bound` of the run."""
    max_inflight_bytes: int
    """The declared sizes of all open Submit streams together, at most."""
    download_every_s: float
    """A member's parameter downloads refill at one per this long (the round timeout)."""
    download_burst: int = 4
    """Parameter downloads a member may make at once: its join, a resync, a catch-up and a retry."""
    join_burst: int = 5
    """Join calls one peer id may make at once (a probe and a join, retries, a rejoin)."""
    join_every_s: float = 1.0
    """Joins refill at one per this long."""
    stream_grace_s: float = 1.0
    """A Submit stream for round r is ended this long after r's deadline (or at once when r closes)."""
    max_streams: int = 64
    """Submit calls open at once, in total (each may hold one message of `max_message_bytes` in memory)."""
    max_streams_per_address: int = 8
    """Submit calls open at once from one address (a peer has two at most: the open round's and the next)."""
    first_part_s: float = 10.0
    """A Submit stream whose first message has not arrived this long after the call began is ended: it is
    the signature and the first part, at most `max_message_bytes`, sent as soon as the stream opens."""
    probe_burst: int = 32
    """Join probes (no key: a peer reading the run's terms) one address may make at once."""
    probe_every_s: float = 0.25
    """Probes refill at one per this long."""
    aggregate_calls_per_round: int = 4
    """A member's signed GetAggregate calls for one round (the call beside its Submit, and retries)."""
    public_burst: int = 4
    """Unsigned GetAggregate calls (the public path, all callers together) at once."""
    public_every_s: float = 1.0
    """The public path refills at one call per this long."""
    newcomer_s: float = 600.0
    """A peer bound this long that never had a payload accepted is let go: dropped from the membership, its
    key and session forgotten (it may join again, as a newcomer)."""
    max_newcomers: int = 256
    """Peers bound at once that never had a payload accepted, at most; a join of another new id waits."""

    @property
    def max_message_bytes(self) -> int:
        """The largest message the server reads: one part of the largest submission (a part is at most
        `demonet.wire.parts.DEFAULT_PART_BYTES`), and its header fields."""
        return min(self.max_submission_bytes, DEFAULT_PART_BYTES) + MESSAGE_MARGIN_BYTES

    def __post_init__(self) -> None:
        if self.max_submission_bytes < 1 or self.max_inflight_bytes < self.max_submission_bytes:
            raise ValueError("max_inflight_bytes should be >= max_submission_bytes >= 1")
        if self.max_streams < 1 or self.max_streams_per_address < 1 or self.first_part_s <= 0:
            raise ValueError("max_streams and max_streams_per_address should be >= 1, first_part_s > 0")
        if min(self.probe_burst, self.public_burst, self.aggregate_calls_per_round) < 1:
            raise ValueError("probe_burst, public_burst and aggregate_calls_per_round should be >= 1")
        if self.probe_every_s <= 0 or self.public_every_s <= 0 or self.newcomer_s <= 0:
            raise ValueError("probe_every_s, public_every_s and newcomer_s should be > 0")
        if self.max_newcomers < 1:
            raise ValueError("max_newcomers should be >= 1")
        if self.download_every_s <= 0 or self.join_every_s <= 0 or self.stream_grace_s < 0:
            raise ValueError("download_every_s and join_every_s should be > 0, stream_grace_s >= 0")
        if self.download_burst < 1 or self.join_burst < 1:
            raise ValueError("download_burst and join_burst should be >= 1")


class Limits:
    """The coordinator's limits, in one place: Submit calls, slots and budget, download, join and probe rates."""

    def __init__(self, cfg: LimitsConfig) -> None:
        self.cfg = cfg
        self.slots = SubmitSlots(cfg.max_inflight_bytes)
        self.streams = StreamCount(cfg.max_streams, cfg.max_streams_per_address)
        self.probes = RateLimits(cfg.probe_burst, cfg.probe_every_s)
        self.aggregates = RoundCalls(cfg.aggregate_calls_per_round)
        self.public = RateLimits(cfg.public_burst, cfg.public_every_s)
        self.downloads = RateLimits(cfg.download_burst, cfg.download_every_s)
        self.joins = RateLimits(cfg.join_burst, cfg.join_every_s)

    def check_size(self, declared: int) -> str | None:
        """Why a submission declaring `declared` bytes cannot be valid for this run, or None."""
        if declared > self.cfg.max_submission_bytes:
            return (f"it declares {declared} bytes; no valid payload of this run is over "
                    f"{self.cfg.max_submission_bytes} bytes")
        return None

    def stream_deadline(self, round_deadline: float, started: bool, now: float, round_timeout_s: float) -> float:
        """When a Submit stream starting at `now` ends at the latest: its round's deadline plus the grace (a
        round not yet started has no deadline: a round timeout from now)."""
        end = round_deadline if started else now + round_timeout_s
        return max(end, now) + self.cfg.stream_grace_s
