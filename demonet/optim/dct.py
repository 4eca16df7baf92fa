"""Orthonormal DCT-II bases and the chunked 2-D transform over batches of blocks.

Math layer: imports torch only.

Shape legend: B = blocks (chunks), h x w = chunk shape, S = sparse entries per block,
R x Cc = a tensor's 2-D view, Y x X = its grid of chunks.
A block's coefficients are ``D_h @ block @ D_w.T`` (the reference's ``f_dict[n] = D.T``); the
inverse is ``D_h.T @ coef @ D_w``. A 1-D tensor is a 1 x n view: D_1 = [[1]], so only the columns
are transformed, as in the reference's 1-D path.

`encode` (a peer's compress) uses the fastest kernels there are: its bits may differ between
machines. The inverse, in every peer's and the coordinator's apply, must not: it lives in
`demonet.optim.exact`. The basis here is the same bits everywhere (`dct_matrix`).
"""

from __future__ import annotations

import functools
from decimal import ROUND_HALF_EVEN, Decimal, localcontext

import torch

__all__ = ["BASIS_BITS", "add_blocks_", "block_view", "basis_max", "dct_matrix", "encode", "to_blocks"]


BASIS_BITS = 23
"""The basis lives on the grid 2^-23: every entry is an integer times 2^-23, so it is exact in float32
and float64 alike, and a product with it has a known quantum (what `decode_exact` builds on)."""

_PI = Decimal("3.14159265358979323846264338327950288419716939937510582097494459230781640628620899863")
_DIGITS = 50  # decimal digits for the basis; the grid keeps 7 of them


def _cos(x: Decimal) -> Decimal:
    """cos(x) for 0 <= x <= pi/2 by its Taylor series, in the decimal context's precision."""
    term, total, x2, i = Decimal(1), Decimal(1), x * x, 0
    while True:
        i += 2
        term = -term * x2 / (i * (i - 1))
        if abs(term) < Decimal(10) ** -(_DIGITS + 5):
            return total
        total += term


@functools.lru_cache(maxsize=64)
def _basis_integers(n: int) -> tuple[tuple[int, ...], ...]:
    """round(D[k, j] * 2^BASIS_BITS) for the orthonormal n x n DCT-II, computed in decimal arithmetic.

    Python's decimal module implements a fully specified arithmetic (no libm, no FMA, no vector
    kernels), so these integers are the same on every machine; ties round to even.
    """
    with localcontext() as ctx:
        ctx.prec = _DIGITS + 10
        ctx.rounding = ROUND_HALF_EVEN
        # cos(pi * m / 2n) for m in [0, 4n): fold onto [0, pi/2] by the symmetries of cos.
        table = []
        for m in range(4 * n):
            q, r = divmod(m, n)  # angle = q * pi/2 + r * pi/2n
            if r == 0:
                table.append((Decimal(1), Decimal(0), Decimal(-1), Decimal(0))[q])
                continue
            c = _cos(_PI * r / (2 * n))
            s = _cos(_PI * (n - r) / (2 * n))  # sin(pi r / 2n)
            table.append((c, -s, -c, s)[q])
        grid = Decimal(2) ** BASIS_BITS
        c0, ck = (Decimal(1) / n).sqrt(), (Decimal(2) / n).sqrt()
        rows = []
        for k in range(n):
            scale = c0 if k == 0 else ck
            rows.append(tuple(int((scale * table[(2 * j + 1) * k % (4 * n)] * grid).to_integral_value())
                              for j in range(n)))
    return tuple(rows)


