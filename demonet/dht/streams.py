"""The DHT-mode transport's pieces below the round logic: options, record signing, and the libp2p streams.

Net layer, part of demonet.dht.gatherer (imported only with it): the HMAC validator of DHT records,
`DhtOptions`, and `_Streams`, which sends and serves the signed stream messages (parts, merged
slices, parameter ranges) over hivemind's P2P.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2PContext, PeerID
from hivemind.utils import get_dht_time

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload, PeerUnavailable
from demonet.optim import Payload
from demonet.wire import params as wire_params
from demonet.wire.merge import MergeRules

from . import rules

__all__ = ["DhtOptions", "HmacValidator"]

logger = logging.getLogger(__name__)

HANDLER = "demonet.dht.v2"  # v2: payloads travel as PayloadPart messages (v1 had DhtMessage.data and last)
_PART_BYTES = 1 << 20
_MAC_BYTES = 32
_KEEP_ROUNDS = 3  # rounds whose merged slices a late peer can still fetch
_REPLAY_S = 600.0  # messages sent longer ago than this (by the sender's clock) are refused
_MAX_DRAIN = 64  # messages read after a refused one, so that the refusal reaches its sender


def now() -> float:
    """DHT time: the clock every peer's deadlines use."""
    return float(get_dht_time())


class HmacValidator(RecordValidatorBase):  # type: ignore[misc]
    """Signs every DHT record this node stores with an HMAC of the run token and refuses records without it.

    hivemind calls `validate` when another node asks this one to store a record and when a record
    comes back from a search, so a node without the token can neither place records on this
    node nor have its records read by this node's peer.
    """

    def __init__(self, token: bytes) -> None:
        self._token = token

    @staticmethod
    def _body(record: DHTRecord, value: bytes) -> bytes:
        return b"|".join([record.key, record.subkey, value, repr(float(record.expiration_time)).encode()])

    def sign_value(self, record: DHTRecord) -> bytes:
        return bytes(record.value) + rules.sign(self._token, self._body(record, record.value))

    def validate(self, record: DHTRecord) -> bool:
        value = bytes(record.value)
        if len(value) <= _MAC_BYTES:
            return False
        return rules.verify(self._token, self._body(record, value[:-_MAC_BYTES]), value[-_MAC_BYTES:])

    def strip_value(self, record: DHTRecord) -> bytes:
        return bytes(record.value)[:-_MAC_BYTES]


@dataclass(frozen=True, kw_only=True)
class DhtOptions:
    """How a peer joins the DHT and runs rounds on it."""

    run: str
    """The run's DHT prefix: peers with the same prefix (and token) train together."""
    token: str
    """The run token: records and messages carry an HMAC keyed by it; it never travels."""
    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of peers already in the DHT (none: this peer starts a new DHT)."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    """Where this peer listens (TCP port 0: any free one)."""
    announce_maddrs: tuple[str, ...] = ()
    """Public multiaddrs to advertise instead of the listening ones (port forwarding)."""
    identity_path: str | None = None
    """Private key file of this peer's libp2p identity (created if missing): a stable peer id, so a
    bootstrap peer keeps its multiaddr across restarts. None: a new identity each start."""
    bootstrap_timeout_s: float = 60.0
    """How long to keep trying to reach the initial peers when starting."""
    client_mode: bool = False
    """Behind NAT: only dial out. Such a peer trains and sends, but owns no slice and donates nothing."""
    window_s: float = 30.0
    """A round freezes at most this long after its first announcement, without the peers not in by then."""
    exchange_timeout_s: float = 10.0
    """Each of the two exchange phases (parts to owners, merged slices back) ends this long after the previous."""
    settle_s: float = 0.2
    """Store latency allowed: a freeze at the deadline is read again this long after it."""
    start_peers: int = 1
    """The first round freezes once this many peers announced."""
    rules: MergeRules = field(default_factory=lambda: MergeRules(topk=32))
    """How a slice owner merges: the coordinator's rules (top-k, encoding, median-norm clipping, norm bound)."""

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("token should be non-empty")
        if not self.run or "/" in self.run:
            raise ValueError("run should be a non-empty name without '/'")
        if self.window_s <= 0 or self.exchange_timeout_s <= 0 or self.settle_s < 0:
            raise ValueError("window_s and exchange_timeout_s should be > 0, settle_s >= 0")
        if self.start_peers < 1:
            raise ValueError("start_peers should be >= 1")


@dataclass(eq=False)
class _Round:
    """What this peer knows of one round: its plan once frozen, parts in, merged slices held."""

    plan: rules.SlicePlan | None = None
    owners: list[str] = field(default_factory=list)
    members: list[str] = field(default_factory=list)  # the effective members (majority digest)
    mdigest: str = ""
    rs_deadline: float = 0.0
    ag_deadline: float = 0.0
    parts: dict[int, dict[str, tuple[str, bytes]]] = field(default_factory=dict)  # slice -> sender -> (mdigest, data)
    merged: dict[int, tuple[tuple[str, ...], bytes, Payload]] = field(default_factory=dict)
    fetched: dict[int, set[str]] = field(default_factory=dict)  # slice -> peers that fetched it from here
    bytes_up: int = 0
    bytes_down: int = 0


