"""Fuzzing `wire.decode`: thousands of corrupted or hostile messages, each rejected with InvalidPayload.

Raw corruptions (truncation, bit flips, junk) must fail the digest; tampered messages re-sealed with
a correct digest (as a hostile peer would send) must fail validation. Any other exception is a crash.
"""

from __future__ import annotations

import hashlib
import random
import struct
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload
from demonet.optim.payload import ENCODINGS, Compressed, Payload
from demonet.wire import _indices
from demonet.wire._layout import PB_TO_ENCODING
from demonet.wire._values import VALUE_WIDTH, top_plane_inflate
from tests.unit.test_wire import expected_of, make_compressed, num_chunks, parse, seal, small_payload


def _bases() -> list[tuple[bytes, Payload]]:
    """Valid messages: every encoding, index coding and value coding, one tensor with n = 15 (a packed width
    with spare codes), one with enough values to be deflated."""
    out = []
    for seed, encoding in enumerate(ENCODINGS):
        gen = torch.Generator().manual_seed(seed)
        payload = small_payload(encoding, seed)
        odd = make_compressed((9, 10), (3, 5), 2, encoding, gen)
        big = make_compressed((64, 64), (8, 8), 12, encoding, gen)  # enough values to be deflated
        payload = Payload(tensors={**payload.tensors, "odd": odd, "big": big}, encoding=encoding)
        for coding in wire.INDEX_CODINGS:
            for values in wire.VALUE_CODINGS:
                out.append((wire.encode(payload, step=seed, index_coding=coding, value_coding=values), payload))
    assert any(t.value_coding for data, _ in out for t in parse(data).tensors), "no base has deflated values"
    return out


BASES = _bases()


def _rejected(data: bytes, **kwargs: Any) -> str:
    with pytest.raises(InvalidPayload) as info:
        wire.decode(data, **kwargs)
    return str(info.value)


def test_bases_are_valid() -> None:
    for data, payload in BASES:
        wire.decode(data, expected=expected_of(payload))


def test_raw_corruption_fails_the_digest() -> None:
    rng = random.Random(0)
    for trial in range(2000):
        data, _ = BASES[trial % len(BASES)]
        buf = bytearray(data)
        kind = trial % 6
        if kind == 0:
            buf = buf[: rng.randrange(len(buf))]  # truncated
        elif kind == 1:
            for _ in range(rng.randint(1, 3)):
                pos = rng.randrange(len(buf))
                buf[pos] ^= 1 << rng.randrange(8)  # flipped bits
        elif kind == 2:
            buf.insert(rng.randrange(len(buf) + 1), rng.randrange(256))
        elif kind == 3:
            del buf[rng.randrange(len(buf))]
        elif kind == 4:
            buf += bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
        else:
            buf = bytearray(rng.randbytes(rng.randrange(200)))  # garbage
        _rejected(bytes(buf))


def test_garbage_with_a_valid_digest_is_rejected() -> None:
    rng = random.Random(1)
    for _ in range(500):
        body = rng.randbytes(rng.randrange(300))
        _rejected(body + pb.Payload(digest=hashlib.sha256(body).digest()).SerializeToString())


# --- tampered, re-sealed messages ---------------------------------------------------------------


def _tensor(msg: pb.Payload, rng: random.Random) -> Any:
    return msg.tensors[rng.randrange(len(msg.tensors))]


def _nonempty(msg: pb.Payload, field: str, rng: random.Random) -> Any:
    candidates = [t for t in msg.tensors if len(getattr(t, field))]
    return candidates[rng.randrange(len(candidates))]


def _width(msg: pb.Payload) -> int:
    return VALUE_WIDTH[PB_TO_ENCODING[msg.encoding]]


def _plain(msg: pb.Payload, t: Any) -> Any:
    """`t` with its values recoded plain (the same values), so that a mutation can aim at one value's bytes."""
    if t.value_coding == pb.VALUE_CODING_TOP_PLANE_DEFLATE:
        width = _width(msg)
        t.values = top_plane_inflate(t.values, width, num_chunks(tuple(t.shape), (t.chunk_h, t.chunk_w)) * t.k * width)
        t.value_coding = pb.VALUE_CODING_PLAIN
    return t


def _set_bytes(t: Any, field: str, pos: int, new: bytes) -> None:
    old = getattr(t, field)
    setattr(t, field, old[:pos] + new + old[pos + len(new) :])


