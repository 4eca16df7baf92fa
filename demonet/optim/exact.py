"""The apply's arithmetic that gives the same bits on every IEEE-754 machine: the exact decode of an
aggregate (`decode_exact`), its sign in a float32 GEMM's time (`decode_sign`), and scalars rounded
as kernels use them (`as_opmath`, `ipow`). See docs/determinism.md.

Math layer: imports torch only. Shape legend as in `demonet.optim.dct`.
"""

from __future__ import annotations

import functools

import torch

from .dct import BASIS_BITS, basis_max, dct_matrix

__all__ = ["as_opmath", "decode_exact", "decode_sign", "fast_float32_gemm", "ipow", "pow2", "sqrt_exact",
           "terms_log2"]


def as_opmath(x: float, dtype: torch.dtype) -> float:
    """x rounded to the dtype a kernel on `dtype` tensors computes in (as a Python float).

    A kernel that multiplies in float64 and one that multiplies in the tensor's dtype then give the
    same bits: a product of two 24-bit significands is exact in float64, so rounding it once to
    float32 is the float32 product."""
    if dtype == torch.float64:
        return x
    # half-precision kernels compute in float32 (PyTorch's "opmath" type) and round the result once
    return float(torch.tensor(x, dtype=torch.float64).to(torch.float32))


def ipow(x: float, n: int) -> float:
    """x ** n for an integer n >= 0 by repeated squaring in IEEE double: the same bits on every
    machine (``**`` on floats calls the C library's pow, whose last bit varies by platform)."""
    result = 1.0
    while n:
        if n & 1:
            result *= x
        x *= x
        n >>= 1
    return result


def sqrt_exact(x: torch.Tensor, out: torch.Tensor, piece: int = 0) -> torch.Tensor:
    """``out = sqrt(x)`` correctly rounded, for x >= 0 in float32, bfloat16 or float16 (float64: `torch.sqrt`).

    ``torch.sqrt`` of float32 is not correctly rounded on every machine: a CPU build of torch 2.13 was
    seen 1 ulp off on about one value in five, the same at every kernel level, while CUDA's is correctly
    rounded. So the float64 root rounded to float32 is a first guess, within 1 ulp even if that root is
    a few of its own ulps off, and `_nearest_root` moves it to the correctly rounded root. A half-
    precision result is the float32 root rounded once more, which gives the correctly rounded root
    (float32 has more than twice their precision plus 2 bits).

    It works in pieces of `piece` values, at least `_SQRT_PIECE`: each piece is a fixed set of kernels and
    holds float64 temporaries of 8 bytes a value. A bucket's cap (`demonet.optim.buckets`) is one piece."""
    if x.dtype == torch.float64:
        return torch.sqrt(x, out=out)
    flat_x, flat_out = x.reshape(-1), out.view(-1)  # in pieces: the float64 temporaries stay bounded
    piece = max(piece, _SQRT_PIECE)
    for start in range(0, flat_x.numel(), piece):
        x64 = flat_x[start:start + piece].double()
        flat_out[start:start + piece] = _nearest_root(x64, torch.sqrt(x64).float())
    return out


def _nearest_root(x64: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The float32 nearest to sqrt(x), from a float32 guess `s` within 1 ulp of it (x: float32 values
    held in float64). s moves to the neighbour whose rounding interval holds sqrt(x): the midpoints
    between s and its neighbours have 25 significant bits, so their squares, and the comparisons with
    x, are exact in float64 (and a root is never a midpoint)."""
    up = torch.nextafter(s, torch.full_like(s, float("inf")))
    mid = (s.double() + up.double()) * 0.5  # exact: both have 24 bits and exponents at most one apart
    s = torch.where(x64 > mid * mid, up, s)
    down = torch.nextafter(s, torch.zeros_like(s))
    mid = (s.double() + down.double()) * 0.5
    return torch.where(x64 < mid * mid, down, s)


_SQRT_PIECE = 1 << 22
"""`sqrt_exact` works on pieces of this many values (float64 temporaries of 32 MiB each)."""


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2.0 ** exponent in float64, exactly, for integer exponents in [-1022, 1023] (built from the bits:
    no ``exp2``/``ldexp`` kernel whose rounding could vary)."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def terms_log2(terms: int) -> int:
    """e_S of `decode_exact`: the least e with terms <= 2^e."""
    return max(terms - 1, 0).bit_length()


def _quantum_shift(amax_B1: torch.Tensor, e_s: int | torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, 1) int64: log2 of `decode_exact`'s quantum q_b per block, from an exact bound on |R|:
    max |val| * max |D_h| < 2^e (frexp's exponent), so that |R| / q_b <= 2^(53 - e_S - e_M).
    `amax_B1` is each block's max |val|; `e_s` an int, or (B, 1) int64 per block."""
    e_m = basis_max(w).bit_length()  # |D_w| * 2^23 < 2^e_m
    _, e_B1 = torch.frexp(amax_B1.to(torch.float64) * (basis_max(h) * 2.0**-BASIS_BITS))  # exact product
    return e_B1.to(torch.int64) + (e_s + e_m - 53)


def decode_exact(idx_BS: torch.Tensor, val_BS: torch.Tensor, d_h: torch.Tensor, d_w: torch.Tensor,
                 out_BHW: torch.Tensor, work: torch.Tensor, e_s: int | torch.Tensor | None = None) -> None:
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
        e_s: S's e_S (`terms_log2`): an int, or (B, 1) int64 per block; None: the width's. A block's
            nonzero values must be at most 2^e_S (padding adds exact zeros). The apply passes the widest
            tensor's of the block's decode group (`demonet.optim.buckets`), so that its bits do not depend
            on the buckets a device batches its blocks in.
    """
    num_blocks, h, w = out_BHW.shape
    width = idx_BS.shape[1]
    e_s = terms_log2(width) if e_s is None else e_s
    r_BSH = work[: num_blocks * width * h].view(num_blocks, width, h)
    c_BSW = work[r_BSH.numel(): r_BSH.numel() + num_blocks * width * w].view(num_blocks, width, w)
    u_BHW = work[r_BSH.numel() + c_BSW.numel(): r_BSH.numel() + c_BSW.numel() + out_BHW.numel()].view(out_BHW.shape)
    i_BS = torch.div(idx_BS, w, rounding_mode="floor")
    torch.index_select(d_h, 0, i_BS.view(-1), out=r_BSH.view(-1, h))
    torch.index_select(d_w, 0, (idx_BS - i_BS * w).view(-1), out=c_BSW.view(-1, w))
    shift_B1 = _quantum_shift(val_BS.abs().amax(dim=1, keepdim=True), e_s, h, w)
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
                out_BHW: torch.Tensor, work: torch.Tensor, e_s: int | torch.Tensor | None = None) -> None:
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
        (B * S * (h + w) + B * h * w) / 2 elements. The error bound counts all S entries of a block,
        padding too: larger than it need be where e_s is smaller, never smaller.
    """
    num_blocks, h, w = out_BHW.shape
    width = idx_BS.shape[1]
    e_s = terms_log2(width) if e_s is None else e_s
    m_h, m_w = basis_max(h) * 2.0**-BASIS_BITS, basis_max(w) * 2.0**-BASIS_BITS
    amax_B1 = val_BS.abs().amax(dim=1, keepdim=True)
    if float(amax_B1.max()) * width * m_h * m_w >= 2.0**100:
        decode_exact(idx_BS, val_BS, d_h, d_w, out_BHW, work, e_s)  # float32 partial sums could overflow
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
    shift_B1 = _quantum_shift(amax_B1, e_s, h, w)
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
