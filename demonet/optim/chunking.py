"""How DeMo cuts a tensor into chunks: the reference's divisor rule and a padding policy.

Math layer: imports torch-free stdlib only.
"""

from __future__ import annotations

import math

__all__ = ["CHUNK_POLICIES", "chunk_shape", "chunk_size", "divisors", "reference_chunk_size"]

CHUNK_POLICIES = ("reference", "pad")
"""``reference``: the chunk side is a divisor of the dimension (bloc97/DeMo's ``_get_smaller_split``),
which collapses to tiny chunks on awkward sizes (vocab 50257 -> 29, a prime -> 1).
``pad``: the same as ``reference`` whenever that divisor is at least half the target; otherwise the
chunk side is the target and the last chunk is zero-padded (50257 -> 64, 786 chunks, 47 padding rows).
"""


def divisors(n: int) -> list[int]:
    """All divisors of n >= 1 in ascending order."""
    if n < 1:
        raise ValueError(f"n should be >= 1, got {n}")
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def reference_chunk_size(n: int, target: int) -> int:
    """The reference rule: `target` if it divides n, else the largest divisor of n below it; n if n <= target."""
    if target < 1:
        raise ValueError(f"target should be >= 1, got {target}")
    if n <= target:
        return n
    return max(d for d in divisors(n) if d <= target)


def chunk_size(n: int, target: int, policy: str = "reference") -> int:
    """Chunk side for a dimension of size n.

    Args:
        n: dimension size (>= 1).
        target: the wanted chunk side (`compression_chunk`).
        policy: one of `CHUNK_POLICIES`.
    """
    if policy not in CHUNK_POLICIES:
        raise ValueError(f"chunk_policy should be one of {CHUNK_POLICIES}, got {policy!r}")
    size = reference_chunk_size(n, target)
    if policy == "pad" and n > target and 2 * size < target:
        return target
    return size


def chunk_shape(rows: int, cols: int, target: int, policy: str = "reference") -> tuple[int, int]:
    """(h, w) chunk of a rows x cols matrix view; a 1-D tensor is a 1 x n view, so h == 1."""
    return chunk_size(rows, target, policy), chunk_size(cols, target, policy)
