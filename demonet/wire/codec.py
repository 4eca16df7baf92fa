"""Payload -> protobuf bytes: `encode` a local payload; the wire format's version, codings and limits.

Wire layer: imports the generated protobuf module, the math layer's dataclasses and the codecs;
never grpc, asyncio or a transport. Layout of every field: proto/demonet.proto. The way back, `decode`,
which validates a payload from a peer against these limits, is demonet.wire.inbound.

Tensors that share (h*w, k) travel through the codecs as one batch (`_batch`): per-tensor Python
work is metadata and protobuf fields only, which keeps a 76-tensor payload's encode+decode near 4 ms.

Shape legend: C = chunks of one tensor, K = entries per chunk, R = chunks of a batch, T = its tensors.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence

import torch

from demonet._proto import demonet_pb2 as pb
from demonet.errors import BadTensor
from demonet.optim.payload import ENCODINGS, Compressed, Payload
from demonet.optim.payload import num_chunks as chunk_count

from ._batch import encode_batch
from ._layout import CODING_PB, DIGEST_BYTES, ENCODING_TO_PB, batches, to_numpy
from ._values import VALUE_WIDTH, top_plane_deflate

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_ENTRIES",
    "INDEX_CODINGS",
    "INLINE_DECODE_BYTES",
    "INLINE_ENCODE_ENTRIES",
    "MAX_CHUNK_ELEMS",
    "MAX_DIMS",
    "MAX_NAME_BYTES",
    "MAX_TENSORS",
    "VALUE_CODINGS",
    "VERSION",
    "Expected",
    "encode",
    "encode_many",
]

logger = logging.getLogger(__name__)

VERSION = 1
INDEX_CODINGS = ("packed", "entropy")
"""``packed``: fixed width ceil(log2(h*w)) bits per index, the sender's order. ``entropy``: sorted
per chunk, Elias-Fano coded (or a bitmap where that is smaller), about 8% over log2(C(4096, 32))."""
VALUE_CODINGS = ("plain", "deflate")
"""``plain``: the values' bytes as their encoding writes them. ``deflate``: fp32, bf16 and fp16 values split
into byte planes, the top plane (sign and high exponent bits) deflated, per tensor of 512 values or more
where that is smaller: lossless, 12% fewer bytes for an fp32 payload and 21% for a bf16 one on the
evidence model (docs/benchmarks.md#deflated-values)."""
DEFAULT_MAX_BYTES = 256 << 20
"""Largest serialized payload accepted (a GPT-2-small payload at k=32 is about 2-4 MB)."""
DEFAULT_MAX_ENTRIES = 1 << 27
"""Most (index, value) entries one payload may decode to (about 1.6 GB of tensors)."""
MAX_TENSORS = 1 << 16
MAX_CHUNK_ELEMS = 1 << 20
MAX_DIMS = 8
MAX_NAME_BYTES = 1024
INLINE_DECODE_BYTES = 1 << 16
"""Messages up to this size are small enough to decode where they arrive, on an event loop (about a
millisecond at 64 kB): a trip to a worker thread, under load, costs more than the decode. A hostile
message packs at most about 4 entries a byte (sign values, every coefficient sent: the embedded default
model's densest payload, 842,496 entries in 214 kB, decodes in 9.4 ms), so one of 64 kB holds the event
loop for about 3 ms at most."""
INLINE_ENCODE_ENTRIES = 1 << 14
"""Payloads of up to this many entries are small enough to encode on an event loop (about a millisecond)."""

_TRAILER_HEAD = pb.Payload(digest=bytes(DIGEST_BYTES)).SerializeToString()[:-DIGEST_BYTES]  # tag, len

Expected = Mapping[str, tuple[tuple[int, ...], tuple[int, int]]]
"""Parameter name -> (shape, chunk) of the model, in the model's order."""


# --- encode ------------------------------------------------------------------------------------


def _check_local(name: str, c: Compressed, encoding: str) -> None:
    """A malformed local payload is a bug in the caller: ValueError, not InvalidPayload.

    Metadata only; `encode_batch` checks the entries of a whole batch at once.
    """
    if c.chunk[0] < 1 or c.chunk[1] < 1 or c.totalk > MAX_CHUNK_ELEMS:
        raise ValueError(f"{name}: chunk {c.chunk} should be positive with h*w <= {MAX_CHUNK_ELEMS}")
    num_chunks, n = chunk_count(c.shape, c.chunk), c.totalk
    if c.idx.dim() != 2 or c.idx.shape[0] != num_chunks or c.val.shape != c.idx.shape:
        raise ValueError(
            f"{name}: idx and val should be ({num_chunks}, k), got {tuple(c.idx.shape)}, {tuple(c.val.shape)}"
        )
    if c.idx.dtype != torch.int64 or c.val.dtype != torch.float32:
        raise ValueError(f"{name}: idx should be int64 and val float32, got {c.idx.dtype}, {c.val.dtype}")
    if c.k > n:
        raise ValueError(f"{name}: indices should be in [0, {n}) with k <= {n}")
    if encoding in ("int8", "sign") and (c.scale is None or c.scale.shape != (num_chunks, 1)):
        raise ValueError(f"{name}: {encoding} needs a ({num_chunks}, 1) scale")
    if encoding == "fp16" and (c.scale is None or c.scale.numel() != 1):
        raise ValueError(f"{name}: fp16 needs a 0-d scale")


def _encode_batch(
    names: list[str], cs: list[Compressed], encoding: str, index_coding: str
) -> list[tuple[int, bytes, bytes, bytes]]:
    """(index coding, indices, values, scales) of tensors that share (n, k), coded together."""
    rows = [int(c.idx.shape[0]) for c in cs]
    idx_RK, val_RK = to_numpy([c.idx for c in cs], torch.int64), to_numpy([c.val for c in cs], torch.float32)
    scale = None  # (T,) for fp16, (R,) for int8 and sign
    if encoding in ("fp16", "int8", "sign"):
        scale = to_numpy([c.scale.reshape(-1) for c in cs if c.scale is not None], torch.float32)
    try:
        codings, *blobs = encode_batch(
            idx_RK, val_RK, scale, encoding, index_coding == "entropy", cs[0].totalk, rows
        )
    except BadTensor as e:
        raise ValueError(f"{names[e.tensor]}: {e}") from None
    return list(zip((CODING_PB[c] for c in codings), *blobs, strict=True))


def encode(payload: Payload, *, step: int, index_coding: str = "entropy", value_coding: str = "deflate") -> bytes:
    """Serialize a payload for the wire.

    Args:
        payload: what `DeMo.compress()` or `aggregate()` returned; `val` float32, on the grid of
            `payload.encoding` (what `quantize` returned), on any device.
        step: the step (round) it belongs to, >= 0.
        index_coding: one of `INDEX_CODINGS`. ``entropy`` (the default: 7.9 bits an index at k = 32 of 4096
            instead of 12, lossless) sends each chunk's entries sorted by index; ``packed`` keeps their order.
        value_coding: one of `VALUE_CODINGS`; ``deflate`` (the default) is lossless and used per tensor only
            where it is smaller.

    Returns:
        A serialized ``demonet.v1.Payload`` ending with its SHA-256 digest.

    Raises:
        ValueError: the payload is malformed (a bug on this side, never a peer's fault).
    """
    return encode_many([payload], step=step, index_coding=index_coding, value_coding=value_coding)[0]


def encode_many(payloads: Sequence[Payload], *, step: int, index_coding: str = "entropy",
                value_coding: str = "deflate") -> list[bytes]:
    """`encode` of each of `payloads` (one encoding for all), the same bytes for each, at the cost of about one.

    The tensors of every payload that share (h*w, k) go through the codecs as one batch: a payload cut
    into slices (`demonet.dht.rules.SlicePlan`) encodes in about the time of the whole one, instead of
    paying the codecs' fixed cost once a slice.

    Raises:
        ValueError: a payload is malformed, or the payloads' encodings differ.
    """
    encodings = {p.encoding for p in payloads}
    if len(encodings) > 1:
        raise ValueError(f"payloads encoded together should share one encoding, got {sorted(encodings)}")
    encoding = encodings.pop() if encodings else ENCODINGS[0]
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding should be one of {ENCODINGS}, got {encoding!r}")
    if index_coding not in INDEX_CODINGS:
        raise ValueError(f"index_coding should be one of {INDEX_CODINGS}, got {index_coding!r}")
    if value_coding not in VALUE_CODINGS:
        raise ValueError(f"value_coding should be one of {VALUE_CODINGS}, got {value_coding!r}")
    if step < 0:
        raise ValueError(f"step should be >= 0, got {step}")
    items = [item for p in payloads for item in p.tensors.items()]
    for name, c in items:
        _check_local(name, c, encoding)
    coded: list[tuple[int, bytes, bytes, bytes]] = [(0, b"", b"", b"")] * len(items)
    for members in batches([(c.totalk, c.k) for _, c in items]):
        names, cs = [items[i][0] for i in members], [items[i][1] for i in members]
        for i, parts in zip(members, _encode_batch(names, cs, encoding, index_coding), strict=True):
            coded[i] = parts
    out, start = [], 0
    for p in payloads:
        end = start + len(p.tensors)
        out.append(_message(items[start:end], coded[start:end], step, encoding, value_coding))
        start = end
    return out


def _message(items: list[tuple[str, Compressed]], coded: list[tuple[int, bytes, bytes, bytes]], step: int,
             encoding: str, value_coding: str) -> bytes:
    """One payload's ``demonet.v1.Payload`` from its tensors' coded blobs, with its SHA-256 trailer."""
    msg = pb.Payload(version=VERSION, step=step, encoding=ENCODING_TO_PB[encoding])
    width = VALUE_WIDTH.get(encoding, 0) if value_coding == "deflate" else 0
    for (name, c), (coding, indices, values, scales) in zip(items, coded, strict=True):
        deflated = top_plane_deflate(values, width) if width else None
        msg.tensors.add(
            name=name,
            shape=c.shape,
            chunk_h=c.chunk[0],
            chunk_w=c.chunk[1],
            k=c.k,
            index_coding=coding,
            indices=indices,
            value_encoding=msg.encoding,
            values=values if deflated is None else deflated,
            scales=scales,
            value_coding=pb.VALUE_CODING_PLAIN if deflated is None else pb.VALUE_CODING_TOP_PLANE_DEFLATE,
        )
    body = msg.SerializeToString()
    logger.debug("encoded step %d: %d tensors, %d bytes", step, len(msg.tensors), len(body))
    return body + _TRAILER_HEAD + hashlib.sha256(body).digest()
