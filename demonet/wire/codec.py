"""Payload <-> protobuf bytes: `encode` a local payload, `decode` and validate one from a peer.

Wire layer: imports the generated protobuf module, the math layer's dataclasses and the codecs;
never grpc, asyncio or a transport. Layout of every field: proto/demonet.proto.

Tensors that share (h*w, k) travel through the codecs as one batch (`_batch`): per-tensor Python
work is metadata and protobuf fields only, which keeps a 76-tensor payload's encode+decode near 4 ms.

Shape legend: C = chunks of one tensor, K = entries per chunk, R = chunks of a batch, T = its tensors.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from google.protobuf.message import DecodeError

from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload
from demonet.optim.payload import ENCODINGS, Compressed, Payload
from demonet.optim.payload import num_chunks as chunk_count

from ._batch import decode_batch, encode_batch
from ._bits import BadTensor, padding_ok
from ._layout import (
    CODING_NAME,
    CODING_PB,
    DIGEST_BYTES,
    ENCODING_TO_PB,
    PB_TO_ENCODING,
    Layout,
    batches,
    tensor_layout,
    to_numpy,
)
from ._values import VALUE_WIDTH, top_plane_deflate, top_plane_inflate

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
    "decode",
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


# --- decode ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Inbound:
    """One tensor message that passed `_check_meta`, with the bytes of its fields."""

    name: str
    shape: tuple[int, ...]
    chunk: tuple[int, int]
    coding: int
    layout: Layout
    indices: bytes
    values: bytes  # top-plane deflated where `deflated`: `_decode_batch` inflates them
    scales: bytes
    deflated: bool


def _parse(data: bytes, max_bytes: int) -> Any:
    """Size and digest first, then protobuf: nothing is parsed before the digest matched."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidPayload(f"payload should be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_bytes:
        raise InvalidPayload(f"payload of {len(data)} bytes exceeds the cap of {max_bytes}")
    trailer = len(_TRAILER_HEAD) + DIGEST_BYTES
    if len(data) < trailer or data[-trailer:-DIGEST_BYTES] != _TRAILER_HEAD:
        raise InvalidPayload("payload does not end with its digest")
    if hashlib.sha256(data[:-trailer]).digest() != data[-DIGEST_BYTES:]:
        raise InvalidPayload("payload digest mismatch (corrupted or truncated)")
    msg = pb.Payload()
    try:
        msg.ParseFromString(data)
    except DecodeError as e:
        raise InvalidPayload(f"payload is not a demonet.v1.Payload: {e}") from None
    if msg.version != VERSION:
        raise InvalidPayload(f"payload version {msg.version}, this peer reads version {VERSION}")
    if msg.encoding not in PB_TO_ENCODING:
        raise InvalidPayload(f"unknown value encoding {msg.encoding}")
    if len(msg.tensors) > MAX_TENSORS:
        raise InvalidPayload(f"{len(msg.tensors)} tensors exceed the cap of {MAX_TENSORS}")
    return msg


