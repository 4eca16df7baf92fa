"""The wire format: `Payload` <-> protobuf bytes, validation of inbound bytes, parts, byte accounting.

The only module that imports protobuf (`demonet._proto`). Imports the math layer's dataclasses;
never grpc, asyncio or a transport. Layout of every field: proto/demonet.proto.

Shape legend: C = chunks of one tensor, K = entries per chunk, R = runs of equal indices in a row
(at most K, plus one unused slot), B = bytes.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from google.protobuf.message import DecodeError

from . import _codec
from ._proto import demonet_pb2 as pb
from .errors import InvalidPayload
from .optim.payload import ENCODINGS, Compressed, Payload, matrix_shape

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_PART_BYTES",
    "INDEX_CODINGS",
    "MAX_CHUNK_ELEMS",
    "MAX_DIMS",
    "MAX_NAME_BYTES",
    "MAX_PARTS",
    "MAX_TENSORS",
    "VERSION",
    "Expected",
    "Reassembler",
    "decode",
    "encode",
    "index_bits_report",
    "payload_bytes",
    "split",
]

logger = logging.getLogger(__name__)

VERSION = 1
INDEX_CODINGS = ("packed", "entropy")
"""``packed``: fixed width ceil(log2(h*w)) bits per index, the sender's order. ``entropy``: sorted
per chunk, Elias-Fano coded (or a bitmap where that is smaller), about 8% over log2(C(4096, 32))."""
DEFAULT_PART_BYTES = 2 << 20
DEFAULT_MAX_BYTES = 256 << 20
"""Largest serialized payload accepted (a GPT-2-small payload at k=32 is about 2-4 MB)."""
DEFAULT_MAX_ENTRIES = 1 << 27
"""Most (index, value) entries one payload may decode to (about 1.6 GB of tensors)."""
MAX_TENSORS = 1 << 16
MAX_PARTS = 1 << 16
MAX_CHUNK_ELEMS = 1 << 20
MAX_DIMS = 8
MAX_NAME_BYTES = 1024

_DIGEST_BYTES = 32
_TRAILER_HEAD = pb.Payload(digest=bytes(_DIGEST_BYTES)).SerializeToString()[:-_DIGEST_BYTES]  # tag, len
# Protobuf enum values are typed Any here: the generated stubs give each enum its own int subclass.
_ENCODING_TO_PB: dict[str, Any] = {e: pb.ValueEncoding.Value(f"VALUE_ENCODING_{e.upper()}") for e in ENCODINGS}
_PB_TO_ENCODING: dict[int, str] = {v: k for k, v in _ENCODING_TO_PB.items()}
_PACKED: Any = pb.INDEX_CODING_PACKED
_ELIAS_FANO: Any = pb.INDEX_CODING_ELIAS_FANO
_BITMAP: Any = pb.INDEX_CODING_BITMAP

Expected = Mapping[str, tuple[tuple[int, ...], tuple[int, int]]]
"""Parameter name -> (shape, chunk) of the model, in the model's order."""


@dataclass(frozen=True, slots=True)
class _Layout:
    """What one tensor's message must hold, from its metadata alone (no tensor op)."""

    num_chunks: int
    k: int
    n: int
    index_bytes: int
    value_bytes: int
    scale_bytes: int


