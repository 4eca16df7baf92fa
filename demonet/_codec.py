"""Bit-level codecs behind `demonet.wire`: index codings and value encodings, as torch ops on bytes.

Imports torch, numpy (only to turn tensors into bytes) and demonet.errors; never protobuf.

Shape legend: C = chunks, K = entries per chunk, N = fields (C * K entries), M = h * w coefficients
of a chunk, H = Elias-Fano upper bits per chunk, B = bytes.
Bit streams are LSB-first: bit j is ``(byte[j // 8] >> (j % 8)) & 1``.
"""

from __future__ import annotations

import math

import torch

from .errors import InvalidPayload

_MAX_FIELD_WIDTH = 48  # a field plus its bit shift must fit in an int64


# --- bytes <-> tensors -----------------------------------------------------------------------


def to_bytes(t: torch.Tensor) -> bytes:
    """The raw little-endian bytes of a CPU tensor."""
    return t.contiguous().numpy().tobytes()


def from_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A fresh (writable) 1-D tensor over a copy of `data`; len(data) must fit the dtype."""
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype)


def num_bytes(num_bits: int) -> int:
    return -(-num_bits // 8)


# --- bit fields --------------------------------------------------------------------------------


def write_fields(offsets_N: torch.Tensor, values_N: torch.Tensor, width: int, num_bits: int) -> torch.Tensor:
    """Write each value's low `width` bits at its bit offset; fields must not overlap.

    Returns (B,) int64 holding byte values; add the results of several calls to merge disjoint
    fields (a sum of disjoint bits is their OR), then cast to uint8.
    """
    if not 0 <= width <= _MAX_FIELD_WIDTH:
        raise ValueError(f"field width should be in [0, {_MAX_FIELD_WIDTH}], got {width}")
    out_B = torch.zeros(num_bytes(num_bits) + 8, dtype=torch.int64)  # 8 spare bytes: spans run past
    if width == 0 or offsets_N.numel() == 0:
        return out_B[: num_bytes(num_bits)]
    byte_N = offsets_N >> 3
    shifted_N = values_N << (offsets_N & 7)
    for j in range((width + 7 + 7) // 8):  # bytes one shifted field can touch
        out_B.index_add_(0, byte_N + j, (shifted_N >> (8 * j)) & 0xFF)
    return out_B[: num_bytes(num_bits)]


def read_fields(data_B: torch.Tensor, offsets_N: torch.Tensor, width: int) -> torch.Tensor:
    """(N,) int64: the `width`-bit unsigned fields at the given bit offsets of a uint8 stream."""
    if width == 0 or offsets_N.numel() == 0:
        return torch.zeros(offsets_N.shape, dtype=torch.int64)
    padded_B = torch.cat([data_B.to(torch.int64), torch.zeros(8, dtype=torch.int64)])
    byte_N = offsets_N >> 3
    acc_N = torch.zeros(offsets_N.shape, dtype=torch.int64)
    for j in range((width + 7 + 7) // 8):
        acc_N |= padded_B[byte_N + j] << (8 * j)
    return (acc_N >> (offsets_N & 7)) & ((1 << width) - 1)


def pack_bits(bits_N: torch.Tensor) -> bytes:
    """Dense bits (bool or 0/1) -> bytes, 8 per byte, LSB-first, zero-padded."""
    num = bits_N.numel()
    padded = torch.zeros(num_bytes(num) * 8, dtype=torch.uint8)
    padded[:num] = bits_N.reshape(-1)
    weights_8 = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8)
    bytes_B = (padded.view(-1, 8) * weights_8).sum(dim=1, dtype=torch.uint8)  # (B, 8) -> (B,)
    return to_bytes(bytes_B)


def unpack_bits(data_B: torch.Tensor, num_bits: int) -> torch.Tensor:
    """(num_bits,) bool from a uint8 stream (the caller checked its length)."""
    shifts_8 = torch.arange(8, dtype=torch.uint8)
    bits_B8 = (data_B[:, None] >> shifts_8) & 1
    return bits_B8.reshape(-1)[:num_bits].bool()  # (num_bits,)


def check_padding(data_B: torch.Tensor, num_bits: int, what: str) -> None:
    """The unused high bits of the last byte must be 0 (one encoding per message)."""
    if num_bits % 8 and int(data_B[-1]) >> (num_bits % 8):
        raise InvalidPayload(f"{what}: the padding bits of the last byte are not 0")


# --- index codings -------------------------------------------------------------------------------


def index_width(n: int) -> int:
    """Bits per packed index: ceil(log2(n)), 0 when n == 1 (12 for 64x64, 6 for 1x64)."""
    return (n - 1).bit_length()


def ef_low_bits(n: int, k: int) -> int:
    """Elias-Fano low bits: floor(log2(n / k))."""
    return (n // k).bit_length() - 1 if k > 0 else 0


def ef_chunk_bits(n: int, k: int) -> int:
    """Bits of one Elias-Fano chunk: k low fields plus an upper bit vector of k + ((n-1) >> l) bits."""
    if k == 0:
        return 0
    low = ef_low_bits(n, k)
    return k * low + k + ((n - 1) >> low)


def floor_bits(n: int, k: int) -> float:
    """log2(C(n, k)): the fewest bits that tell which k of n coefficients a chunk kept."""
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


def has_repeats(sorted_CK: torch.Tensor) -> bool:
    """Whether any row of row-sorted indices holds an index twice."""
    return bool((sorted_CK[:, 1:] == sorted_CK[:, :-1]).any()) if sorted_CK.shape[1] > 1 else False


def encode_packed(idx_CK: torch.Tensor, n: int) -> bytes:
    width = index_width(n)
    flat_N = idx_CK.reshape(-1)
    offsets_N = torch.arange(flat_N.numel(), dtype=torch.int64) * width
    return to_bytes(write_fields(offsets_N, flat_N, width, flat_N.numel() * width).to(torch.uint8))


def decode_packed(data_B: torch.Tensor, num_chunks: int, k: int, n: int) -> torch.Tensor:
    width = index_width(n)
    check_padding(data_B, num_chunks * k * width, "packed indices")
    offsets_N = torch.arange(num_chunks * k, dtype=torch.int64) * width
    return read_fields(data_B, offsets_N, width).view(num_chunks, k)  # (C, K)


def encode_elias_fano(sorted_CK: torch.Tensor, n: int) -> bytes:
    """Row-sorted indices -> Elias-Fano chunks (layout in proto/demonet.proto)."""
    num_chunks, k = sorted_CK.shape
    low, chunk_bits = ef_low_bits(n, k), ef_chunk_bits(n, k)
    total = num_chunks * chunk_bits
    base_C1 = torch.arange(num_chunks, dtype=torch.int64)[:, None] * chunk_bits
    rank_K = torch.arange(k, dtype=torch.int64)
    low_offsets_CK = base_C1 + rank_K * low
    low_B = write_fields(low_offsets_CK.reshape(-1), (sorted_CK & ((1 << low) - 1)).reshape(-1), low, total)
    upper_CK = base_C1 + k * low + (sorted_CK >> low) + rank_K  # bit (x_i >> l) + i of the upper vector
    ones_N = torch.ones(num_chunks * k, dtype=torch.int64)
    high_B = write_fields(upper_CK.reshape(-1), ones_N, 1, total)
    return to_bytes((low_B + high_B).to(torch.uint8))


def decode_elias_fano(data_B: torch.Tensor, num_chunks: int, k: int, n: int) -> torch.Tensor:
    low, chunk_bits = ef_low_bits(n, k), ef_chunk_bits(n, k)
    check_padding(data_B, num_chunks * chunk_bits, "Elias-Fano indices")
    if k == 0:
        return torch.zeros(num_chunks, 0, dtype=torch.int64)
    num_upper = chunk_bits - k * low
    base_C1 = torch.arange(num_chunks, dtype=torch.int64)[:, None] * chunk_bits
    rank_K = torch.arange(k, dtype=torch.int64)
    low_CK = read_fields(data_B, (base_C1 + rank_K * low).reshape(-1), low).view(num_chunks, k)
    upper_offsets_CH = base_C1 + k * low + torch.arange(num_upper, dtype=torch.int64)
    upper_CH = read_fields(data_B, upper_offsets_CH.reshape(-1), 1).view(num_chunks, num_upper)
    if not bool((upper_CH.sum(dim=1) == k).all()):
        raise InvalidPayload(f"Elias-Fano indices: an upper bit vector does not hold exactly k={k} ones")
    pos_CK = upper_CH.nonzero()[:, 1].view(num_chunks, k)  # row-major, so k per row in order
    return ((pos_CK - rank_K) << low) | low_CK  # (C, K)


def encode_bitmap(sorted_CK: torch.Tensor, n: int) -> bytes:
    """Row-sorted, repeat-free indices -> one n-bit map per chunk."""
    num_chunks, k = sorted_CK.shape
    offsets_CK = torch.arange(num_chunks, dtype=torch.int64)[:, None] * n + sorted_CK
    ones_N = torch.ones(num_chunks * k, dtype=torch.int64)
    return to_bytes(write_fields(offsets_CK.reshape(-1), ones_N, 1, num_chunks * n).to(torch.uint8))


def decode_bitmap(data_B: torch.Tensor, num_chunks: int, k: int, n: int) -> torch.Tensor:
    check_padding(data_B, num_chunks * n, "bitmap indices")
    bits_CM = unpack_bits(data_B, num_chunks * n).view(num_chunks, n)
    if not bool((bits_CM.sum(dim=1) == k).all()):
        raise InvalidPayload(f"bitmap indices: a chunk's map does not hold exactly k={k} ones")
    return bits_CM.nonzero()[:, 1].view(num_chunks, k)  # (C, K), ascending per row


# --- value encodings -----------------------------------------------------------------------------


def _bf16_bytes(x: torch.Tensor) -> bytes:
    return to_bytes(x.to(torch.bfloat16).view(torch.int16))


def _bf16_from(data: bytes) -> torch.Tensor:
    return from_bytes(data, torch.int16).view(torch.bfloat16).to(torch.float32)


def value_sizes(encoding: str, num_chunks: int, k: int) -> tuple[int, int]:
    """(value bytes, scale bytes) of one tensor."""
    num = num_chunks * k
    if encoding == "fp32":
        return 4 * num, 0
    if encoding == "bf16":
        return 2 * num, 0
    if encoding == "fp16":
        return 2 * num, 4
    if encoding == "int8":
        return num, 2 * num_chunks
    if encoding == "sign":
        return num_bytes(num), 2 * num_chunks
    raise ValueError(f"unknown encoding {encoding!r}")


def encode_values(val_CK: torch.Tensor, scale: torch.Tensor | None, encoding: str) -> tuple[bytes, bytes]:
    """(values, scales) bytes of float32 values that already went through `quantize`."""
    if encoding == "fp32":
        return to_bytes(val_CK), b""
    if encoding == "bf16":
        return _bf16_bytes(val_CK), b""
    if scale is None:
        raise ValueError(f"encoding {encoding} needs the scale that quantize returned")
    scale = scale.detach().cpu().to(torch.float32)
    if encoding == "fp16":
        return to_bytes((val_CK / scale).to(torch.float16)), to_bytes(scale.reshape(1))
    if encoding == "int8":
        safe_C1 = torch.where(scale > 0, scale, torch.ones_like(scale))
        q_CK = torch.round(val_CK / safe_C1).clamp_(-127, 127)
        q_CK = torch.where((val_CK == 0) & val_CK.signbit(), -128.0, q_CK)  # -128 carries -0.0
        return to_bytes(q_CK.to(torch.int8)), _bf16_bytes(scale.reshape(-1))
    if encoding == "sign":
        return pack_bits(val_CK.signbit()), _bf16_bytes(scale.reshape(-1))
    raise ValueError(f"unknown encoding {encoding!r}")


def decode_values(
    values: bytes, scales: bytes, encoding: str, num_chunks: int, k: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(val (C, K) float32, scale as `quantize` returns it). Byte lengths were checked by the caller."""
    shape = (num_chunks, k)
    if encoding == "fp32":
        return from_bytes(values, torch.float32).view(shape), None
    if encoding == "bf16":
        return _bf16_from(values).view(shape), None
    if encoding == "fp16":
        scale = from_bytes(scales, torch.float32)
        value = float(scale[0])
        if not (math.isfinite(value) and value > 0 and math.frexp(value)[0] == 0.5):
            raise InvalidPayload(f"fp16 scale {value!r} is not a finite power of two")
        # The same ops as quantize: exact float16 -> float32, then times the power of two.
        val_CK = from_bytes(values, torch.float16).view(shape).to(torch.float32) * value
        return val_CK, scale.reshape(())
    scale_C1 = _bf16_from(scales).view(num_chunks, 1)
    if not bool((torch.isfinite(scale_C1) & (scale_C1 >= 0)).all()):
        raise InvalidPayload(f"{encoding} scales should be finite and >= 0")
    if encoding == "int8":
        q_CK = from_bytes(values, torch.int8).view(shape)
        val_CK = torch.where(q_CK == -128, -0.0, q_CK.to(torch.float32) * scale_C1)
        return val_CK, scale_C1
    if encoding == "sign":
        data_B = from_bytes(values, torch.uint8)
        check_padding(data_B, num_chunks * k, "sign values")
        bits_CK = unpack_bits(data_B, num_chunks * k).view(shape)
        return torch.where(bits_CK, -1.0, 1.0) * scale_C1, scale_C1
    raise ValueError(f"unknown encoding {encoding!r}")
