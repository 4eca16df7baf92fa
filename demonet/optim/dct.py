"""Orthonormal DCT-II bases and the chunked 2-D transform over batches of blocks.

Math layer: imports torch only.

Shape legend: B = blocks (chunks), h x w = chunk shape, S = sparse entries per block,
R x Cc = a tensor's 2-D view, Y x X = its grid of chunks.
A block's coefficients are ``D_h @ block @ D_w.T`` (the reference's ``f_dict[n] = D.T``); the
inverse is ``D_h.T @ coef @ D_w``. A 1-D tensor is a 1 x n view: D_1 = [[1]], so only the columns
are transformed, as in the reference's 1-D path.

Two halves with two contracts. `encode` (a peer's compress) uses the fastest kernels there are: its
bits may differ between machines. `decode_exact` (every peer's and the coordinator's apply) gives
the same bits on every IEEE-754 machine, whatever the vector width, thread count, BLAS or GPU:
it computes in float64 on integers small enough that no sum is ever rounded (see its docstring).
"""

from __future__ import annotations

import functools
from decimal import ROUND_HALF_EVEN, Decimal, localcontext

import torch

__all__ = ["BASIS_BITS", "add_blocks_", "block_view", "dct_matrix", "decode_exact", "decode_sign", "encode",
           "fast_float32_gemm", "pow2", "to_blocks"]


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
def _basis_max(n: int) -> int:
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


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2.0 ** exponent in float64, exactly, for integer exponents in [-1022, 1023] (built from the bits:
    no ``exp2``/``ldexp`` kernel whose rounding could vary)."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def _quantum_shift(amax_B1: torch.Tensor, width: int, h: int, w: int) -> torch.Tensor:
    """(B, 1) int64: log2 of `decode_exact`'s quantum q_b per block, from an exact bound on |R|:
    max |val| * max |D_h| < 2^e (frexp's exponent), so that |R| / q_b <= 2^(53 - e_S - e_M).
    `amax_B1` is each block's max |val|."""
    e_s = max(width - 1, 0).bit_length()  # S <= 2^e_s
    e_m = _basis_max(w).bit_length()  # |D_w| * 2^23 < 2^e_m
    _, e_B1 = torch.frexp(amax_B1.to(torch.float64) * (_basis_max(h) * 2.0**-BASIS_BITS))  # exact product
    return e_B1.to(torch.int64) + (e_s + e_m - 53)