def _check_meta(t: Any, encoding: int, expected: Expected | None, seen: set[str]) -> _Inbound:
    """Everything about one tensor that metadata, byte lengths and padding bits can tell, before any tensor op."""
    name = t.name
    if not name or len(name.encode()) > MAX_NAME_BYTES:
        raise InvalidPayload(f"tensor name {name[:64]!r} should have 1 to {MAX_NAME_BYTES} bytes")
    if name in seen:
        raise InvalidPayload(f"tensor {name!r} appears twice")
    seen.add(name)
    shape = tuple(t.shape)
    static = (name, t.value_encoding, encoding, t.index_coding, shape, t.chunk_h, t.chunk_w, t.k, t.value_coding,
              expected is not None, None if expected is None else expected.get(name))
    try:
        layout, deflated = _static_meta(*static)
    except TypeError:  # an expected (shape, chunk) that is not hashable (lists): checked without the cache
        layout, deflated = _static_meta.__wrapped__(*static)
    where = f"tensor {name!r}"
    indices, values, scales = t.indices, t.values, t.scales  # each access copies the bytes: once
    for field, have, want in (
        ("indices", len(indices), layout.index_bytes),
        ("values", len(values), len(values) if deflated else layout.value_bytes),  # deflated: `_plain` checks
        ("scales", len(scales), layout.scale_bytes),
    ):
        if have != want:
            raise InvalidPayload(
                f"{where}: {field} hold {have} bytes, expected {want} for {layout.num_chunks} chunks x k={layout.k} "
                f"of {layout.n} ({pb.IndexCoding.Name(t.index_coding)}, {PB_TO_ENCODING[encoding]})"
            )
    if not padding_ok(indices, layout.index_bits):
        raise InvalidPayload(
            f"{where}: {CODING_NAME[t.index_coding]} indices: the padding bits of the last byte are not 0")
    if PB_TO_ENCODING[encoding] == "sign" and not padding_ok(values, layout.num_chunks * layout.k):
        raise InvalidPayload(f"{where}: sign values: the padding bits of the last byte are not 0")
    return _Inbound(name, shape, (t.chunk_h, t.chunk_w), t.index_coding, layout, indices, values, scales, deflated)


@functools.lru_cache(maxsize=4096)
def _static_meta(name: str, tensor_encoding: int, encoding: int, coding: int, shape: tuple[int, ...], chunk_h: int,
                 chunk_w: int, k: int, value_coding: int, check_expected: bool,
                 want: tuple[tuple[int, ...], tuple[int, int]] | None) -> tuple[Layout, bool]:
    """The checks of `_check_meta` that the tensor's metadata alone decides (against `want`, the model's
    (shape, chunk) of `name`, where `check_expected`), and the tensor's layout and whether its values are
    deflated. The same metadata arrives every round from every peer: it is checked once (a tensor that
    fails is checked again each time, as nothing is kept of it)."""
    where = f"tensor {name!r}"
    if tensor_encoding != encoding:
        raise InvalidPayload(f"{where}: value encoding {tensor_encoding} differs from the payload's {encoding}")
    if coding not in CODING_NAME:
        raise InvalidPayload(f"{where}: unknown index coding {coding}")
    chunk = (chunk_h, chunk_w)
    if check_expected:
        if want is None:
            raise InvalidPayload(f"{where} is not a parameter of this model")
        want_shape, want_chunk = want
        if shape != tuple(want_shape) or chunk != tuple(want_chunk):
            raise InvalidPayload(
                f"{where}: shape {shape} chunk {chunk}, the model has {tuple(want_shape)} chunk {tuple(want_chunk)}"
            )
    if len(shape) > MAX_DIMS or any(d > 1 << 40 for d in shape):
        raise InvalidPayload(f"{where}: shape {shape[: MAX_DIMS + 1]} is too large")
    n = chunk[0] * chunk[1]
    if chunk[0] < 1 or chunk[1] < 1 or n > MAX_CHUNK_ELEMS:
        raise InvalidPayload(f"{where}: chunk {chunk} should be positive with h*w <= {MAX_CHUNK_ELEMS}")
    if k > n:
        raise InvalidPayload(f"{where}: k={k} exceeds the chunk's {n} coefficients")
    value_encoding = PB_TO_ENCODING[encoding]
    deflated = value_coding == pb.VALUE_CODING_TOP_PLANE_DEFLATE
    if value_coding != pb.VALUE_CODING_PLAIN and not deflated:
        raise InvalidPayload(f"{where}: unknown value coding {value_coding}")
    if deflated and value_encoding not in VALUE_WIDTH:
        raise InvalidPayload(f"{where}: {value_encoding} values have no byte planes to deflate")
    return tensor_layout(coding, value_encoding, shape, chunk, k), deflated


def _plain(t: _Inbound, encoding: str) -> bytes:
    """`t`'s values, inflated where deflated: called only once the payload's entries are within their cap,
    since a DEFLATE stream can stand for about 1,000 times its size."""
    if not t.deflated:
        return t.values
    try:
        return top_plane_inflate(t.values, VALUE_WIDTH[encoding], t.layout.value_bytes)
    except ValueError as e:
        raise InvalidPayload(f"tensor {t.name!r}: values: {e}") from None


