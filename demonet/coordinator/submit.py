"""The coordinator's Submit call: one peer's payload for a round, read from its stream, checked, and handed to
the round core to be counted.

`SubmitReader` is owned by the gRPC servicer, which passes it the core, the admission checks and the limits;
it imports neither the servicer nor grpc's method table. A stream's first part is checked before the rest is
read (the signature, the round, the size, the peer's slot); the payload is decoded as soon as it is whole.
An overlapped peer may send its payload for the next round while the open round runs (`digest_follows`):
its parameter digest comes in the stream's last message, once the peer has applied the open round, and the
payload is counted once its round has opened and that digest is checked. See proto/demonet.proto (SubmitPart).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.errors import Busy, InvalidPayload, NotJoined, PeerUnavailable, Refusal, SubmitRejected
from demonet.optim import Payload
from demonet.wire.identity import submit_statement
from demonet.wire.merge import check_samples, decode_contribution
from demonet.wire.pace import MAX_MICRO_BATCHES, MOST_S, valid_report, valid_work

from .admission import Admission, caller_address
from .core import RoundCore
from .limits import Limits
from .parts import Malformed, StreamEnd, parts_until
from .terms import LATE_ROUNDS, Submission

__all__ = ["REFUSALS", "SubmitReader"]

logger = logging.getLogger(__name__)

REFUSALS = {Refusal.STALE: pb.REFUSAL_STALE, Refusal.FUTURE: pb.REFUSAL_FUTURE,
            Refusal.NOT_MEMBER: pb.REFUSAL_NOT_MEMBER, Refusal.DUPLICATE: pb.REFUSAL_DUPLICATE,
            Refusal.CONFLICT: pb.REFUSAL_INVALID, Refusal.INVALID: pb.REFUSAL_INVALID,
            Refusal.RESYNC: pb.REFUSAL_RESYNC, Refusal.BUSY: pb.REFUSAL_BUSY}
"""The core's refusals as the wire says them (a conflicting second payload is an invalid one there)."""


def _now() -> float:
    return time.monotonic()


def _reply(e: SubmitRejected, open_round: int) -> pb.SubmitReply:
    """A refused submission as the wire answers it."""
    reason = e.reason
    return pb.SubmitReply(accepted=False, reason=reason, refusal=REFUSALS[e.kind], open_round=open_round,
                          resync=e.kind == Refusal.RESYNC)