@functools.lru_cache(maxsize=64)
def basis_max(n: int) -> int:
    """The largest |D[k, j]| * 2^BASIS_BITS of the n x n basis."""
    return max(abs(x) for row in _basis_integers(n) for x in row)


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The n x n orthonormal DCT-II matrix ``D[k, j] = c_k cos(pi (2j + 1) k / 2n)`` on the 2^-23 grid.

    The same bits on every machine: computed in decimal arithmetic (no libm ``cos``, whose last bit
    varies by platform), rounded to the nearest multiple of 2^-23 (|error| <= 2^-24 per entry, so
    ``D @ D.T`` is the identity to about 1e-7), exact in float32 and float64.
    """
    if n < 1:
        raise ValueError(f"n should be >= 1, got {n}")
    ints = torch.tensor(_basis_integers(n), dtype=torch.float64)
    return (ints * 2.0**-BASIS_BITS).to(dtype=dtype, device=device)


def block_view(x2d: torch.Tensor, h: int, w: int) -> torch.Tensor | None:
    """x2d (R, Cc) seen as its (Y, X, h, w) blocks without a copy, or None if they do not tile it."""
    rows, cols = x2d.shape
    if rows % h or cols % w:
        return None
    return x2d.view(rows // h, h, cols // w, w).permute(0, 2, 1, 3)


def to_blocks(x2d: torch.Tensor, h: int, w: int, out_BHW: torch.Tensor) -> None:
    """Copy a (R, Cc) matrix into row-major blocks (Y * X, h, w), zero-padding a ragged edge."""
    rows, cols = x2d.shape
    grid_y, grid_x = -(-rows // h), -(-cols // w)
    if rows == grid_y * h and cols == grid_x * w:
        out_BHW.view(grid_y, grid_x, h, w).copy_(x2d.view(grid_y, h, grid_x, w).permute(0, 2, 1, 3))
        return
    padded = x2d.new_zeros(grid_y * h, grid_x * w)  # rare: only for padded chunk grids
    padded[:rows, :cols] = x2d
    out_BHW.view(grid_y, grid_x, h, w).copy_(padded.view(grid_y, h, grid_x, w).permute(0, 2, 1, 3))


def add_blocks_(x2d: torch.Tensor, blocks_BHW: torch.Tensor, alpha: float = 1.0) -> None:
    """``x2d += alpha * blocks`` where the blocks tile x2d (R, Cc) row-major; padding is dropped.

    Callers that need the same bits on every machine pass alpha = 1, or blocks of -1, 0 and 1 with a
    float32 alpha (then alpha * blocks is exact, and a fused multiply-add rounds as a plain add).
    """
    rows, cols = x2d.shape
    _, h, w = blocks_BHW.shape
    grid_y, grid_x = -(-rows // h), -(-cols // w)
    blocks_YhXw = blocks_BHW.view(grid_y, grid_x, h, w).permute(0, 2, 1, 3)  # (Y, h, X, w)
    if rows == grid_y * h and cols == grid_x * w:
        x2d.view(grid_y, h, grid_x, w).add_(blocks_YhXw, alpha=alpha)
        return
    x2d.add_(blocks_YhXw.reshape(grid_y * h, grid_x * w)[:rows, :cols], alpha=alpha)  # rare: padded grid


def encode(x_BHW: torch.Tensor, d_h: torch.Tensor, d_wt: torch.Tensor, scratch_BHW: torch.Tensor,
           acc_BHW: torch.Tensor, beta: float, alpha: float) -> None:
    """``acc = beta * acc + alpha * (D_h @ x @ D_w.T)`` over all blocks, in place, no allocation.

    Args:
        x_BHW: (B, h, w) input blocks.
        d_h: (h, h) DCT matrix for the rows.
        d_wt: (w, w) the transposed DCT matrix for the columns (contiguous).
        scratch_BHW: (B, h, w) work space.
        acc_BHW: (B, h, w) accumulator (the momentum, in the DCT domain).
    """
    num_blocks, h, w = x_BHW.shape
    if w > 1:
        torch.mm(x_BHW.view(num_blocks * h, w), d_wt, out=scratch_BHW.view(num_blocks * h, w))
    else:
        scratch_BHW.copy_(x_BHW)
    if h > 1:
        acc_BHW.baddbmm_(d_h.expand(num_blocks, h, h), scratch_BHW, beta=beta, alpha=alpha)
    elif beta == 0.0:
        torch.mul(scratch_BHW, alpha, out=acc_BHW)
    else:
        acc_BHW.mul_(beta).add_(scratch_BHW, alpha=alpha)
