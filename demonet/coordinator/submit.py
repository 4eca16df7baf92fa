"""The coordinator's Submit call: one peer's payload for a round, read from its stream, checked and counted.

A mixin of `demonet.coordinator.server.CoordinatorServicer` (the servicer holds the state it uses). A
stream's first part is checked before the rest is read (the signature, the round, the size, the peer's
slot); the payload is decoded as soon as it is whole. An overlapped peer may send its payload for the
next round while the open round runs (`digest_follows`): its parameter digest comes in the stream's last
message, once the peer has applied the open round, and the payload is counted once its round has opened
and that digest is checked. See proto/demonet.proto (SubmitPart).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload
from demonet.optim import Payload
from demonet.wire.identity import submit_statement
from demonet.wire.merge import decode_contribution

from .handlers import Malformed, StreamEnd, parts_until
from .identities import NotJoined
from .limits import Busy
from .rounds import SubmitRejected

if TYPE_CHECKING:
    from .server import CoordinatorServicer

__all__ = ["Submissions"]

logger = logging.getLogger(__name__)

_REFUSALS = {"stale": pb.REFUSAL_STALE, "future": pb.REFUSAL_FUTURE, "not_member": pb.REFUSAL_NOT_MEMBER,
             "duplicate": pb.REFUSAL_DUPLICATE}


def _now() -> float:
    return time.monotonic()


class Submissions:
    """The Submit RPC of `CoordinatorServicer`, and the refusals and resyncs it counts."""

    async def Submit(self: CoordinatorServicer, request_iterator: AsyncIterator[pb.SubmitPart],
                     context: grpc.aio.ServicerContext[Any, Any]) -> pb.SubmitReply:
        await self._authorize(context)
        began = time.perf_counter()  # the stream's start: its bytes over its duration are the sender's link speed
        head: pb.SubmitPart | None = None
        last: pb.SubmitPart | None = None  # the parameter digest, when it follows the payload
        reassembler = wire.Reassembler(max_bytes=self.limits.cfg.max_submission_bytes)
        data: bytes | None = None
        payload: Payload | None = None
        stream_s = 0.0
        ends = StreamEnd(asyncio.get_running_loop().time() + self._wait_s)
        try:
            async for part in parts_until(request_iterator, ends):
                if isinstance(part, Malformed):
                    raise InvalidPayload(str(part))
                if head is None:
                    head = part
                    refused = await self._first_part(head, ends, context)
                    if refused is not None:
                        return refused
                elif (part.peer_id, part.round) != (head.peer_id, head.round):
                    raise InvalidPayload("parts of one submission name different peers or rounds")
                if data is None:
                    data = reassembler.add(part.part)
                    if data is not None:  # whole: decode it now, before a digest that follows arrives
                        stream_s = time.perf_counter() - began
                        # A small payload is decoded here: a trip to a worker thread would cost more than the decode.
                        decode = functools.partial(decode_contribution, data, expected=self.state.specs,
                                                   rules=self.state.rules)
                        step, payload = (decode() if len(data) <= wire.INLINE_DECODE_BYTES
                                         else await asyncio.to_thread(decode))
                        if step != head.round:
                            raise InvalidPayload(f"payload says round {step}, submission says {head.round}")
                elif head.digest_follows and last is None and not part.HasField("part") and part.param_digest:
                    last = part
                else:
                    raise InvalidPayload("a message after the payload was complete"
                                         + (" and its digest" if last is not None else ""))
            if head is None or data is None or payload is None:
                raise InvalidPayload("the submission ended before its payload was complete")
            if head.digest_follows and last is None:
                raise InvalidPayload("the submission ended before the parameter digest that was to follow it")
        except InvalidPayload as e:
            self.metrics.add("rejected")
            self.metrics.refused(head.peer_id if head else "", head.round if head else None, "invalid", str(e))
            logger.warning("[coordinator round=%d] rejected a payload from %s: %s", self.rounds.round,
                           head.peer_id if head else "?", e)
            return pb.SubmitReply(accepted=False, reason=f"invalid payload: {e}", refusal=pb.REFUSAL_INVALID,
                                  open_round=self.rounds.round)
        except TimeoutError:  # its round closed (or its deadline passed) while the payload was arriving
            assert head is not None  # the stream's deadline is set at its first part
            return self._refused(SubmitRejected(f"round {head.round} closed before the payload was complete",
                                                "stale"), head.peer_id, head.round, b"")
        finally:
            if head is not None:
                self.limits.slots.release(head.peer_id, head.round, ends)
        param_digest = head.param_digest
        if last is not None:
            refused = await self._check_signature(head, last.signature, last.param_digest, context)
            if refused is not None:
                return refused
            param_digest = last.param_digest
        async with self.cond:
            await self._wait(lambda: self.rounds.round >= head.round and self._applied(), self._wait_s, context,
                             f"round {head.round} to open and round {head.round - 1} to be applied")
            if param_digest != self.state.digest and head.round == self.rounds.round:
                self._resynced(head.peer_id, head.round, f"it submitted with digest {param_digest[:12]}, "
                               f"the canonical one is {self.state.digest[:12]}")
                self.metrics.refused(head.peer_id, head.round, "resync", "parameter digest differs from the "
                                     "canonical one")
                return pb.SubmitReply(accepted=False, resync=True, refusal=pb.REFUSAL_RESYNC,
                                      reason="parameter digest differs from the canonical one",
                                      open_round=self.rounds.round)
            try:
                self.rounds.submit(head.peer_id, head.round, _now())
            except SubmitRejected as e:
                return self._refused(e, head.peer_id, head.round, head.part.payload_digest)
            self.payloads[head.peer_id] = payload
            self.accepted_digests[head.peer_id] = head.part.payload_digest
            self.losses[head.peer_id] = head.loss
            self.metrics.uploaded(head.peer_id, len(data), stream_s, head.loss)
            self.metrics.set_round(self.rounds.round, len(self.rounds.members), len(self.rounds.submitted))
            self.cond.notify_all()
        return pb.SubmitReply(accepted=True, open_round=self.rounds.round)

    async def _first_part(self: CoordinatorServicer, head: pb.SubmitPart, ends: StreamEnd,
                          context: grpc.aio.ServicerContext[Any, Any]) -> pb.SubmitReply | None:
        """Check a stream's first part before the rest is read; a refusal to answer with, or None (go on)."""
        await self._peer_id(head.peer_id, context)
        if head.digest_follows and head.param_digest:
            raise InvalidPayload("the first part carries a parameter digest although it was to follow")
        refused = await self._check_signature(head, head.signature, head.param_digest, context)
        if refused is not None:
            return refused
        try:  # refuse before reading (and decoding) the rest of the stream
            self.rounds.check_submit(head.peer_id, head.round, early=head.digest_follows)
        except SubmitRejected as e:
            return self._refused(e, head.peer_id, head.round, head.part.payload_digest)
        return self._open_stream(head, ends)

    async def _check_signature(self: CoordinatorServicer, head: pb.SubmitPart, signature: bytes, param_digest: str,
                               context: grpc.aio.ServicerContext[Any, Any]) -> pb.SubmitReply | None:
        """Check a Submit's signature over its statement with `param_digest` (the first part's, or the one
        that followed the payload): a refusal when the peer's key has no session (join first), None when
        it holds; a bad signature aborts the call (PERMISSION_DENIED)."""
        try:
            await self._signed(head.peer_id, signature, submit_statement(
                self.identities.session(head.peer_id) or b"", head.peer_id, head.round, head.part.payload_digest,
                param_digest, head.loss), context)
        except NotJoined as e:
            return self._refused(SubmitRejected(f"{e}: join the run first", "not_member"), head.peer_id, head.round,
                                 b"")
        return None

    def _open_stream(self: CoordinatorServicer, head: pb.SubmitPart, ends: StreamEnd) -> pb.SubmitReply | None:
        """At a Submit's first part: refuse a size no valid payload has (INVALID), or a second stream of the
        peer for the round or one over the bytes in flight (BUSY); else reserve the peer's slot until `ends`:
        its round's deadline and a grace (for the next round's stream: a round timeout after the open
        round's deadline, as late as the next round's can be)."""
        r, timeout_s = self.rounds, self.cfg.net.round_timeout_s
        invalid = self.limits.check_size(head.part.total_bytes)
        if invalid is not None:
            raise InvalidPayload(invalid)
        try:
            self.limits.slots.open(head.peer_id, head.round, head.part.total_bytes, ends)
        except Busy as e:
            self.metrics.refused(head.peer_id, head.round, "busy", str(e))
            return pb.SubmitReply(accepted=False, reason=str(e), refusal=pb.REFUSAL_BUSY, open_round=r.round)
        ahead = max(0, head.round - r.round)
        deadline = self.limits.stream_deadline(r.deadline + ahead * timeout_s, r.started, _now(),
                                               (1 + ahead) * timeout_s)
        ends.at = asyncio.get_running_loop().time() + (deadline - _now())
        return None

    def _resynced(self: CoordinatorServicer, peer_id: str, round: int, why: str) -> None:
        """Count and log one resync: a member whose parameters differ from the canonical ones downloads
        them whole, the dense transfer the compressed rounds exist to avoid. A peer finds the difference
        after applying an aggregate (its GetParameters says so) or is told at its next Submit; either
        way the download happens once and is counted once."""
        if self.resynced_at.get(peer_id) == round:
            return  # the same call again (the client retries a call that timed out or lost its connection)
        self.resynced_at[peer_id] = round
        self.metrics.add("resyncs", peer=peer_id)
        logger.warning("[coordinator round=%d] %s resyncs at round %d (resync %d of the run): %s; it downloads "
                       "the whole parameters", self.rounds.round, peer_id, round, self.metrics.totals["resyncs"],
                       why)

    def _refused(self: CoordinatorServicer, e: SubmitRejected, peer_id: str, round: int,
                 digest: bytes) -> pb.SubmitReply:
        if e.kind == "duplicate" and self.accepted_digests.get(peer_id) != digest:
            reason = f"another payload from {peer_id} for round {round} is already in"
            self.metrics.refused(peer_id, round, "conflict", reason)
            return pb.SubmitReply(accepted=False, reason=reason, refusal=pb.REFUSAL_INVALID,
                                  open_round=self.rounds.round)
        if e.stale:
            self.metrics.add("late")
        self.metrics.refused(peer_id, round, e.kind, e.reason)
        return pb.SubmitReply(accepted=False, reason=e.reason, refusal=_REFUSALS[e.kind], open_round=self.rounds.round)
