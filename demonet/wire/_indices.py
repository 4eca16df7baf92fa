"""Index codings of `demonet.wire`: packed, Elias-Fano and bitmap, and the checks of inbound entries.

Imports numpy and `_bits`; never protobuf or torch.

Shape legend: R = rows (chunks) of a batch, K = entries per row, L = bits of one row's index code,
H = Elias-Fano upper bits of a row.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from ._bits import Blobs, bad, flat, from_bits, pack, to_bits, unpack

CODINGS = ("packed", "elias_fano", "bitmap")


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
    return key_RK >> shift, np.ascontiguousarray(val_RK).reshape(-1)[flat(key_RK & ((1 << shift) - 1), k)]


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
        return to_bits(idx_RK.reshape(-1), width).reshape(num_rows, k * width)
    if coding == "bitmap":
        bits_RL = np.zeros((num_rows, n), np.uint8)
        bits_RL.reshape(-1)[flat(idx_RK, n)] = 1
        return bits_RL
    low = ef_low_bits(n, k)
    bits_RL = np.zeros((num_rows, ef_chunk_bits(n, k)), np.uint8)
    bits_RL[:, : k * low] = to_bits((idx_RK & ((1 << low) - 1)).reshape(-1), low).reshape(num_rows, k * low)
    upper_RK = k * low + (idx_RK >> low) + np.arange(k)  # bit (x_i >> l) + i of the upper vector
    bits_RL.reshape(-1)[flat(upper_RK, bits_RL.shape[1])] = 1
    return bits_RL


def encode_indices(codings: Sequence[str], idx_RK: np.ndarray, n: int, rows: Sequence[int]) -> list[bytes]:
    """Each tensor's index blob, in its coding of `CODINGS`."""
    if len(set(codings)) == 1:
        return pack(_index_bits(codings[0], idx_RK, n), rows)
    out, starts = [b""] * len(rows), list(itertools.accumulate(rows, initial=0))
    for coding in set(codings):  # bitmap for some tensors, Elias-Fano for the others: one sub-batch each
        members = [t for t, c in enumerate(codings) if c == coding]
        sub_RK = np.concatenate([idx_RK[starts[t] : starts[t + 1]] for t in members])
        for t, blob in zip(members, pack(_index_bits(coding, sub_RK, n), [rows[t] for t in members]), strict=True):
            out[t] = blob
    return out


def _ones(bits_RH: np.ndarray, k: int, rows: Sequence[int], what: str) -> np.ndarray:
    """(R, K): the column of each row's one bits, ascending; every row must hold exactly k."""
    ones_RH = np.ascontiguousarray(bits_RH).view(np.bool_)  # 0/1 bytes; numpy's bool paths are ~7x faster
    wrong_R = np.count_nonzero(ones_RH, axis=1) != k
    if wrong_R.any():
        raise bad(wrong_R, rows, f"{what} does not hold exactly k={k} ones")
    num_rows, width = ones_RH.shape
    pos_RK: np.ndarray = np.flatnonzero(ones_RH).reshape(num_rows, k) - (np.arange(num_rows) * width)[:, None]
    return pos_RK


def decode_indices(coding: str, blobs: Blobs, rows: Sequence[int], k: int, n: int) -> np.ndarray:
    """(R, K) int64 indices of a batch's blobs (lengths and padding bits already checked)."""
    bits_RL = unpack(blobs, rows, index_row_bits(coding, n, k))
    num_rows = bits_RL.shape[0]
    if coding == "packed":
        return from_bits(bits_RL.reshape(num_rows * k, index_width(n))).reshape(num_rows, k)
    if coding == "bitmap":
        return _ones(bits_RL, k, rows, "bitmap indices: a chunk's map")
    low = ef_low_bits(n, k)
    low_RK = from_bits(bits_RL[:, : k * low].reshape(num_rows * k, low)).reshape(num_rows, k)
    pos_RK = _ones(bits_RL[:, k * low :], k, rows, "Elias-Fano indices: an upper bit vector")
    idx_RK: np.ndarray = ((pos_RK - np.arange(k)) << low) | low_RK
    return idx_RK


def check_entries(idx_RK: np.ndarray, val_RK: np.ndarray, n: int, rows: Sequence[int], *, is_sorted: bool) -> None:
    """Bounds, order and repeats: an index may repeat in a row only where at most one value is nonzero."""
    if idx_RK.size == 0:
        return
    if int(idx_RK.max()) >= n:
        raise bad(idx_RK >= n, rows, f"index {int(idx_RK.max())} out of range for {n} coefficients")
    if idx_RK.shape[1] < 2:
        return
    if is_sorted:
        down_RK = idx_RK[:, 1:] < idx_RK[:, :-1]
        if down_RK.any():
            raise bad(down_RK, rows, "entropy-coded indices are not sorted")
        if not (idx_RK[:, 1:] == idx_RK[:, :-1]).any():
            return
    # Key = index and a nonzero bit: after a sort, two nonzero values at one index are equal odd neighbours.
    key_RK = (idx_RK.astype(np.int32) << 1) | (val_RK != 0)
    key_RK.sort(axis=1)
    clash_RK = (key_RK[:, 1:] == key_RK[:, :-1]) & (key_RK[:, 1:] & 1).astype(bool)
    if clash_RK.any():
        raise bad(clash_RK, rows, "an index repeats within a chunk with more than one nonzero value")

