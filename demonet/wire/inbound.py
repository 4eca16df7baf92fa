"""Protobuf bytes -> payload: `decode` validates a payload from a peer, every check before any tensor op.

Wire layer: imports the generated protobuf module, the math layer's dataclasses, the codecs and the limits
of demonet.wire.codec; never grpc, asyncio or a transport. Shape legend: R = chunks of a batch, K = entries per chunk.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from google.protobuf.message import DecodeError

from demonet._proto import demonet_pb2 as pb
from demonet.errors import BadTensor, InvalidPayload
from demonet.optim.payload import Compressed, Payload

from ._batch import decode_batch
from ._bits import padding_ok
from ._layout import CODING_NAME, DIGEST_BYTES, PB_TO_ENCODING, Layout, batches, tensor_layout
from ._values import VALUE_WIDTH, top_plane_inflate
from .codec import (
    _TRAILER_HEAD,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRIES,
    MAX_CHUNK_ELEMS,
    MAX_DIMS,
    MAX_NAME_BYTES,
    MAX_TENSORS,
    VERSION,
    Expected,
)

__all__ = ["decode"]


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