class SubmitReader:
    """Reads Submit streams and hands their payloads to the round core.

    Args:
        core: the round core that counts them.
        admission: the token and signature checks.
        limits: the size bound, the peers' stream slots and the bytes in flight.
    """

    def __init__(self, core: RoundCore, admission: Admission, limits: Limits) -> None:
        self.core, self.admission, self.limits = core, admission, limits

    async def submit(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
                     ) -> pb.SubmitReply:
        """The Submit call: refused as early as can be, else counted (or refused) by the core.

        Before its first message is read, a call counts against the open Submit calls in total and from its
        address (`StreamCount`): over its address's share, or over the total while every open call is sending, it
        is refused BUSY without reading anything; over the total, it takes the place of the oldest call that has
        sent no part yet."""
        await self.admission.authorize(context)
        address = caller_address(context)
        ends = StreamEnd(asyncio.get_running_loop().time() + self.limits.cfg.first_part_s)
        try:
            token = self.limits.streams.enter(address, ends.end_now)
        except Busy as e:
            self.core.metrics.refused("", None, "busy", str(e))
            return _reply(SubmitRejected(str(e), Refusal.BUSY), self.core.rounds.round)
        try:
            return await self._read(request_iterator, context, ends, token)
        finally:
            self.limits.streams.leave(address, token)

    async def _read(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any],
                    ends: StreamEnd, token: int) -> pb.SubmitReply:
        """One Submit stream (`_read_stream`); from its checked first part to its end, the open round it is for
        waits for it (`RoundCore.stream_began`)."""
        incoming: list[str] = []
        try:
            return await self._read_stream(request_iterator, context, incoming, ends, token)
        finally:
            if incoming:
                await self.core.stream_ended(incoming[0])

    async def _read_stream(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any],
                           incoming: list[str], ends: StreamEnd, token: int) -> pb.SubmitReply:
        """One Submit stream, read part by part (its first within `first_part_s`), then handed to the core."""
        core = self.core
        began = time.perf_counter()  # the stream's start: its bytes over its duration are the sender's link speed
        head: pb.SubmitPart | None = None
        last: pb.SubmitPart | None = None  # the parameter digest, when it follows the payload
        reassembler = wire.Reassembler(max_bytes=self.limits.cfg.max_submission_bytes)
        data: bytes | None = None
        payload: Payload | None = None
        stream_s = 0.0
        try:
            async for part in parts_until(request_iterator, ends):
                if isinstance(part, Malformed):
                    raise InvalidPayload(str(part))
                if head is None:
                    head = part
                    self.limits.streams.started(token)
                    await self._first_part(head, ends, context)
                    incoming.append(head.peer_id)
                    core.stream_began(head.peer_id, head.round)
                elif (part.peer_id, part.round) != (head.peer_id, head.round):
                    raise InvalidPayload("parts of one submission name different peers or rounds")
                if data is None:
                    data = reassembler.add(part.part)
                    if data is not None:  # whole: decode it now, before a digest that follows arrives
                        stream_s = time.perf_counter() - began
                        # A small payload is decoded here: a trip to a worker thread would cost more than the decode.
                        decode = functools.partial(decode_contribution, data, expected=core.state.specs,
                                                   rules=core.state.rules)
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
            param_digest = head.param_digest
            if last is not None:
                await self._check_signature(head, last.signature, last.param_digest, context)
                param_digest = last.param_digest
        except InvalidPayload as e:
            refused = core.inbox.invalid(head.peer_id if head else "", head.round if head else None, str(e))
            return _reply(refused, core.rounds.round)
        except SubmitRejected as e:  # counted where it was raised
            return _reply(e, core.rounds.round)
        except TimeoutError:  # its round closed (or its deadline passed) while the payload was arriving
            if head is None:  # no first part within the stream's first deadline: nothing was read
                nothing = core.inbox.invalid("", None, f"no part came within {self.limits.cfg.first_part_s:g} s "
                                             "of the stream's start")
                return _reply(nothing, core.rounds.round)
            stale = SubmitRejected(f"round {head.round} closed before the payload was complete", Refusal.STALE)
            return _reply(core.inbox.refuse(stale, head.peer_id, head.round, b""), core.rounds.round)
        finally:
            if head is not None:
                self.limits.slots.release(head.peer_id, head.round, ends)
        try:
            open_round = await core.submit(Submission(
                peer_id=head.peer_id, round=head.round, payload=payload, payload_digest=head.part.payload_digest,
                param_digest=param_digest, loss=head.loss, size=len(data), stream_s=stream_s,
                samples=int(head.samples), need_s=head.need_s, least_s=head.least_s, train_s=head.train_s,
                micro_batches=head.micro_batches, compute_s=head.compute_s,
                late=0 if head.digest_follows else LATE_ROUNDS))
        except SubmitRejected as e:
            return _reply(e, core.rounds.round)
        except PeerUnavailable as e:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        self.admission.identities.contributed.add(head.peer_id)  # no newcomer: it stays bound
        return pb.SubmitReply(accepted=True, open_round=open_round)

    async def _first_part(self, head: pb.SubmitPart, ends: StreamEnd,
                          context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Check a stream's first part before the rest is read: its peer id, its signature, its round, its size.

        Raises:
            InvalidPayload, SubmitRejected: refused (counted).
        """
        await self.admission.peer_id(head.peer_id, context)
        if head.digest_follows and head.param_digest:
            raise InvalidPayload("the first part carries a parameter digest although it was to follow")
        await self._check_signature(head, head.signature, head.param_digest, context)
        check_samples(head.samples, self.core.cfg.net.max_samples_per_round)
        if not valid_report(head.need_s, head.least_s, head.train_s):
            raise InvalidPayload(f"need_s, least_s and train_s should be seconds between 0 and {MOST_S:g}, got "
                                 f"{head.need_s!r}, {head.least_s!r} and {head.train_s!r}")
        if not valid_work(head.micro_batches, head.compute_s):
            raise InvalidPayload(f"micro_batches should be at most {MAX_MICRO_BATCHES} and compute_s seconds between 0 "
                                 f"and {MOST_S:g}, got {head.micro_batches} and {head.compute_s!r}")
        # refuse before reading (and decoding) the rest of the stream
        self.core.inbox.check(head.peer_id, head.round, head.part.payload_digest, early=head.digest_follows,
                              late=0 if head.digest_follows else LATE_ROUNDS)
        self._open_stream(head, ends)

    async def _check_signature(self, head: pb.SubmitPart, signature: bytes, param_digest: str,
                               context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Check a Submit's signature over its statement with `param_digest` (the first part's, or the one
        that followed the payload); a bad signature aborts the call (PERMISSION_DENIED).

        Raises:
            SubmitRejected: NOT_MEMBER, the peer's key has no session (join first).
        """
        try:
            await self.admission.signed(head.peer_id, signature, submit_statement(
                self.admission.session(head.peer_id) or b"", head.peer_id, head.round, head.part.payload_digest,
                param_digest, head.loss, head.samples, head.need_s, head.least_s, head.train_s), context)
        except NotJoined as e:
            raise self.core.inbox.refuse(SubmitRejected(f"{e}: join the run first", Refusal.NOT_MEMBER), head.peer_id,
                                   head.round, b"") from None

    def _open_stream(self, head: pb.SubmitPart, ends: StreamEnd) -> None:
        """At a Submit's first part: refuse a size no valid payload has (INVALID), or a second stream of the
        peer for the round or one over the bytes in flight (BUSY); else reserve the peer's slot until `ends`:
        its round's deadline and a grace (for the next round's stream: a round timeout after the open
        round's deadline, as late as the next round's can be)."""
        r, timeout_s = self.core.rounds, self.core.cfg.net.round_timeout_s
        invalid = self.limits.check_size(head.part.total_bytes)
        if invalid is not None:
            raise InvalidPayload(invalid)
        try:
            self.limits.slots.open(head.peer_id, head.round, head.part.total_bytes, ends)
        except Busy as e:
            self.core.metrics.refused(head.peer_id, head.round, "busy", str(e))
            raise SubmitRejected(str(e), Refusal.BUSY) from None
        ahead = max(0, head.round - r.round)
        deadline = self.limits.stream_deadline(r.deadline + ahead * timeout_s, r.started, _now(),
                                               (1 + ahead) * timeout_s)
        ends.at = asyncio.get_running_loop().time() + (deadline - _now())
