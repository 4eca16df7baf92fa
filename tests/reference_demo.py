"""Test oracle: a slow, per-parameter re-statement of bloc97/DeMo's step (research notes §1.2-1.7).

Written from the notes, not copied from the reference, and independent of `demonet.optim`: it
checks that package, so it must not import it. Imports torch only. Not a test module.

Shape legend: Y, X = block rows and columns, A, B = block side lengths (n1, n2), K = kept
coefficients per block, W = ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = [
    "ReferenceDeMo",
    "chunk_size",
    "coeff_shape",
    "dct_matrix",
    "decode",
    "decompress",
    "encode",
    "select_topk",
]

Sparse = tuple[torch.Tensor, torch.Tensor]
"""(idx, val) of one parameter: int64 indices into each flattened block, and signed values."""


def chunk_size(n: int, target: int) -> int:
    """The reference's `_get_smaller_split(n, target)`: the chunk side for a dimension of size n.

    `target` if it divides n; otherwise the largest divisor of n below `target`; n itself when
    n <= target (a small dimension is one chunk).
    """
    if n < 1 or target < 1:
        raise ValueError(f"n and target should be >= 1, got n={n} target={target}")
    if n <= target:
        return n
    if n % target == 0:
        return target
    return max(d for d in range(1, target) if n % d == 0)


def dct_matrix(n: int) -> torch.Tensor:
    """(n, n) float64 orthonormal DCT-II: `D[k, j] = c_k cos(pi (2j + 1) k / (2n))`.

    `D @ x` is the DCT of x and `D.T @ c` the inverse. The reference's forward basis
    `f_dict[n]` is `D.T` and its backward basis `b_dict[n]` is `D`.
    """
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)  # (n, 1)
    j = torch.arange(n, dtype=torch.float64).unsqueeze(0)  # (1, n)
    c = torch.full((n, 1), math.sqrt(2.0 / n), dtype=torch.float64)  # (n, 1)
    c[0] = math.sqrt(1.0 / n)
    return c * torch.cos(math.pi * (2 * j + 1) * k / (2 * n))  # (n, n)


def _basis(n: int, device: torch.device) -> torch.Tensor:
    # fp32 like the reference's basis in an fp32 run (built, then cast to the param dtype).
    return dct_matrix(n).to(device=device, dtype=torch.float32)


def encode(x: torch.Tensor, target: int = 64) -> torch.Tensor:
    """Chunked DCT of a 1-D or 2-D tensor.

    Returns:
        2-D (R, S) input: (Y, X, A, B) blocks with `block' = D_A @ block @ D_B.T`, where
        A = chunk_size(R, target), B = chunk_size(S, target), Y = R / A, X = S / B.
        1-D (S,) input: (X, B) chunks with `chunk' = D_B @ chunk`.
    """
    if x.ndim == 2:
        a, b = chunk_size(x.shape[0], target), chunk_size(x.shape[1], target)
        d_a, d_b = _basis(a, x.device), _basis(b, x.device)
        blocks_YAXB = x.reshape(x.shape[0] // a, a, x.shape[1] // b, b)  # (Y, A, X, B)
        return torch.einsum("yhxw,ph,qw->yxpq", blocks_YAXB, d_a, d_b)  # (Y, X, A, B)
    if x.ndim == 1:
        b = chunk_size(x.shape[0], target)
        chunks_XB = x.reshape(x.shape[0] // b, b)  # (X, B)
        return torch.einsum("xw,qw->xq", chunks_XB, _basis(b, x.device))  # (X, B)
    raise ValueError(f"the reference handles 1-D and 2-D tensors only, got shape {tuple(x.shape)}")


def decode(c: torch.Tensor) -> torch.Tensor:
    """Inverse of `encode`: (Y, X, A, B) -> (Y*A, X*B) or (X, B) -> (X*B,)."""
    if c.ndim == 4:
        y, x, a, b = c.shape
        d_a, d_b = _basis(a, c.device), _basis(b, c.device)
        blocks_YAXB = torch.einsum("yxpq,ph,qw->yhxw", c, d_a, d_b)  # (Y, A, X, B)
        return blocks_YAXB.reshape(y * a, x * b)  # (Y*A, X*B)
    if c.ndim == 2:
        x, b = c.shape
        chunks_XB = torch.einsum("xq,qw->xw", c, _basis(b, c.device))  # (X, B)
        return chunks_XB.reshape(x * b)  # (X*B,)
    raise ValueError(f"coefficients should be (Y, X, A, B) or (X, B), got shape {tuple(c.shape)}")


def coeff_shape(shape: tuple[int, ...], target: int = 64) -> tuple[int, ...]:
    """Shape of `encode(x)` for an x of this shape: (Y, X, A, B) or (X, B)."""
    if len(shape) == 2:
        a, b = chunk_size(shape[0], target), chunk_size(shape[1], target)
        return (shape[0] // a, shape[1] // b, a, b)
    if len(shape) == 1:
        b = chunk_size(shape[0], target)
        return (shape[0] // b, b)
    raise ValueError(f"the reference handles 1-D and 2-D tensors only, got shape {shape}")


def select_topk(coeffs: torch.Tensor, k: int) -> Sparse:
    """Per row of the last dim: indices of the k largest |value| (k clamped to [1, row length])."""
    k = min(max(k, 1), coeffs.shape[-1])
    idx = torch.topk(coeffs.abs(), k, dim=-1, largest=True, sorted=True).indices  # (..., K)
    return idx, torch.gather(coeffs, -1, idx)  # (..., K)


def decompress(idx: torch.Tensor, val: torch.Tensor, xshape: tuple[int, ...]) -> torch.Tensor:
    """Dense coefficients of shape `xshape` from (possibly repeated) sparse picks.

    Each coefficient is the mean of the values picked for it (over the ranks that picked it);
    a coefficient nobody picked is 0. Written as sum / count rather than `scatter_reduce` so the
    oracle does not share the reference's primitive.
    """
    flat_shape = (*xshape[:-2], xshape[-2] * xshape[-1]) if len(xshape) == 4 else xshape
    zeros = torch.zeros(flat_shape, dtype=val.dtype, device=val.device)  # (Y, X, A*B) or (X, B)
    sums = zeros.scatter_add(-1, idx, val)
    counts = zeros.scatter_add(-1, idx, torch.ones_like(val))
    mean = torch.where(counts > 0, sums / counts.clamp(min=1), zeros)
    return mean.reshape(xshape)  # (Y, X, A, B) or (X, B)


class ReferenceDeMo:
    """bloc97/DeMo's semantics, one parameter at a time, with the all-gather left to the caller.

    Example (world of one):
        >>> opt = ReferenceDeMo(model.parameters(), lr=1e-3)
        >>> loss.backward(); opt.step()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float,
        compression_decay: float = 0.999,
        compression_topk: int = 32,
        compression_chunk: int = 64,
        weight_decay: float = 0.0,
    ) -> None:
        """Args mirror the reference constructor (research notes §1.1)."""
        if compression_topk <= 0 or compression_chunk <= 0 or not 0.0 <= compression_decay < 1.0:
            raise ValueError("compression_topk and compression_chunk should be > 0 and decay in [0, 1)")
        self.params = [p for p in params if p.requires_grad]
        self.lr = lr
        self.decay = compression_decay
        self.topk = compression_topk
        self.chunk = compression_chunk
        self.weight_decay = weight_decay
        self.delta = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        """Decoupled momentum (error-feedback buffer) per parameter."""

    def compress(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """Top-k per chunk of the chunked DCT of x (a parameter-shaped tensor, e.g. its delta).

        Returns:
            idx (Y, X, K) or (X, K) int64 into the flattened block; val, the signed
            coefficients, same shape; xshape, the shape of `encode(x)`.
        """
        coeffs = encode(x, self.chunk)  # (Y, X, A, B) or (X, B)
        xshape = tuple(coeffs.shape)
        if coeffs.ndim == 4:
            coeffs = coeffs.reshape(xshape[0], xshape[1], xshape[2] * xshape[3])  # (Y, X, A*B)
        idx, val = select_topk(coeffs, self.topk)
        return idx, val, xshape

    @torch.no_grad()
    def step_local(self) -> list[Sparse]:
        """Everything before the all-gather, for every parameter in order.

        Returns:
            This rank's (idx, val) per parameter.
        """
        out: list[Sparse] = []
        for p, delta in zip(self.params, self.delta, strict=True):
            if p.grad is None:
                raise ValueError("every parameter should have a grad (the reference fails without one)")
            p.mul_(1.0 - self.lr * self.weight_decay)
            delta.mul_(self.decay).add_(p.grad, alpha=self.lr)
            idx, val, xshape = self.compress(delta)
            delta.sub_(decode(decompress(idx, val, xshape)))
            out.append((idx, val))
        return out

    @torch.no_grad()
    def apply_gathered(self, gathered: list[list[Sparse]]) -> list[torch.Tensor]:
        """Averages the ranks' picks, decodes, and takes the sign step.

        Args:
            gathered: gathered[w][i] is rank w's (idx, val) for parameter i, ranks in order.

        Returns:
            The decoded aggregate per parameter, before the sign (the "u" of §1.7).
        """
        updates: list[torch.Tensor] = []
        for i, p in enumerate(self.params):
            xshape = coeff_shape(tuple(p.shape), self.chunk)
            idx = torch.cat([rank[i][0] for rank in gathered], dim=-1)  # (..., W*K)
            val = torch.cat([rank[i][1] for rank in gathered], dim=-1)  # (..., W*K)
            u = decode(decompress(idx, val, xshape))
            p.sub_(torch.sign(u).to(p.dtype), alpha=self.lr)
            updates.append(u)
        return updates

    def step(self) -> list[torch.Tensor]:
        """A whole step in a world of one."""
        return self.apply_gathered([self.step_local()])