def m_version(msg: pb.Payload, rng: random.Random) -> None:
    msg.version = rng.choice([0, 2, 3, 2**32 - 1])


def m_encoding(msg: pb.Payload, rng: random.Random) -> None:
    msg.encoding = rng.choice([0, 6, 99])  # type: ignore[assignment]  # unknown on purpose


def m_tensor_encoding(msg: pb.Payload, rng: random.Random) -> None:
    t = _tensor(msg, rng)
    t.value_encoding = rng.choice([e for e in range(7) if e != msg.encoding])


def m_index_coding(msg: pb.Payload, rng: random.Random) -> None:
    _tensor(msg, rng).index_coding = rng.choice([0, 4, 1000])


def m_duplicate_tensor(msg: pb.Payload, rng: random.Random) -> None:
    original = _tensor(msg, rng)
    msg.tensors.add().CopyFrom(original)


def m_name(msg: pb.Payload, rng: random.Random) -> None:
    _tensor(msg, rng).name = rng.choice(["", "not.a.param", "x" * 2000])


def m_shape(msg: pb.Payload, rng: random.Random) -> None:
    t = _tensor(msg, rng)
    choice = rng.randrange(4)
    if choice == 0 and len(t.shape):
        t.shape[rng.randrange(len(t.shape))] += rng.choice([1, 7, 2**41])
    elif choice == 1:
        t.shape.append(rng.randint(1, 3))
    elif choice == 2:
        t.shape.extend([1] * 9)
    else:
        t.shape[:] = [2**40, 2**40]


def m_chunk(msg: pb.Payload, rng: random.Random) -> None:
    t = _tensor(msg, rng)
    if rng.random() < 0.5:
        t.chunk_h = rng.choice([0, t.chunk_h + 1, 2**20])
    else:
        t.chunk_w = rng.choice([0, t.chunk_w * 2, 2**31])


def m_k(msg: pb.Payload, rng: random.Random) -> None:
    t = _tensor(msg, rng)
    t.k = t.chunk_h * t.chunk_w + rng.choice([1, 5, 2**31])


def m_length(msg: pb.Payload, rng: random.Random) -> None:
    field = rng.choice(["indices", "values", "scales"])
    if not any(len(getattr(t, field)) for t in msg.tensors):
        field = "values"
    t = _nonempty(msg, field, rng)
    old = getattr(t, field)
    if rng.random() < 0.5:
        setattr(t, field, old[: rng.randrange(len(old))])
    else:
        setattr(t, field, old + rng.randbytes(rng.randint(1, 9)))


