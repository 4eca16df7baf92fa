"""Bit-level codecs behind `demonet.wire`: index codings, value encodings and entry checks of a batch.

Imports numpy, torch (bf16 rounding only) and demonet.errors; never protobuf. The codecs run on numpy:
on a CPU its bit packing, bool scans and small-row sorts are 3-10x faster than torch's, and a call costs
~1 us against torch's ~4 us, which adds up at 76 tensors a payload.

A batch is the tensors of one payload that share (n, k): their rows (chunks) end to end in one (R, K)
array, ``rows[t]`` of them from tensor t, whose bytes travel as its own byte-aligned blob.

Shape legend: R = rows (chunks) of a batch, K = entries per row, T = tensors of a batch, N = fields,
W = bits of a field, L = bits of one row's index code, H = Elias-Fano upper bits of a row.
Bit streams are LSB-first: bit j is ``(byte[j // 8] >> (j % 8)) & 1``.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch

Blobs = Sequence[bytes]
CODINGS = ("packed", "elias_fano", "bitmap")


class BadTensor(Exception):
    """Tensor `tensor` of a batch is malformed. `wire` names it and raises InvalidPayload or ValueError."""

    def __init__(self, tensor: int, message: str) -> None:
        super().__init__(message)
        self.tensor = tensor


def _bad(flags: np.ndarray, rows: Sequence[int], message: str) -> BadTensor:
    """BadTensor for the first flagged row: flags (R,), or (R, K) for any entry of the row."""
    row = int(np.flatnonzero(flags.reshape(flags.shape[0], -1).any(axis=1))[0])
    return BadTensor(bisect.bisect_right(list(itertools.accumulate(rows)), row), message)


def num_bytes(num_bits: int) -> int:
    return -(-num_bits // 8)


def padding_ok(blob: bytes, num_bits: int) -> bool:
    """The unused high bits of the last byte are 0 (one encoding per message); len(blob) was checked."""
    return num_bits % 8 == 0 or blob[-1] >> (num_bits % 8) == 0


def _cut(data: bytes, sizes: Sequence[int]) -> list[bytes]:
    return [data[a:b] for a, b in itertools.pairwise(itertools.accumulate(sizes, initial=0))]


def _join(blobs: Blobs, dtype: str) -> np.ndarray:
    """A fresh, writable 1-D array over the concatenated blobs."""
    return np.frombuffer(bytearray().join(blobs), dtype=dtype)


def _flat(col_RK: np.ndarray, width: int) -> np.ndarray:
    """Flat positions of per-row columns in a C-contiguous (R, width) array (cheaper than *_along_axis)."""
    return col_RK + (np.arange(col_RK.shape[0]) * width)[:, None]


# --- bit fields --------------------------------------------------------------------------------


def _word(width: int) -> int:
    """Bytes of the smallest unsigned integer that holds `width` bits."""
    return 1 if width <= 8 else 2 if width <= 16 else 4 if width <= 32 else 8


def _to_bits(values_N: np.ndarray, width: int) -> np.ndarray:
    """(N, W) uint8: the low `width` bits of non-negative integers, LSB first."""
    word = _word(width)
    bits = np.unpackbits(values_N.astype(f"<u{word}").view(np.uint8), bitorder="little")
    return bits.reshape(-1, 8 * word)[:, :width]


def _from_bits(bits_NW: np.ndarray) -> np.ndarray:
    """(N,) int64 of LSB-first (N, W) bit fields, W <= 63."""
    num, width = bits_NW.shape
    word = _word(width)
    if width != 8 * word:
        padded_NW = np.zeros((num, 8 * word), np.uint8)
        padded_NW[:, :width] = bits_NW
        bits_NW = padded_NW
    return np.packbits(bits_NW.reshape(-1), bitorder="little").view(f"<u{word}").astype(np.int64)


def _pack(bits_RL: np.ndarray, rows: Sequence[int]) -> list[bytes]:
    """Each tensor's rows of bits as its own zero-padded blob."""
    row_bits = bits_RL.shape[1]
    flat = bits_RL.reshape(-1)
    if all(r * row_bits % 8 == 0 for r in rows):  # no padding anywhere: pack once, then cut
        return _cut(np.packbits(flat, bitorder="little").tobytes(), [r * row_bits // 8 for r in rows])
    bounds = itertools.pairwise(itertools.accumulate((r * row_bits for r in rows), initial=0))
    return [np.packbits(flat[a:b], bitorder="little").tobytes() for a, b in bounds]


def _unpack(blobs: Blobs, rows: Sequence[int], row_bits: int) -> np.ndarray:
    """(R, L) uint8: the used bits of each blob (their lengths and padding were checked)."""
    bits = np.unpackbits(_join(blobs, "u1"), bitorder="little")
    if any(r * row_bits % 8 for r in rows):
        starts = itertools.accumulate((8 * len(b) for b in blobs), initial=0)
        bits = np.concatenate([bits[s : s + r * row_bits] for s, r in zip(starts, rows, strict=False)])
    return bits.reshape(sum(rows), row_bits)


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


def index_row_bits(coding: str, n: int, k: int) -> int:
    """Bits of one chunk's indices in a coding of `CODINGS`."""
    if coding == "packed":
        return k * index_width(n)
    if coding == "elias_fano":
        return ef_chunk_bits(n, k)
    return n  # bitmap


def floor_bits(n: int, k: int) -> float:
    """log2(C(n, k)): the fewest bits that tell which k of n coefficients a chunk kept."""
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


def sort_rows(idx_RK: np.ndarray, val_RK: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's indices ascending, ties in their order, and the values along: one sort of unique keys."""
    k = idx_RK.shape[1]
    shift = max(k - 1, 0).bit_length()  # key = index, then column
    key_RK = (idx_RK << shift) | np.arange(k)
    key_RK.sort(axis=1)
    return key_RK >> shift, np.ascontiguousarray(val_RK).reshape(-1)[_flat(key_RK & ((1 << shift) - 1), k)]


def entropy_codings(sorted_RK: np.ndarray, n: int, rows: Sequence[int]) -> list[str]:
    """Elias-Fano or bitmap for each tensor of a batch of sorted rows, whichever is smaller."""
    k = sorted_RK.shape[1]
    if not n < ef_chunk_bits(n, k):
        return ["elias_fano"] * len(rows)
    if k < 2:
        return ["bitmap"] * len(rows)
    # A bitmap cannot hold an index twice (an aggregate's zero padding may repeat one).
    repeats_R = (sorted_RK[:, 1:] == sorted_RK[:, :-1]).any(axis=1)
    before = np.concatenate([[0], np.cumsum(repeats_R)])  # rows with repeats before each row
    ends = np.cumsum(rows)
    return ["elias_fano" if r else "bitmap" for r in (before[ends] > before[ends - rows]).tolist()]


def _index_bits(coding: str, idx_RK: np.ndarray, n: int) -> np.ndarray:
    """(R, L) bits of each row's index code; Elias-Fano and bitmap rows sorted, bitmap rows repeat-free."""
    num_rows, k = idx_RK.shape
    if coding == "packed":
        width = index_width(n)
        return _to_bits(idx_RK.reshape(-1), width).reshape(num_rows, k * width)
    if coding == "bitmap":
        bits_RL = np.zeros((num_rows, n), np.uint8)
        bits_RL.reshape(-1)[_flat(idx_RK, n)] = 1
        return bits_RL
    low = ef_low_bits(n, k)
    bits_RL = np.zeros((num_rows, ef_chunk_bits(n, k)), np.uint8)
    bits_RL[:, : k * low] = _to_bits((idx_RK & ((1 << low) - 1)).reshape(-1), low).reshape(num_rows, k * low)
    upper_RK = k * low + (idx_RK >> low) + np.arange(k)  # bit (x_i >> l) + i of the upper vector
    bits_RL.reshape(-1)[_flat(upper_RK, bits_RL.shape[1])] = 1
    return bits_RL


def encode_indices(codings: Sequence[str], idx_RK: np.ndarray, n: int, rows: Sequence[int]) -> list[bytes]:
    """Each tensor's index blob, in its coding of `CODINGS`."""
    if len(set(codings)) == 1:
        return _pack(_index_bits(codings[0], idx_RK, n), rows)
    out, starts = [b""] * len(rows), list(itertools.accumulate(rows, initial=0))
    for coding in set(codings):  # bitmap for some tensors, Elias-Fano for the others: one sub-batch each
        members = [t for t, c in enumerate(codings) if c == coding]
        sub_RK = np.concatenate([idx_RK[starts[t] : starts[t + 1]] for t in members])
        for t, blob in zip(members, _pack(_index_bits(coding, sub_RK, n), [rows[t] for t in members]), strict=True):
            out[t] = blob
    return out


def _ones(bits_RH: np.ndarray, k: int, rows: Sequence[int], what: str) -> np.ndarray:
    """(R, K): the column of each row's one bits, ascending; every row must hold exactly k."""
    ones_RH = np.ascontiguousarray(bits_RH).view(np.bool_)  # 0/1 bytes; numpy's bool paths are ~7x faster
    wrong_R = np.count_nonzero(ones_RH, axis=1) != k
    if wrong_R.any():
        raise _bad(wrong_R, rows, f"{what} does not hold exactly k={k} ones")
    num_rows, width = ones_RH.shape
    pos_RK: np.ndarray = np.flatnonzero(ones_RH).reshape(num_rows, k) - (np.arange(num_rows) * width)[:, None]
    return pos_RK


def decode_indices(coding: str, blobs: Blobs, rows: Sequence[int], k: int, n: int) -> np.ndarray:
    """(R, K) int64 indices of a batch's blobs (lengths and padding bits already checked)."""
    bits_RL = _unpack(blobs, rows, index_row_bits(coding, n, k))
    num_rows = bits_RL.shape[0]
    if coding == "packed":
        return _from_bits(bits_RL.reshape(num_rows * k, index_width(n))).reshape(num_rows, k)
    if coding == "bitmap":
        return _ones(bits_RL, k, rows, "bitmap indices: a chunk's map")
    low = ef_low_bits(n, k)
    low_RK = _from_bits(bits_RL[:, : k * low].reshape(num_rows * k, low)).reshape(num_rows, k)
    pos_RK = _ones(bits_RL[:, k * low :], k, rows, "Elias-Fano indices: an upper bit vector")
    idx_RK: np.ndarray = ((pos_RK - np.arange(k)) << low) | low_RK
    return idx_RK


def check_entries(idx_RK: np.ndarray, val_RK: np.ndarray, n: int, rows: Sequence[int], *, is_sorted: bool) -> None:
    """Bounds, order and repeats: an index may repeat in a row only where at most one value is nonzero."""
    if idx_RK.size == 0:
        return
    if int(idx_RK.max()) >= n:
        raise _bad(idx_RK >= n, rows, f"index {int(idx_RK.max())} out of range for {n} coefficients")
    if idx_RK.shape[1] < 2:
        return
    if is_sorted:
        down_RK = idx_RK[:, 1:] < idx_RK[:, :-1]
        if down_RK.any():
            raise _bad(down_RK, rows, "entropy-coded indices are not sorted")
        if not (idx_RK[:, 1:] == idx_RK[:, :-1]).any():
            return
    # Key = index and a nonzero bit: after a sort, two nonzero values at one index are equal odd neighbours.
    key_RK = (idx_RK.astype(np.int32) << 1) | (val_RK != 0)
    key_RK.sort(axis=1)
    clash_RK = (key_RK[:, 1:] == key_RK[:, :-1]) & (key_RK[:, 1:] & 1).astype(bool)
    if clash_RK.any():
        raise _bad(clash_RK, rows, "an index repeats within a chunk with more than one nonzero value")


# --- value encodings -----------------------------------------------------------------------------


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


def _bf16_codes(x: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 codes of float32 values, rounded to nearest even as torch rounds."""
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _bf16_values(codes: np.ndarray) -> np.ndarray:
    return (codes.astype(np.uint32) << 16).view(np.float32)  # exact


def _dequantize(codes_RK: np.ndarray, scale_R: np.ndarray | None, encoding: str) -> np.ndarray:
    """What receivers compute from the codes; encode checks its values against it, bit for bit."""
    if encoding == "fp32":
        return codes_RK
    if encoding == "bf16":
        return _bf16_values(codes_RK)
    assert scale_R is not None
    scale_R1 = scale_R.reshape(-1, 1)
    if encoding == "fp16":  # exact float16 -> float32, then times the power of two
        val_RK: np.ndarray = codes_RK.astype(np.float32) * scale_R1
    elif encoding == "int8":  # -128 carries -0.0
        val_RK = np.where(codes_RK == -128, np.float32(-0.0), codes_RK.astype(np.float32) * scale_R1)
    else:  # sign bits
        val_RK = np.where(codes_RK.astype(bool), np.float32(-1.0), np.float32(1.0)) * scale_R1
    return val_RK


def _check_scales(scale: np.ndarray, encoding: str, rows: Sequence[int]) -> None:
    """fp16: (T,) finite powers of two, as `quantize` makes them; int8 and sign: (R,) finite and >= 0."""
    if encoding == "fp16":
        bad_T = ~(np.isfinite(scale) & (scale > 0) & (np.frexp(scale)[0] == 0.5))
        if bad_T.any():
            raise _bad(bad_T, [1] * len(rows), f"fp16 scale {float(scale[bad_T][0])!r} is not a finite power of two")
    elif not (np.isfinite(scale) & (scale >= 0)).all():
        raise _bad(~(np.isfinite(scale) & (scale >= 0)), rows, f"{encoding} scales should be finite and >= 0")


def _check_finite(val_RK: np.ndarray, rows: Sequence[int], message: str) -> None:
    if not np.isfinite(val_RK).all():
        raise _bad(~np.isfinite(val_RK), rows, message)


@np.errstate(all="ignore")  # off-grid values overflow fp16 codes: the bit check catches them
def encode_values(
    val_RK: np.ndarray, scale: np.ndarray | None, encoding: str, rows: Sequence[int]
) -> tuple[list[bytes], list[bytes]]:
    """(value blobs, scale blobs) of a batch whose values went through `quantize`, else BadTensor.

    `scale` is what `quantize` returned, float32: (T,) for fp16, (R,) for int8 and sign.
    """
    k, codes_RK, scales, scale_R = val_RK.shape[1], val_RK, [b""] * len(rows), None
    if encoding == "bf16":
        codes_RK = (val_RK.view(np.uint32) >> 16).astype(np.uint16)  # exact for values on the grid
    elif encoding == "fp16":
        assert scale is not None
        scales, scale_R = _cut(scale.tobytes(), [4] * len(rows)), np.repeat(scale, rows)
        codes_RK = (val_RK / scale_R.reshape(-1, 1)).astype(np.float16)
    elif encoding in ("int8", "sign"):
        assert scale is not None
        bf16_R = _bf16_codes(scale)
        scales, scale_R = _cut(bf16_R.tobytes(), [2 * r for r in rows]), _bf16_values(bf16_R)
        if encoding == "int8":
            safe_R1 = np.where(scale_R > 0, scale_R, np.float32(1.0)).reshape(-1, 1)
            q_RK = np.clip(np.round(val_RK / safe_R1), -127, 127)
            q_RK[(val_RK == 0) & np.signbit(val_RK)] = -128  # -128 carries -0.0
            codes_RK = q_RK.astype(np.int8)
        else:
            codes_RK = np.signbit(val_RK).astype(np.uint8)
    if encoding != "fp32":  # error feedback is exact only if receivers decode the very bits the sender subtracted
        off_RK = _dequantize(codes_RK, scale_R, encoding).view(np.int32) != val_RK.view(np.int32)
        if off_RK.any():
            raise _bad(off_RK, rows, f"val is not on the {encoding} grid; pass what quantize() returned")
    if encoding == "sign":
        return _pack(codes_RK, rows), scales
    return _cut(codes_RK.tobytes(), [r * k * codes_RK.itemsize for r in rows]), scales


@np.errstate(all="ignore")  # a hostile fp16 scale overflows to inf: the finite check catches it
def decode_values(
    values: Blobs, scales: Blobs, encoding: str, rows: Sequence[int], k: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """((R, K) float32 values, the scales: (T,) for fp16, (R,) for int8 and sign, else None).

    Byte lengths and padding bits were checked by the caller; scales and values are checked here.
    """
    num_rows = sum(rows)
    scale = scale_R = None
    if encoding in ("fp16", "int8", "sign"):
        scale = scale_R = _join(scales, "<f4") if encoding == "fp16" else _bf16_values(_join(scales, "<u2"))
        _check_scales(scale, encoding, rows)
        if encoding == "fp16":
            scale_R = np.repeat(scale, rows)
    if encoding == "sign":
        codes_RK = _unpack(values, rows, k)
    else:
        dtype = {"fp32": "<f4", "bf16": "<u2", "fp16": "<f2", "int8": "i1"}[encoding]
        codes_RK = _join(values, dtype).reshape(num_rows, k)
    val_RK = _dequantize(codes_RK, scale_R, encoding)
    _check_finite(val_RK, rows, "values are not all finite")
    return val_RK, scale


# --- batches -------------------------------------------------------------------------------------


def encode_batch(
    idx_RK: np.ndarray,
    val_RK: np.ndarray,
    scale: np.ndarray | None,
    encoding: str,
    entropy: bool,
    n: int,
    rows: Sequence[int],
) -> tuple[list[str], list[bytes], list[bytes], list[bytes]]:
    """(index coding, indices, values, scales) of each tensor of a local batch; BadTensor if malformed.

    With `entropy`, rows travel sorted by index, in Elias-Fano or bitmap coding; else packed.
    """
    if idx_RK.size and (int(idx_RK.min()) < 0 or int(idx_RK.max()) >= n):
        raise _bad((idx_RK < 0) | (idx_RK >= n), rows, f"indices should be in [0, {n}) with k <= {n}")
    # NaN or Inf here means the momentum is already poisoned: a bug to crash on, not to send.
    _check_finite(val_RK, rows, "val holds NaN or Inf")
    if scale is not None:
        try:
            _check_scales(scale, encoding, rows)
        except BadTensor as e:
            raise BadTensor(e.tensor, f"{e}: not what quantize returns") from None
    codings = ["packed"] * len(rows)
    if entropy:
        idx_RK, val_RK = sort_rows(idx_RK, val_RK)
        codings = entropy_codings(idx_RK, n, rows)
    values, scales = encode_values(val_RK, scale, encoding, rows)
    return codings, encode_indices(codings, idx_RK, n, rows), values, scales


def decode_batch(
    coding: str, blobs: tuple[Blobs, Blobs, Blobs], encoding: str, rows: Sequence[int], k: int, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """((R, K) int64 indices, (R, K) float32 values, scales) of an inbound batch, every entry checked.

    `blobs`: each tensor's (indices, values, scales) bytes, their lengths and padding bits checked.
    """
    indices, values, scales = blobs
    idx_RK = decode_indices(coding, indices, rows, k, n)
    val_RK, scale = decode_values(values, scales, encoding, rows, k)
    check_entries(idx_RK, val_RK, n, rows, is_sorted=coding != "packed")
    return idx_RK, val_RK, scale