def _decode_batch(ts: list[_Inbound], encoding: str) -> tuple[list[Compressed], np.ndarray]:
    """Tensors that share (index coding, n, k), decoded and checked together; and their values, (R, K)."""
    rows = [t.layout.num_chunks for t in ts]
    blobs = [t.indices for t in ts], [_plain(t, encoding) for t in ts], [t.scales for t in ts]
    try:
        idx_RK, val_RK, scale = decode_batch(
            CODING_NAME[ts[0].coding], blobs, encoding, rows, ts[0].layout.k, ts[0].layout.n
        )
    except BadTensor as e:
        raise InvalidPayload(f"tensor {ts[e.tensor].name!r}: {e}") from None
    scales: list[torch.Tensor | None] = [None] * len(ts)
    if scale is not None:  # fp16: one 0-d scale per tensor; int8, sign: (C, 1) per tensor
        scale_t = torch.from_numpy(scale)
        scales = list(scale_t.unbind() if encoding == "fp16" else torch.split(scale_t.view(-1, 1), rows))
    parts = zip(
        ts,
        torch.split(torch.from_numpy(idx_RK), rows),
        torch.split(torch.from_numpy(val_RK), rows),
        scales,
        strict=True,
    )
    return [Compressed(idx=i, val=v, shape=t.shape, chunk=t.chunk, scale=s) for t, i, v, s in parts], val_RK


def decode(
    data: bytes,
    *,
    expected: Expected | None = None,
    max_norm: float | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_entries: int = DEFAULT_MAX_ENTRIES,
) -> tuple[int, Payload]:
    """Validate and deserialize a payload from a peer.

    Every check runs before the payload is returned, and metadata, byte lengths and padding bits
    are checked before any tensor is built; anything wrong raises `InvalidPayload`.

    Args:
        data: a serialized ``demonet.v1.Payload`` as `encode` writes it.
        expected: parameter name -> (shape, chunk) of the model; when given, the payload must hold
            exactly these tensors, with these shapes and chunks, and comes back in this order.
        max_norm: when given, the L2 norm of all values together must not exceed it.
        max_bytes: size cap of `data`.
        max_entries: cap on the (index, value) entries of all tensors together.

    Returns:
        (step, payload): tensors on CPU, `idx` int64, `val` float32 bit-identical to what the
        sender's `quantize` produced. With entropy coding each row comes sorted by index.

    Raises:
        InvalidPayload: with a message naming the first thing wrong.
    """
    msg = _parse(data, max_bytes)
    encoding = PB_TO_ENCODING[msg.encoding]
    seen: set[str] = set()
    inbound = [_check_meta(t, msg.encoding, expected, seen) for t in msg.tensors]
    total = sum(t.layout.num_chunks * max(t.layout.k, 1) for t in inbound)  # chunks count too
    if total > max_entries:
        raise InvalidPayload(f"payload holds {total} entries, more than the cap of {max_entries}")
    missing = [name for name in expected or () if name not in seen]
    if missing:
        raise InvalidPayload(f"payload lacks {len(missing)} of the model's tensors, e.g. {missing[0]!r}")
    decoded: dict[str, Compressed] = {}
    sq = 0.0
    for members in batches([(t.coding, t.layout.n, t.layout.k) for t in inbound]):
        batch = [inbound[i] for i in members]
        cs, val_RK = _decode_batch(batch, encoding)
        decoded.update((t.name, c) for t, c in zip(batch, cs, strict=True))
        if max_norm is not None:
            sq += float(np.square(val_RK, dtype=np.float64).sum())
    if max_norm is not None and not math.sqrt(sq) <= max_norm:
        raise InvalidPayload(f"payload norm {math.sqrt(sq):.4g} exceeds the bound {max_norm:.4g}")
    order = expected if expected is not None else [t.name for t in inbound]  # expected: what aggregate() relies on
    return int(msg.step), Payload(tensors={name: decoded[name] for name in order}, encoding=encoding)