def m_nonfinite(msg: pb.Payload, rng: random.Random) -> None:
    t = _plain(msg, _nonempty(msg, "values", rng))
    if msg.encoding == pb.VALUE_ENCODING_FP32:
        word = struct.pack("<f", rng.choice([float("nan"), float("inf"), -float("inf")]))
        _set_bytes(t, "values", 4 * rng.randrange(len(t.values) // 4), word)
    elif msg.encoding in (pb.VALUE_ENCODING_BF16, pb.VALUE_ENCODING_FP16):
        specials = [0x7F80, 0xFF80, 0x7FC0] if msg.encoding == pb.VALUE_ENCODING_BF16 else [0x7C00, 0xFC00, 0x7E00]
        _set_bytes(t, "values", 2 * rng.randrange(len(t.values) // 2), struct.pack("<H", rng.choice(specials)))
    else:  # int8 / sign: the per-chunk bf16 scales
        t = _nonempty(msg, "scales", rng)
        word = struct.pack("<H", rng.choice([0x7F80, 0xFF80, 0x7FC0, 0xBF80]))  # inf, -inf, nan, -1.0
        _set_bytes(t, "scales", 2 * rng.randrange(len(t.scales) // 2), word)


def m_fp16_scale(msg: pb.Payload, rng: random.Random) -> None:
    """A scale that is not a positive power of two, or one so large that the codes overflow."""
    if msg.encoding != pb.VALUE_ENCODING_FP16:
        return m_nonfinite(msg, rng)
    t = _plain(msg, _tensor(msg, rng))
    bad = rng.choice([float("nan"), float("inf"), 0.0, -0.5, 3.0, 2.0**126 * 1.5, "overflow"])
    if bad == "overflow":
        bad = 2.0**127
        t.values = struct.pack("<H", 0x7BFF) * (len(t.values) // 2)  # 65504 * 2^127 = inf
    t.scales = struct.pack("<f", bad)
    return None


def m_value_coding(msg: pb.Payload, rng: random.Random) -> None:
    """A value coding that does not apply, or a top plane whose stream is cut, runs on, or inflates to more."""
    deflated = [t for t in msg.tensors if t.value_coding == pb.VALUE_CODING_TOP_PLANE_DEFLATE]
    if not deflated or rng.random() < 0.2:
        t = _nonempty(msg, "values", rng)
        t.value_coding = rng.choice([2, 7, 1 << 20]) if msg.encoding in (pb.VALUE_ENCODING_FP32, pb.VALUE_ENCODING_BF16,
                                                                          pb.VALUE_ENCODING_FP16) else 1
        return
    t = deflated[rng.randrange(len(deflated))]
    width = _width(msg)
    num = num_chunks(tuple(t.shape), (t.chunk_h, t.chunk_w)) * t.k
    low, plain = num * (width - 1), _plain(msg, pb.SparseTensor(**{f.name: v for f, v in t.ListFields()})).values
    top = bytes(plain[width - 1 :: width])
    kind = rng.randrange(4)
    if kind == 0:  # the stream cut short
        t.values = t.values[: low + rng.randrange(len(t.values) - low)]
    elif kind == 1:  # bytes after the end of the stream
        t.values += rng.randbytes(rng.randint(1, 9))
    elif kind == 2:  # a valid stream of one byte more (or many more: a small bomb)
        more = top + bytes(rng.choice([1, 1 << 20]))
        packer = zlib.compressobj(9, zlib.DEFLATED, -15)
        t.values = t.values[:low] + packer.compress(more) + packer.flush()
    else:  # one byte fewer
        packer = zlib.compressobj(9, zlib.DEFLATED, -15)
        t.values = t.values[:low] + packer.compress(top[:-1]) + packer.flush()


def m_padding_bits(msg: pb.Payload, rng: random.Random) -> None:
    """Set an unused high bit of a stream's last byte."""
    options = []
    for t in msg.tensors:
        n = t.chunk_h * t.chunk_w
        bits = {
            pb.INDEX_CODING_PACKED: _indices.index_width(n) * t.k,
            pb.INDEX_CODING_ELIAS_FANO: _indices.ef_chunk_bits(n, t.k),
            pb.INDEX_CODING_BITMAP: n,
        }[t.index_coding]
        chunks = _chunks(t)
        if (bits * chunks) % 8:
            options.append((t, "indices", bits * chunks))
        if msg.encoding == pb.VALUE_ENCODING_SIGN and (t.k * chunks) % 8:
            options.append((t, "values", t.k * chunks))
    if not options:
        return m_version(msg, rng)
    t, field, num_bits = options[rng.randrange(len(options))]
    data = bytearray(getattr(t, field))
    data[-1] |= 1 << rng.randrange(num_bits % 8, 8)
    setattr(t, field, bytes(data))
    return None


def _chunks(t: Any) -> int:
    return num_chunks(tuple(t.shape), (t.chunk_h, t.chunk_w))


def m_upper_bits(msg: pb.Payload, rng: random.Random) -> None:
    """Flip one bit of an Elias-Fano upper vector or of a bitmap: a chunk then holds k +- 1 entries."""
    tensors = [t for t in msg.tensors if t.index_coding != pb.INDEX_CODING_PACKED and t.k and len(t.indices)]
    if not tensors:
        return m_out_of_range(msg, rng)
    t = tensors[rng.randrange(len(tensors))]
    n, chunk = t.chunk_h * t.chunk_w, rng.randrange(_chunks(t))
    if t.index_coding == pb.INDEX_CODING_BITMAP:
        bit = chunk * n + rng.randrange(n)
    else:
        low, per = _indices.ef_low_bits(n, t.k), _indices.ef_chunk_bits(n, t.k)
        bit = chunk * per + t.k * low + rng.randrange(per - t.k * low)
    data = bytearray(t.indices)
    data[bit // 8] ^= 1 << (bit % 8)
    t.indices = bytes(data)
    return None


def m_out_of_range(msg: pb.Payload, rng: random.Random) -> None:
    """Rewrite the n = 15 tensor's indices with one index in [15, 16)."""
    t = next(t for t in msg.tensors if t.name == "odd")
    num = _chunks(t)
    if t.index_coding == pb.INDEX_CODING_PACKED:
        idx_CK = np.array([[rng.randrange(15), 15] for _ in range(num)])
        [t.indices] = _indices.encode_indices(["packed"], idx_CK, 15, [num])
    else:  # Elias-Fano with l = 2 can spell 15 (high 3, low 3)
        idx_CK = np.array([[0, 15] for _ in range(num)])
        [t.indices] = _indices.encode_indices(["elias_fano"], idx_CK, 15, [num])
        t.index_coding = pb.INDEX_CODING_ELIAS_FANO


MUTATIONS: list[Callable[[pb.Payload, random.Random], None]] = [
    m_version,
    m_encoding,
    m_tensor_encoding,
    m_index_coding,
    m_duplicate_tensor,
    m_name,
    m_shape,
    m_chunk,
    m_k,
    m_length,
    m_nonfinite,
    m_fp16_scale,
    m_value_coding,
    m_padding_bits,
    m_upper_bits,
    m_out_of_range,
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.__name__)
def test_tampered_messages_are_rejected(mutation: Callable[[pb.Payload, random.Random], None]) -> None:
    rng = random.Random(mutation.__name__)
    for trial in range(100):
        data, payload = BASES[trial % len(BASES)]
        msg = parse(data)
        mutation(msg, rng)
        _rejected(seal(msg), expected=expected_of(payload))


def _with(payload: Payload, name: str, **change: Any) -> Payload:
    c = payload.tensors[name]
    fields = {"idx": c.idx, "val": c.val, "shape": c.shape, "chunk": c.chunk, "scale": c.scale, **change}
    return Payload(tensors={**payload.tensors, name: Compressed(**fields)}, encoding=payload.encoding)


@pytest.mark.parametrize("coding", wire.INDEX_CODINGS)
def test_repeated_indices_with_values_are_rejected(coding: str) -> None:
    """An index may repeat in a chunk only as zero padding; encode does not check, decode must."""
    for seed in range(60):
        gen = torch.Generator().manual_seed(seed)
        c = make_compressed((16, 16), (8, 8), 4, "fp32", gen)
        idx_CK = c.idx.clone()
        row, col = seed % 4, 1 + seed % 3
        idx_CK[row, col] = idx_CK[row, 0]
        payload = Payload(tensors={"w": c}, encoding="fp32")
        message = _rejected(wire.encode(_with(payload, "w", idx=idx_CK), step=0, index_coding=coding))
        assert "repeats" in message


def test_unsorted_entropy_indices_are_rejected() -> None:
    msg = parse(wire.encode(small_payload("fp32", 0), step=0, index_coding="entropy"))
    t = msg.tensors.add(name="extra", shape=[64], chunk_h=1, chunk_w=64, k=2, value_encoding=msg.encoding)
    t.index_coding = pb.INDEX_CODING_ELIAS_FANO
    [t.indices] = _indices.encode_indices(["elias_fano"], np.array([[3, 1]]), 64, [1])  # one high part, lows descending
    t.values = struct.pack("<2f", 1.0, 2.0)
    assert "sorted" in _rejected(seal(msg))


def test_caps_and_bounds() -> None:
    data, payload = BASES[0]
    assert "exceeds the cap" in _rejected(data, max_bytes=len(data) - 1)
    assert "entries" in _rejected(data, max_entries=10)
    assert "norm" in _rejected(data, max_norm=1e-12)
    wire.decode(data, max_norm=1e6)
    fewer = dict(expected_of(payload))
    fewer.pop("t0")
    assert "not a parameter" in _rejected(data, expected=fewer)
    more = {**expected_of(payload), "extra": ((4,), (1, 4))}
    assert "lacks" in _rejected(data, expected=more)
    assert "bytes" in _rejected("not bytes")  # type: ignore[arg-type]


def test_too_many_tensors() -> None:
    msg = pb.Payload(version=wire.VERSION, encoding=pb.VALUE_ENCODING_FP32)
    for i in range(wire.MAX_TENSORS + 1):
        msg.tensors.add(name=f"t{i}")
    assert "tensors exceed" in _rejected(seal(msg))