def _num_chunks(shape: tuple[int, ...], chunk: tuple[int, int]) -> int:
    rows, cols = matrix_shape(shape)
    return -(-rows // chunk[0]) * -(-cols // chunk[1])


def _index_bits(coding: int, num_chunks: int, k: int, n: int) -> int:
    if coding == _PACKED:
        return num_chunks * k * _codec.index_width(n)
    if coding == _ELIAS_FANO:
        return num_chunks * _codec.ef_chunk_bits(n, k)
    return num_chunks * n  # bitmap


def _layout(coding: int, encoding: str, shape: tuple[int, ...], chunk: tuple[int, int], k: int) -> _Layout:
    num_chunks, n = _num_chunks(shape, chunk), chunk[0] * chunk[1]
    value_bytes, scale_bytes = _codec.value_sizes(encoding, num_chunks, k)
    index_bytes = _codec.num_bytes(_index_bits(coding, num_chunks, k, n))
    return _Layout(num_chunks, k, n, index_bytes, value_bytes, scale_bytes)


# --- encode ------------------------------------------------------------------------------------


def _check_local(name: str, c: Compressed, encoding: str) -> None:
    """A malformed local payload is a bug in the caller: ValueError, not InvalidPayload."""
    if c.chunk[0] < 1 or c.chunk[1] < 1 or c.totalk > MAX_CHUNK_ELEMS:
        raise ValueError(f"{name}: chunk {c.chunk} should be positive with h*w <= {MAX_CHUNK_ELEMS}")
    num_chunks, n = _num_chunks(c.shape, c.chunk), c.totalk
    if c.idx.dim() != 2 or c.idx.shape[0] != num_chunks or c.val.shape != c.idx.shape:
        raise ValueError(
            f"{name}: idx and val should be ({num_chunks}, k), got {tuple(c.idx.shape)}, {tuple(c.val.shape)}"
        )
    if c.idx.dtype != torch.int64 or c.val.dtype != torch.float32:
        raise ValueError(f"{name}: idx should be int64 and val float32, got {c.idx.dtype}, {c.val.dtype}")
    if c.k > n or (c.idx.numel() and (int(c.idx.min()) < 0 or int(c.idx.max()) >= n)):
        raise ValueError(f"{name}: indices should be in [0, {n}) with k <= {n}")
    if encoding in ("int8", "sign") and (c.scale is None or c.scale.shape != (num_chunks, 1)):
        raise ValueError(f"{name}: {encoding} needs a ({num_chunks}, 1) scale")
    if encoding == "fp16" and (c.scale is None or c.scale.numel() != 1):
        raise ValueError(f"{name}: fp16 needs a 0-d scale")
    # NaN or Inf here means the momentum is already poisoned: a bug to crash on, not to send.
    if not bool(torch.isfinite(c.val).all()):
        raise ValueError(f"{name}: val holds NaN or Inf")
    if c.scale is not None and encoding in ("fp16", "int8", "sign"):
        scale = c.scale.detach().cpu().to(torch.float32)
        ok = bool((torch.isfinite(scale) & (scale >= 0)).all())
        if encoding == "fp16":
            ok = ok and float(scale) > 0 and math.frexp(float(scale))[0] == 0.5
        if not ok:
            raise ValueError(f"{name}: {encoding} scale {scale.flatten()[:4].tolist()} is not what quantize returns")


def _choose_entropy(idx_CK: torch.Tensor, n: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(Elias-Fano or bitmap, whichever is smaller, row-sorted indices, the sort's order)."""
    sorted_CK, order_CK = torch.sort(idx_CK, dim=1, stable=True)
    k = idx_CK.shape[1]
    # A bitmap cannot hold an index twice (an aggregate's zero padding may repeat one).
    use_bitmap = n < _codec.ef_chunk_bits(n, k) and not _codec.has_repeats(sorted_CK)
    return (_BITMAP if use_bitmap else _ELIAS_FANO), sorted_CK, order_CK


def _encode_indices(
    idx_CK: torch.Tensor, val_CK: torch.Tensor, n: int, index_coding: str
) -> tuple[int, bytes, torch.Tensor]:
    """(coding, index bytes, values in the order the indices travel)."""
    if index_coding == "packed":
        return _PACKED, _codec.encode_packed(idx_CK, n), val_CK
    coding, sorted_CK, order_CK = _choose_entropy(idx_CK, n)
    val_CK = val_CK.gather(1, order_CK)
    if coding == _BITMAP:
        return _BITMAP, _codec.encode_bitmap(sorted_CK, n), val_CK
    return _ELIAS_FANO, _codec.encode_elias_fano(sorted_CK, n), val_CK


def _encode_tensor(msg: Any, name: str, c: Compressed, encoding: str, index_coding: str) -> None:
    _check_local(name, c, encoding)
    idx_CK, val_CK = c.idx.detach().cpu(), c.val.detach().cpu()
    coding, index_data, val_CK = _encode_indices(idx_CK, val_CK, c.totalk, index_coding)
    values, scales = _codec.encode_values(val_CK, c.scale, encoding)
    # Error feedback is exact only if receivers decode the very bits the sender subtracted.
    back_CK, _ = _codec.decode_values(values, scales, encoding, *val_CK.shape)
    if not torch.equal(back_CK.view(torch.int32), val_CK.contiguous().view(torch.int32)):
        raise ValueError(f"{name}: val is not on the {encoding} grid; pass what quantize() returned")
    msg.name = name
    msg.shape.extend(c.shape)
    msg.chunk_h, msg.chunk_w = c.chunk
    msg.k = c.k
    msg.index_coding = coding
    msg.indices = index_data
    msg.value_encoding = _ENCODING_TO_PB[encoding]
    msg.values = values
    msg.scales = scales


def encode(payload: Payload, *, step: int, index_coding: str = "packed") -> bytes:
    """Serialize a payload for the wire.

    Args:
        payload: what `DeMo.compress()` or `aggregate()` returned; `val` float32, on the grid of
            `payload.encoding` (what `quantize` returned), on any device.
        step: the step (round) it belongs to, >= 0.
        index_coding: one of `INDEX_CODINGS`. ``entropy`` sends each chunk's entries sorted by index.

    Returns:
        A serialized ``demonet.v1.Payload`` ending with its SHA-256 digest.

    Raises:
        ValueError: the payload is malformed (a bug on this side, never a peer's fault).
    """
    if payload.encoding not in ENCODINGS:
        raise ValueError(f"encoding should be one of {ENCODINGS}, got {payload.encoding!r}")
    if index_coding not in INDEX_CODINGS:
        raise ValueError(f"index_coding should be one of {INDEX_CODINGS}, got {index_coding!r}")
    if step < 0:
        raise ValueError(f"step should be >= 0, got {step}")
    msg = pb.Payload(version=VERSION, step=step, encoding=_ENCODING_TO_PB[payload.encoding])
    for name, c in payload.tensors.items():
        _encode_tensor(msg.tensors.add(), name, c, payload.encoding, index_coding)
    body = msg.SerializeToString()
    logger.debug("encoded step %d: %d tensors, %d bytes, %s indices", step, len(msg.tensors), len(body), index_coding)
    return body + _TRAILER_HEAD + hashlib.sha256(body).digest()


# --- decode ------------------------------------------------------------------------------------


def _parse(data: bytes, max_bytes: int) -> Any:
    """Size and digest first, then protobuf: nothing is parsed before the digest matched."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidPayload(f"payload should be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_bytes:
        raise InvalidPayload(f"payload of {len(data)} bytes exceeds the cap of {max_bytes}")
    trailer = len(_TRAILER_HEAD) + _DIGEST_BYTES
    if len(data) < trailer or data[-trailer:-_DIGEST_BYTES] != _TRAILER_HEAD:
        raise InvalidPayload("payload does not end with its digest")
    if hashlib.sha256(data[:-trailer]).digest() != data[-_DIGEST_BYTES:]:
        raise InvalidPayload("payload digest mismatch (corrupted or truncated)")
    msg = pb.Payload()
    try:
        msg.ParseFromString(data)
    except DecodeError as e:
        raise InvalidPayload(f"payload is not a demonet.v1.Payload: {e}") from None
    if msg.version != VERSION:
        raise InvalidPayload(f"payload version {msg.version}, this peer reads version {VERSION}")
    if msg.encoding not in _PB_TO_ENCODING:
        raise InvalidPayload(f"unknown value encoding {msg.encoding}")
    if len(msg.tensors) > MAX_TENSORS:
        raise InvalidPayload(f"{len(msg.tensors)} tensors exceed the cap of {MAX_TENSORS}")
    return msg


def _check_meta(t: Any, encoding: int, expected: Expected | None, seen: set[str]) -> _Layout:
    """Everything about one tensor that metadata and byte lengths can tell, before any tensor op."""
    name = t.name
    if not name or len(name.encode()) > MAX_NAME_BYTES:
        raise InvalidPayload(f"tensor name {name[:64]!r} should have 1 to {MAX_NAME_BYTES} bytes")
    if name in seen:
        raise InvalidPayload(f"tensor {name!r} appears twice")
    seen.add(name)
    where = f"tensor {name!r}"
    if t.value_encoding != encoding:
        raise InvalidPayload(f"{where}: value encoding {t.value_encoding} differs from the payload's {encoding}")
    if t.index_coding not in (_PACKED, _ELIAS_FANO, _BITMAP):
        raise InvalidPayload(f"{where}: unknown index coding {t.index_coding}")
    shape, chunk, k = tuple(int(d) for d in t.shape), (int(t.chunk_h), int(t.chunk_w)), int(t.k)
    if expected is not None:
        if name not in expected:
            raise InvalidPayload(f"{where} is not a parameter of this model")
        want_shape, want_chunk = expected[name]
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
    layout = _layout(t.index_coding, _PB_TO_ENCODING[encoding], shape, chunk, k)
    for field, want in (
        ("indices", layout.index_bytes),
        ("values", layout.value_bytes),
        ("scales", layout.scale_bytes),
    ):
        have = len(getattr(t, field))
        if have != want:
            raise InvalidPayload(
                f"{where}: {field} hold {have} bytes, expected {want} for "
                f"{layout.num_chunks} chunks x k={k} of {n} ({pb.IndexCoding.Name(t.index_coding)}, "
                f"{_PB_TO_ENCODING[encoding]})"
            )
    return layout


def _check_entries(where: str, idx_CK: torch.Tensor, val_CK: torch.Tensor, n: int, is_sorted: bool) -> None:
    """Bounds, order and repeats: an index may repeat in a row only where at most one value is nonzero."""
    if idx_CK.numel() == 0:
        return
    if int(idx_CK.max()) >= n:
        raise InvalidPayload(f"{where}: index {int(idx_CK.max())} out of range for {n} coefficients")
    if idx_CK.shape[1] < 2:
        return
    if is_sorted:
        if not bool((idx_CK[:, 1:] >= idx_CK[:, :-1]).all()):
            raise InvalidPayload(f"{where}: entropy-coded indices are not sorted")
        sorted_CK, sval_CK = idx_CK, val_CK
    else:
        sorted_CK, order_CK = torch.sort(idx_CK, dim=1, stable=True)
        sval_CK = val_CK.gather(1, order_CK)
    nonzero_CK = sval_CK != 0
    group_start_CK = torch.ones_like(sorted_CK, dtype=torch.bool)
    group_start_CK[:, 1:] = sorted_CK[:, 1:] != sorted_CK[:, :-1]
    if bool(group_start_CK.all()):
        return
    # Nonzero values per run of equal indices; runs are numbered within a row by a cumsum of starts.
    run_CK = group_start_CK.cumsum(dim=1)
    nonzeros_CR = torch.zeros(sorted_CK.shape[0], sorted_CK.shape[1] + 1, dtype=torch.int64)
    nonzeros_CR.scatter_add_(1, run_CK, nonzero_CK.to(torch.int64))
    if int(nonzeros_CR.max()) > 1:
        raise InvalidPayload(f"{where}: an index repeats within a chunk with more than one nonzero value")


def _decode_tensor(t: Any, encoding: str, layout: _Layout) -> Compressed:
    where = f"tensor {t.name!r}"
    data_B = _codec.from_bytes(t.indices, torch.uint8)
    c, k, n = layout.num_chunks, layout.k, layout.n
    decode_indices = {
        _PACKED: _codec.decode_packed,
        _ELIAS_FANO: _codec.decode_elias_fano,
        _BITMAP: _codec.decode_bitmap,
    }[t.index_coding]
    try:
        idx_CK = decode_indices(data_B, c, k, n)
        val_CK, scale = _codec.decode_values(t.values, t.scales, encoding, c, k)
    except InvalidPayload as e:
        raise InvalidPayload(f"{where}: {e}") from None
    if not bool(torch.isfinite(val_CK).all()):
        raise InvalidPayload(f"{where}: values are not all finite")
    _check_entries(where, idx_CK, val_CK, n, is_sorted=t.index_coding != _PACKED)
    chunk = (int(t.chunk_h), int(t.chunk_w))
    return Compressed(idx=idx_CK, val=val_CK, shape=tuple(int(d) for d in t.shape), chunk=chunk, scale=scale)


def decode(
    data: bytes,
    *,
    expected: Expected | None = None,
    max_norm: float | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_entries: int = DEFAULT_MAX_ENTRIES,
) -> tuple[int, Payload]:
    """Validate and deserialize a payload from a peer.

    Every check runs before the payload is returned, and metadata and byte lengths are checked
    before any tensor is built; anything wrong raises `InvalidPayload`.

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
    encoding = _PB_TO_ENCODING[msg.encoding]
    seen: set[str] = set()
    layouts = [_check_meta(t, msg.encoding, expected, seen) for t in msg.tensors]
    total = sum(layout.num_chunks * max(layout.k, 1) for layout in layouts)  # chunks count too
    if total > max_entries:
        raise InvalidPayload(f"payload holds {total} entries, more than the cap of {max_entries}")
    missing = [name for name in expected or () if name not in seen]
    if missing:
        raise InvalidPayload(f"payload lacks {len(missing)} of the model's tensors, e.g. {missing[0]!r}")
    tensors = {t.name: _decode_tensor(t, encoding, layout) for t, layout in zip(msg.tensors, layouts, strict=True)}
    if expected is not None:  # the model's order, which aggregate() relies on
        tensors = {name: tensors[name] for name in expected}
    if max_norm is not None:
        sq = sum(float(c.val.double().square().sum()) for c in tensors.values())
        if not math.sqrt(sq) <= max_norm:
            raise InvalidPayload(f"payload norm {math.sqrt(sq):.4g} exceeds the bound {max_norm:.4g}")
    return int(msg.step), Payload(tensors=tensors, encoding=encoding)


# --- parts -------------------------------------------------------------------------------------


def split(data: bytes, *, part_bytes: int = DEFAULT_PART_BYTES) -> list[bytes]:
    """Cut a serialized payload into serialized ``PayloadPart`` messages of `part_bytes` data each.

    Args:
        data: what `encode` returned.
        part_bytes: data bytes per part (the last may hold fewer); an empty payload is one empty part.

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
        ).SerializeToString()
        for i in range(count)
    ]


class Reassembler:
    """Collects the parts of one payload, in any order, and gives back the whole once complete.

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

    def _check_first(self, part: Any) -> None:
        if len(part.payload_digest) != _DIGEST_BYTES:
            raise InvalidPayload(f"part digest of {len(part.payload_digest)} bytes, expected {_DIGEST_BYTES}")
        if part.total_bytes > self._max_bytes:
            raise InvalidPayload(f"payload of {part.total_bytes} bytes exceeds the cap of {self._max_bytes}")
        if part.count < 1 or part.count > min(MAX_PARTS, max(1, part.total_bytes)):
            raise InvalidPayload(f"part count {part.count} does not fit {part.total_bytes} bytes")
        self._digest, self._count, self._total = part.payload_digest, part.count, part.total_bytes

    def add(self, data: bytes) -> bytes | None:
        """Take one serialized ``PayloadPart``.

        Returns:
            The whole payload when this part completed it (its digest checked), else None.

        Raises:
            InvalidPayload: the part is malformed, repeated, inconsistent with the earlier ones, too
                large, or the completed payload does not match its digest.
        """
        if self._done:
            raise InvalidPayload("part after the payload was complete")
        if len(data) > self._max_bytes + 64:  # 64: the part's own fields
            raise InvalidPayload(f"part of {len(data)} bytes exceeds the cap of {self._max_bytes}")
        part = pb.PayloadPart()
        try:
            part.ParseFromString(bytes(data))
        except DecodeError as e:
            raise InvalidPayload(f"not a demonet.v1.PayloadPart: {e}") from None
        if not self._count:
            self._check_first(part)
        elif (part.payload_digest, part.count, part.total_bytes) != (self._digest, self._count, self._total):
            raise InvalidPayload("part belongs to another payload (digest, count or size differ)")
        if part.index >= self._count:
            raise InvalidPayload(f"part index {part.index} out of range for {self._count} parts")
        if part.index in self._parts:
            raise InvalidPayload(f"part {part.index} arrived twice")
        self._received += len(part.data)
        if self._received > self._total or (not part.data and self._total):
            raise InvalidPayload(f"parts hold more than the announced {self._total} bytes, or an empty part")
        self._parts[part.index] = part.data
        if len(self._parts) < self._count:
            return None
        whole = b"".join(self._parts[i] for i in range(self._count))
        self._parts.clear()
        self._done = True
        if len(whole) != self._total or hashlib.sha256(whole).digest() != self._digest:
            raise InvalidPayload("reassembled payload does not match its size or digest")
        return whole


# --- accounting ------------------------------------------------------------------------------


def payload_bytes(payload: Payload, *, index_coding: str = "packed", step: int = 0) -> int:
    """Bytes `encode(payload, step=step, index_coding=index_coding)` writes, without encoding values."""
    msg = pb.Payload(version=VERSION, step=step, encoding=_ENCODING_TO_PB[payload.encoding])
    for name, c in payload.tensors.items():
        if index_coding == "packed":
            coding = _PACKED
        else:
            coding, _, _ = _choose_entropy(c.idx.detach().cpu(), c.totalk)
        layout = _layout(coding, payload.encoding, c.shape, c.chunk, c.k)
        msg.tensors.add(
            name=name,
            shape=c.shape,
            chunk_h=c.chunk[0],
            chunk_w=c.chunk[1],
            k=c.k,
            index_coding=coding,
            indices=bytes(layout.index_bytes),
            value_encoding=_ENCODING_TO_PB[payload.encoding],
            values=bytes(layout.value_bytes),
            scales=bytes(layout.scale_bytes),
        )
    return msg.ByteSize() + len(_TRAILER_HEAD) + _DIGEST_BYTES


def _over(bits: float, floor: float) -> float:
    return bits / floor if floor > 0 else (math.inf if bits > 0 else 1.0)


def index_bits_report(payload: Payload) -> dict[str, Any]:
    """Index bits of both codings against the floor sum over chunks of log2(C(h*w, k)).

    Returns:
        ``{"num_indices", "floor_bits", "packed_bits", "entropy_bits", "<coding>_bits_per_index",
        "floor_bits_per_index", "<coding>_over_floor", "tensors": {name: the same per tensor}}``.
    """

    def row(num: int, floor: float, packed: int, entropy: int) -> dict[str, Any]:
        per = max(num, 1)
        return {
            "num_indices": num,
            "floor_bits": floor,
            "packed_bits": packed,
            "entropy_bits": entropy,
            "floor_bits_per_index": floor / per,
            "packed_bits_per_index": packed / per,
            "entropy_bits_per_index": entropy / per,
            "packed_over_floor": _over(packed, floor),
            "entropy_over_floor": _over(entropy, floor),
        }

    tensors: dict[str, Any] = {}
    for name, c in payload.tensors.items():
        num_chunks, n, k = c.idx.shape[0], c.totalk, c.k
        coding, _, _ = _choose_entropy(c.idx.detach().cpu(), n)
        tensors[name] = row(
            num_chunks * k,
            num_chunks * _codec.floor_bits(n, k),
            _index_bits(_PACKED, num_chunks, k, n),
            _index_bits(coding, num_chunks, k, n),
        )
    keys = ("num_indices", "floor_bits", "packed_bits", "entropy_bits")
    report = row(*(sum(t[key] for t in tensors.values()) for key in keys))
    report["tensors"] = tensors
    return report
