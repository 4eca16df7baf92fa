"""Bit and byte plumbing shared by the index and value codecs (`_indices`, `_values`) of `demonet.wire`.

Imports numpy only; never protobuf or torch. A batch is the tensors of one payload that share (n, k):
their rows (chunks) end to end in one (R, K) array, ``rows[t]`` of them from tensor t, whose bytes
travel as its own byte-aligned blob.

Shape legend: R = rows (chunks) of a batch, K = entries per row, N = fields, W = bits of a field,
L = bits of one row.
Bit streams are LSB-first: bit j is ``(byte[j // 8] >> (j % 8)) & 1``.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

import numpy as np

from demonet.errors import BadTensor

Blobs = Sequence[bytes]


def bad(flags: np.ndarray, rows: Sequence[int], message: str) -> BadTensor:
    """BadTensor for the first flagged row: flags (R,), or (R, K) for any entry of the row."""
    row = int(np.flatnonzero(flags.reshape(flags.shape[0], -1).any(axis=1))[0])
    return BadTensor(bisect.bisect_right(list(itertools.accumulate(rows)), row), message)


def num_bytes(num_bits: int) -> int:
    return -(-num_bits // 8)


def padding_ok(blob: bytes, num_bits: int) -> bool:
    """The unused high bits of the last byte are 0 (one encoding per message); len(blob) was checked."""
    return num_bits % 8 == 0 or blob[-1] >> (num_bits % 8) == 0


def cut(data: bytes, sizes: Sequence[int]) -> list[bytes]:
    return [data[a:b] for a, b in itertools.pairwise(itertools.accumulate(sizes, initial=0))]


def join(blobs: Blobs, dtype: str) -> np.ndarray:
    """A fresh, writable 1-D array over the concatenated blobs."""
    return np.frombuffer(bytearray().join(blobs), dtype=dtype)


def flat(col_RK: np.ndarray, width: int) -> np.ndarray:
    """Flat positions of per-row columns in a C-contiguous (R, width) array (cheaper than *_along_axis)."""
    return col_RK + (np.arange(col_RK.shape[0]) * width)[:, None]


# --- bit fields --------------------------------------------------------------------------------


def _word(width: int) -> int:
    """Bytes of the smallest unsigned integer that holds `width` bits."""
    return 1 if width <= 8 else 2 if width <= 16 else 4 if width <= 32 else 8


def to_bits(values_N: np.ndarray, width: int) -> np.ndarray:
    """(N, W) uint8: the low `width` bits of non-negative integers, LSB first."""
    word = _word(width)
    bits = np.unpackbits(values_N.astype(f"<u{word}").view(np.uint8), bitorder="little")
    return bits.reshape(-1, 8 * word)[:, :width]


def from_bits(bits_NW: np.ndarray) -> np.ndarray:
    """(N,) int64 of LSB-first (N, W) bit fields, W <= 63."""
    num, width = bits_NW.shape
    word = _word(width)
    if width != 8 * word:
        padded_NW = np.zeros((num, 8 * word), np.uint8)
        padded_NW[:, :width] = bits_NW
        bits_NW = padded_NW
    return np.packbits(bits_NW.reshape(-1), bitorder="little").view(f"<u{word}").astype(np.int64)


def pack(bits_RL: np.ndarray, rows: Sequence[int]) -> list[bytes]:
    """Each tensor's rows of bits as its own zero-padded blob."""
    row_bits = bits_RL.shape[1]
    flat = bits_RL.reshape(-1)
    if all(r * row_bits % 8 == 0 for r in rows):  # no padding anywhere: pack once, then cut
        return cut(np.packbits(flat, bitorder="little").tobytes(), [r * row_bits // 8 for r in rows])
    bounds = itertools.pairwise(itertools.accumulate((r * row_bits for r in rows), initial=0))
    return [np.packbits(flat[a:b], bitorder="little").tobytes() for a, b in bounds]


def unpack(blobs: Blobs, rows: Sequence[int], row_bits: int) -> np.ndarray:
    """(R, L) uint8: the used bits of each blob (their lengths and padding were checked)."""
    bits = np.unpackbits(join(blobs, "u1"), bitorder="little")
    if any(r * row_bits % 8 for r in rows):
        starts = itertools.accumulate((8 * len(b) for b in blobs), initial=0)
        bits = np.concatenate([bits[s : s + r * row_bits] for s, r in zip(starts, rows, strict=False)])
    return bits.reshape(sum(rows), row_bits)