class _Streams:
    """The stream side of a DHT peer: signed messages, calls with retries, and the handler that serves them."""

    opts: DhtOptions
    peer_id: str
    p2p: Any
    refused: int
    _token: bytes
    _cond: asyncio.Condition
    _rounds: dict[int, _Round]
    _params: tuple[int, Callable[[], list[tuple[str, torch.Tensor]]]] | None

    latest: int = -1
    """The latest round this peer gathered for; streams about rounds far from it are refused."""

    def _round(self, r: int, *, mine: bool = False) -> _Round:
        """The state of round `r`; `mine`: this peer starts it (older rounds are forgotten then)."""
        if mine and r > self.latest:
            self.latest = r
            for old in [k for k in self._rounds if k < r - _KEEP_ROUNDS]:
                del self._rounds[old]
        return self._rounds.setdefault(r, _Round())

    def _far(self, r: int) -> bool:
        """A round this peer keeps no state for: long over, or too far ahead (a peer out of step)."""
        return r < self.latest - _KEEP_ROUNDS or (self.latest >= 0 and r > self.latest + 2)

    async def _retry(self, attempt: Callable[[float], Any], deadline: float) -> str:
        """Run `attempt(timeout_s)` until it succeeds or `deadline` (DHT time) passes; returns the last
        error ('' on success). A stream can break while both peers are fine, so one failure is not final."""
        delay_s, error = 0.05, ""
        while True:
            try:
                await attempt(max(0.1, deadline - now()))
                return ""
            except (PeerUnavailable, InvalidPayload) as e:
                error = str(e)
            if now() + delay_s >= deadline:
                return error
            await asyncio.sleep(delay_s)
            delay_s = min(2 * delay_s, 0.5)

    # -- messages --------------------------------------------------------------------------------------

    def _message(self, kind: int, round: int, **fields: Any) -> pb.DhtMessage:
        msg = pb.DhtMessage(run=self.opts.run, round=round, sender=self.peer_id, kind=kind, sent_at=now(), **fields)
        msg.mac = rules.sign(self._token, msg.SerializeToString())
        return msg

    def _messages(self, kind: int, round: int, data: bytes | None, **fields: Any) -> list[pb.DhtMessage]:
        """One message without a part if `data` is None, else one message per part of `data`."""
        if data is None:
            return [self._message(kind, round, **fields)]
        return [self._message(kind, round, part=part, **fields) for part in wire.split(data, part_bytes=_PART_BYTES)]

    def _check(self, msg: pb.DhtMessage) -> str:
        """Why a message is refused ('' if it is good)."""
        mac = msg.mac
        msg.mac = b""
        ok = rules.verify(self._token, msg.SerializeToString(), mac)
        msg.mac = mac
        if not ok:
            return "bad run token"
        if msg.run != self.opts.run:
            return f"another run ({msg.run!r})"
        if abs(now() - msg.sent_at) > _REPLAY_S:
            return "sent too long ago"
        return ""

    async def _call(self, address: str, kind: int, round: int, *, timeout_s: float, data: bytes | None = None,
                    **fields: Any) -> tuple[pb.DhtMessage, bytes]:
        """One request stream to a peer and its reply stream; returns (the first reply, the reply's data:
        b"" for a reply without parts)."""
        requests = self._messages(kind, round, data, **fields)
        max_bytes = wire_params.MAX_PARAMETER_BYTES if kind == pb.DHT_KIND_PARAMS else wire.DEFAULT_MAX_BYTES
        parts = wire.Reassembler(max_bytes=max_bytes)
        whole: bytes | None = None

        async def send() -> AsyncIterator[pb.DhtMessage]:
            for msg in requests:
                yield msg

        first: pb.DhtMessage | None = None
        try:
            async with asyncio.timeout(timeout_s):
                stream = await self.p2p.iterate_protobuf_handler(PeerID.from_base58(address), HANDLER, send(),
                                                                 pb.DhtMessage)
                async for msg in stream:
                    why = self._check(msg)
                    if why:
                        raise PeerUnavailable(f"refused a reply: {why}")
                    first = first or msg
                    if msg.error:
                        raise PeerUnavailable(f"refused: {msg.error}")
                    if not msg.HasField("part"):
                        break
                    whole = parts.add(msg.part)
                    if whole is not None:
                        break
        except TimeoutError:
            raise PeerUnavailable(f"no answer within {timeout_s:.1f} s") from None
        except (PeerUnavailable, InvalidPayload):
            raise
        except Exception as e:  # hivemind's P2P raises its own errors (daemon, handler, connection) for a lost peer
            raise PeerUnavailable(f"{type(e).__name__}: {e}") from None
        if first is None:
            raise PeerUnavailable("the stream ended without an answer")
        if first.HasField("part") and whole is None:
            raise PeerUnavailable("the reply stream ended before its payload was whole")
        return first, whole or b""

    async def _handle(self, requests: AsyncIterator[pb.DhtMessage], context: P2PContext
                      ) -> AsyncIterator[pb.DhtMessage]:
        """Serve one stream: a part for a slice we own, a merged slice, or a range of parameters."""
        head: pb.DhtMessage | None = None
        parts = wire.Reassembler()  # only a PART request carries parts: a payload slice
        data: bytes | None = None
        async for msg in requests:
            why = self._check(msg)
            if not why and msg.HasField("part"):
                try:
                    data = parts.add(msg.part)  # None until whole; a part after that raises
                except InvalidPayload as e:
                    why = f"bad part: {e}"
            if why:
                self.refused += 1
                logger.warning("[%s] refused a message from %s: %s", self.peer_id, context.remote_id, why)
                # Read what the caller still sends (a bounded number of messages) before answering: a
                # stream closed early breaks the caller's pipe, and the refusal would never reach it.
                drained = 0
                async for _ in requests:
                    drained += 1
                    if drained >= _MAX_DRAIN:
                        break
                yield self._message(pb.DHT_KIND_REPLY, msg.round, error=why)
                return
            head = head or msg  # read to the end of the stream: closing early breaks the caller's pipe
        if head is None:
            return
        r = head.round
        if head.kind in (pb.DHT_KIND_PART, pb.DHT_KIND_FETCH) and self._far(r):
            yield self._message(pb.DHT_KIND_REPLY, r, error=f"round {r} is not kept here (at {self.latest})")
            return
        if head.kind == pb.DHT_KIND_PART:
            if data is None:
                yield self._message(pb.DHT_KIND_REPLY, r, error="the part's payload is not whole")
                return
            st = self._round(r)
            async with self._cond:
                st.parts.setdefault(head.slice, {})[head.sender] = (head.members_digest, data)
                st.bytes_down += len(data)
                self._cond.notify_all()
            yield self._message(pb.DHT_KIND_REPLY, r)
        elif head.kind == pb.DHT_KIND_FETCH:
            async for reply in self._serve_slice(r, head.slice, head.sender):
                yield reply
        elif head.kind == pb.DHT_KIND_PING:
            yield self._message(pb.DHT_KIND_REPLY, r)
        elif head.kind == pb.DHT_KIND_PARAMS:
            for reply in self._serve_params(r, head.slice, head.num_slices):
                yield reply
        else:
            yield self._message(pb.DHT_KIND_REPLY, r, error=f"unknown request kind {head.kind}")

    async def _serve_slice(self, r: int, s: int, sender: str) -> AsyncIterator[pb.DhtMessage]:
        st = self._round(r)
        limit = self.opts.window_s + 3 * self.opts.exchange_timeout_s  # the round must freeze and merge by then

        def answered() -> bool:
            # The owner answers once merged; another member once it holds the slice or the phase is over.
            return s in st.merged or (st.plan is not None and now() >= st.ag_deadline)

        async with self._cond:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(limit):
                    while not answered():
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(max(0.01, st.ag_deadline - now()) if st.plan else 1.0):
                                await self._cond.wait()
            held = st.merged.get(s)
        if held is None:
            yield self._message(pb.DHT_KIND_REPLY, r, error=f"slice {s} of round {r} is not held here")
            return
        contributors, data, _ = held
        for msg in self._messages(pb.DHT_KIND_REPLY, r, data, slice=s, contributors=list(contributors)):
            yield msg
        async with self._cond:
            st.bytes_up += len(data)
            st.fetched.setdefault(s, set()).add(sender)
            self._cond.notify_all()

    def _serve_params(self, r: int, i: int, n: int) -> list[pb.DhtMessage]:
        """Parameters at the start of round `r`, range `i` of `n`; encoded at once in the event loop, so
        the optimizer cannot step them meanwhile (it steps after `gather` returned, which also ends serving)."""
        if self._params is None or self._params[0] != r or not 0 <= i < n:
            return [self._message(pb.DHT_KIND_REPLY, r, error=f"no parameters of round {r} here")]
        named = self._params[1]()
        sizes = [(name, max(1, t.numel() * t.element_size())) for name, t in named]
        ranges = rules.param_ranges(sizes, n)
        if i >= len(ranges):
            return [self._message(pb.DHT_KIND_REPLY, r, error=f"no parameter range {i} of {n}")]
        wanted = set(ranges[i])
        data = wire_params.encode_parameters([(name, t) for name, t in named if name in wanted], round=r)
        return self._messages(pb.DHT_KIND_REPLY, r, data)
