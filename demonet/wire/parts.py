"""Parts: a serialized message too big for one transport message, cut into `PayloadPart` messages and
put back together.

The one framing of both transports: gRPC streams carry the parts in `SubmitPart`, `AggregateChunk` and
`GetParameters`, DHT streams in `DhtMessage`. The transports parse and embed the `PayloadPart`
messages; nothing here serializes or parses one. Wire layer: imports the generated protobuf module;
never grpc, asyncio or a transport.
"""

from __future__ import annotations

import hashlib

from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload

from ._layout import DIGEST_BYTES
from .codec import DEFAULT_MAX_BYTES

__all__ = ["DEFAULT_PART_BYTES", "MAX_PARTS", "Reassembler", "split"]

DEFAULT_PART_BYTES = 2 << 20
MAX_PARTS = 1 << 16


def split(data: bytes, *, part_bytes: int = DEFAULT_PART_BYTES) -> list[pb.PayloadPart]:
    """Cut a serialized message (what `encode` or `encode_parameters` returned) into ``PayloadPart`` messages.

    Args:
        data: the serialized message.
        part_bytes: data bytes per part (the last may hold fewer); an empty message is one empty part.

    Returns:
        The parts in order; a `Reassembler` takes them in any order.
    """
    if part_bytes < 1:
        raise ValueError(f"part_bytes should be >= 1, got {part_bytes}")
    digest = hashlib.sha256(data).digest()
    count = max(1, -(-len(data) // part_bytes))
    return [
        pb.PayloadPart(
            payload_digest=digest,
            index=i,
            count=count,
            total_bytes=len(data),
            data=data[i * part_bytes : (i + 1) * part_bytes],
        )
        for i in range(count)
    ]


class Reassembler:
    """Collects the parts of one serialized message, in any order, and gives back the whole once complete.

    Every malformed, duplicate or inconsistent part raises `InvalidPayload`; the caller drops the
    transfer (the state is then of no further use).
    """

    def __init__(self, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._max_bytes = max_bytes
        self._digest = b""
        self._count = 0
        self._total = 0
        self._received = 0
        self._parts: dict[int, bytes] = {}
        self._done = False

    def _check_first(self, part: pb.PayloadPart) -> None:
        if len(part.payload_digest) != DIGEST_BYTES:
            raise InvalidPayload(f"part digest of {len(part.payload_digest)} bytes, expected {DIGEST_BYTES}")
        if part.total_bytes > self._max_bytes:
            raise InvalidPayload(f"payload of {part.total_bytes} bytes exceeds the cap of {self._max_bytes}")
        if part.count < 1 or part.count > min(MAX_PARTS, max(1, part.total_bytes)):
            raise InvalidPayload(f"part count {part.count} does not fit {part.total_bytes} bytes")
        self._digest, self._count, self._total = part.payload_digest, part.count, part.total_bytes

    def add(self, part: pb.PayloadPart) -> bytes | None:
        """Take one ``PayloadPart``, as the transport parsed it.

        Returns:
            The whole serialized message when this part completed it (its digest checked), else None.

        Raises:
            InvalidPayload: the part is malformed, repeated, inconsistent with the earlier ones, too
                large, or the completed message does not match its digest.
        """
        if self._done:
            raise InvalidPayload("part after the payload was complete")
        data = part.data  # each access copies the bytes: once
        if len(data) > self._max_bytes:
            raise InvalidPayload(f"part of {len(data)} bytes exceeds the cap of {self._max_bytes}")
        if not self._count:
            self._check_first(part)
        elif (part.payload_digest, part.count, part.total_bytes) != (self._digest, self._count, self._total):
            raise InvalidPayload("part belongs to another payload (digest, count or size differ)")
        if part.index >= self._count:
            raise InvalidPayload(f"part index {part.index} out of range for {self._count} parts")
        if part.index in self._parts:
            raise InvalidPayload(f"part {part.index} arrived twice")
        self._received += len(data)
        if self._received > self._total or (not data and self._total):
            raise InvalidPayload(f"parts hold more than the announced {self._total} bytes, or an empty part")
        self._parts[part.index] = data
        if len(self._parts) < self._count:
            return None
        whole = b"".join(self._parts[i] for i in range(self._count))
        self._parts.clear()
        self._done = True
        if len(whole) != self._total or hashlib.sha256(whole).digest() != self._digest:
            raise InvalidPayload("reassembled payload does not match its size or digest")
        return whole