def decode_exact(idx_BS: torch.Tensor, val_BS: torch.Tensor, d_h: torch.Tensor, d_w: torch.Tensor,
                 out_BHW: torch.Tensor, work: torch.Tensor) -> None:
    """``out[b] = sum_s val[b, s] * outer(D_h[i_s], D_w[j_s])``, the same bits on every machine.

    Why it is exact. Let R[b, s, :] = val[b, s] * D_h[i_s] (float64: a 24-bit value times a 24-bit
    basis entry is exact). Per block, R is rounded to a multiple of a power of two q_b chosen so that
    |R| / q_b <= 2^(53 - e_S - e_M), where S <= 2^e_S and every |D_w| * 2^23 < 2^e_M. Every product
    R[s, y] * D_w[j_s, x] is then a multiple of q_b * 2^-23 below 2^(53 - e_S) of those quanta, and
    any sum of at most S of them is below 2^53 quanta: an integer float64 represents exactly. So the
    batched matrix product ``R^T @ D_w[j]`` is exact whatever order, blocking, FMA or thread split a
    BLAS or GPU uses, and the final cast to the output dtype is one correctly rounded operation.
    The rounding of R is the only approximation: |R| keeps 53 - e_S - e_M bits (27 at S = 32, h = 64)
    relative to the block's largest entry, finer than float32.

    Args:
        idx_BS, val_BS: (B, S) coefficient indices ``i * w + j`` and values (padding: value 0).
        d_h, d_w: (h, h) and (w, w) float64 bases on the 2^-23 grid (`dct_matrix`).
        out_BHW: (B, h, w) output, any float dtype.
        work: flat float64 work space of at least B * S * (h + w) + B * h * w elements.
    """
    num_blocks, h, w = out_BHW.shape
    width = idx_BS.shape[1]
    r_BSH = work[: num_blocks * width * h].view(num_blocks, width, h)
    c_BSW = work[r_BSH.numel(): r_BSH.numel() + num_blocks * width * w].view(num_blocks, width, w)
    u_BHW = work[r_BSH.numel() + c_BSW.numel(): r_BSH.numel() + c_BSW.numel() + out_BHW.numel()].view(out_BHW.shape)
    i_BS = torch.div(idx_BS, w, rounding_mode="floor")
    torch.index_select(d_h, 0, i_BS.view(-1), out=r_BSH.view(-1, h))
    torch.index_select(d_w, 0, (idx_BS - i_BS * w).view(-1), out=c_BSW.view(-1, w))
    shift_B1 = _quantum_shift(val_BS.abs().amax(dim=1, keepdim=True), width, h, w)
    # R / q_b = D_h[i] * (val / q_b): dividing by a power of two is exact, so is the product; then
    # round half to even onto the integers.
    r_BSH.mul_(val_BS.to(torch.float64).mul(pow2(-shift_B1)).unsqueeze(-1)).round_()
    c_BSW.mul_(pow2(shift_B1).unsqueeze(-1))  # exact: the quantum goes back in through D_w
    torch.bmm(r_BSH.transpose(1, 2), c_BSW, out=u_BHW)
    out_BHW.copy_(u_BHW)  # one rounding


def _exact_at(idx_BS: torch.Tensor, val_BS: torch.Tensor, shift_B1: torch.Tensor, d_h: torch.Tensor,
              d_w: torch.Tensor, at_N3: torch.Tensor) -> torch.Tensor:
    """`decode_exact`'s float64 sum at N positions (block, y, x) only: (N,), before its final rounding."""
    w = d_w.shape[0]
    b_N, y_N, x_N = at_N3.unbind(1)
    idx_NS = idx_BS[b_N]
    i_NS = torch.div(idx_NS, w, rounding_mode="floor")
    scale_N1 = pow2(shift_B1[b_N])
    r_NS = (d_h[i_NS, y_N[:, None]] * (val_BS[b_N].to(torch.float64) * pow2(-shift_B1[b_N]))).round_()
    return (r_NS * (d_w[idx_NS - i_NS * w, x_N[:, None]] * scale_N1)).sum(dim=1)  # exact: any order


_U32 = 2.0**-24  # float32's unit roundoff


def decode_sign(idx_BS: torch.Tensor, val_BS: torch.Tensor, d_h: torch.Tensor, d_w: torch.Tensor,
                out_BHW: torch.Tensor, work: torch.Tensor) -> None:
    """``sign(u)`` of `decode_exact`'s u into float32 `out`, the same bits, in about a float32 GEMM's time.

    A float32 batched GEMM computes u fast but rounds in an order the machine chooses. Its error is
    bounded all the same: a sum of S products, in any order, with or without FMA, is within
    ``gamma_(S+2) * sum |terms|`` of the exact sum (Higham, Accuracy and Stability of Numerical
    Algorithms, 3.1), here ``gamma * sum|val| * max|D_h| * max|D_w|`` per block, plus
    ``S * q_b / 2 * max|D_w|`` for `decode_exact`'s rounding of R and S smallest subnormals for
    underflow. Where |u32| exceeds that bound, its sign is the sign of `decode_exact`'s u. The few
    entries within it (about 2e-5 of them for Gaussian values at S = 32) are summed exactly, as
    `decode_exact` does. Valid only where a float32 GEMM is IEEE float32 (no TF32 or bf16 shortcut,
    see `fast_float32_gemm`); the bases are float64 on the 2^-23 grid, as for `decode_exact`.

    Args: as `decode_exact`, with `out_BHW` float32 and `work` float64 of at least
        (B * S * (h + w) + B * h * w) / 2 elements.
    """
    num_blocks, h, w = out_BHW.shape
    width = idx_BS.shape[1]
    m_h, m_w = _basis_max(h) * 2.0**-BASIS_BITS, _basis_max(w) * 2.0**-BASIS_BITS
    amax_B1 = val_BS.abs().amax(dim=1, keepdim=True)
    if float(amax_B1.max()) * width * m_h * m_w >= 2.0**100:
        decode_exact(idx_BS, val_BS, d_h, d_w, out_BHW, work)  # float32 partial sums could overflow
        out_BHW.sign_()
        return
    flat = work.view(torch.float32)
    r_BSH = flat[: num_blocks * width * h].view(num_blocks, width, h)
    c_BSW = flat[r_BSH.numel(): r_BSH.numel() + num_blocks * width * w].view(num_blocks, width, w)
    d_h32, d_w32 = _float32_bases(d_h, d_w)
    i_BS = torch.div(idx_BS, w, rounding_mode="floor")
    torch.index_select(d_h32, 0, i_BS.view(-1), out=r_BSH.view(-1, h))
    torch.index_select(d_w32, 0, (idx_BS - i_BS * w).view(-1), out=c_BSW.view(-1, w))
    val32_BS = val_BS.to(torch.float32)
    r_BSH.mul_(val32_BS.unsqueeze(-1))
    torch.bmm(r_BSH.transpose(1, 2), c_BSW, out=out_BHW)
    # The bound per block, in float64, rounded up by a margin far above its own rounding errors.
    shift_B1 = _quantum_shift(amax_B1, width, h, w)
    gamma = (width + 2) * _U32 / (1 - (width + 2) * _U32)
    sum_B1 = val_BS.abs().sum(dim=1, keepdim=True, dtype=torch.float64)  # its rounding: inside the margin
    eps_B1 = (sum_B1 * (gamma * m_h * m_w)
              + pow2(shift_B1) * (width / 2 * m_w) + (width + 2) * 2.0**-149) * (1 + 2.0**-20) + 2.0**-147
    # (the last term: beyond the bound, the exact u is also too large to round to a float32 zero).
    # In float32 the bound may round down by 2^-24 relative: the 2^-20 margin covers it.
    eps_B11 = eps_B1.to(torch.float32).unsqueeze(-1)
    abs_BHW = flat[r_BSH.numel() + c_BSW.numel():][: out_BHW.numel()].view(out_BHW.shape)
    torch.abs(out_BHW, out=abs_BHW)
    near_K = (abs_BHW.view(num_blocks, -1).amin(dim=1) <= eps_B11.view(-1)).nonzero().view(-1)  # few blocks
    near_N3 = (abs_BHW[near_K] <= eps_B11[near_K]).nonzero()
    near_N3[:, 0] = near_K[near_N3[:, 0]]
    out_BHW.sign_()
    if near_N3.numel():
        exact_N = _exact_at(idx_BS, val_BS, shift_B1, d_h, d_w, near_N3)
        out_BHW[near_N3.unbind(1)] = exact_N.to(torch.float32).sign()  # round first, as decode_exact does


def fast_float32_gemm(device: torch.device) -> bool:
    """Whether float32 matrix products on `device` are IEEE float32 (what `decode_sign` relies on)."""
    if torch.get_float32_matmul_precision() != "highest":
        return False  # TF32 on CUDA, bf16 in oneDNN on CPU
    return device.type == "cpu" or (device.type == "cuda" and not torch.backends.cuda.matmul.allow_tf32)


@functools.lru_cache(maxsize=32)
def _float32_cached(n: int, device: torch.device) -> torch.Tensor:
    return dct_matrix(n, torch.float32, device)


def _float32_bases(d_h: torch.Tensor, d_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 copies of two float64 grid bases (exact: 24 bits)."""
    return _float32_cached(d_h.shape[0], d_h.device), _float32_cached(d_w.shape[0], d_w.device)
