"""What a round's outcome does to the DeMo optimizer: `apply` the aggregate, or `restore` a payload that missed it.

A mixin of `demonet.optim.DeMo`, which supplies the buckets, the options and the work buffers. Imports torch
only. Shape legend: as demonet.optim.demo's (B blocks, N = h * w coefficients, K entries kept per block).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from .buckets import Bucket, local_tensor
from .dct import add_blocks_, block_view
from .exact import as_opmath, decode_exact, decode_sign, fast_float32_gemm, ipow, sqrt_exact, terms_log2
from .options import DeMoOptions
from .payload import Compressed, Payload

__all__ = ["RoundOutcome"]


class RoundOutcome:
    """`apply` (the exact decode and the base optimizer's step) and `restore` of `demonet.optim.DeMo`."""

    options: DeMoOptions
    param_groups: list[dict[str, Any]]
    state: Any
    _buckets: list[Bucket]
    _exact_work: dict[torch.device, torch.Tensor]

    if TYPE_CHECKING:  # DeMo's and OverlapState's
        def _check_payload(self, payload: Payload) -> None: ...
        def _scratch_for(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]: ...
        def undo_lookahead(self) -> bool: ...
        def _kept_momentum(self) -> dict[int, torch.Tensor]: ...

    @torch.no_grad()
    def apply(self, aggregate: Payload, lr: float | None = None) -> None:
        """Decode an aggregate and take the base optimizer's step with decoupled weight decay.

        `lr` is this step's learning rate for every param group (a schedule's value for the round the
        aggregate closes, `demonet.optim.LrSchedule`); None: each group's ``lr``. `compress` folds the
        group's ``lr`` into the momentum either way.

        The same bits on every IEEE-754 machine (CPU of any vector width or thread count, CUDA):
        two peers that apply the same aggregate to the same parameters end with the same parameters
        and base-optimizer state. The decode is exact in float64 (`decode_exact`); everything after it
        is elementwise, one rounding per operation, with no fused multiply-add (``add_(x, alpha=a)``,
        ``addcmul``, ``lerp`` fuse on some kernels and not on others), no division by a scalar (CUDA
        turns it into a multiplication by the reciprocal), and scalars rounded to the tensor's dtype
        first. Python scalars (lr, bias corrections) come from IEEE double arithmetic alone.

        A held `lookahead` is undone first: the aggregate replaces it, and the result has the bits the
        apply would have given without it.
        """
        self._check_payload(aggregate)
        self.undo_lookahead()
        self._apply(aggregate, lr)

    def _apply(self, aggregate: Payload, lr: float | None) -> None:
        if self.options.base == "adamw":  # every parameter's step count, in one multi-tensor op
            torch._foreach_add_([self.state[s.param]["step"] for b in self._buckets for s in b.slots], 1.0)
        group_e_s = _group_terms_log2(self._buckets, aggregate)
        for bucket in self._buckets:
            group = self.param_groups[bucket.group]
            step_lr, wd = group["lr"] if lr is None else lr, group["weight_decay"]
            u_BHW, t_BHW = self._scratch_for(bucket)
            self._decode(bucket, aggregate, u_BHW, group_e_s, sign=self.options.base == "sign")
            if self.options.base == "adamw":
                self._adam_direction(bucket, u_BHW, t_BHW)
            step = as_opmath(-step_lr, u_BHW.dtype)
            if self.options.base != "sign":
                u_BHW.mul_(step)  # the update, -lr * u, rounded once
                step = 1.0
            # else u is -1, 0 or 1: step * u is exact, so a fused multiply-add rounds as add does
            locals_ = [local_tensor(slot.param) for slot in bucket.slots]
            if wd != 0.0:
                torch._foreach_mul_(locals_, as_opmath(1.0 - step_lr * wd, locals_[0].dtype))
            params, updates = [], []  # parameters that tile exactly: one batched add per bucket
            for slot, p in zip(bucket.slots, locals_, strict=True):
                u_CHW = u_BHW[slot.start:slot.stop]
                p_blocks = block_view(p.view(slot.rows, slot.cols), bucket.h, bucket.w) if p.is_contiguous() else None
                if p_blocks is not None:
                    params.append(p_blocks)
                    updates.append(u_CHW.view(p_blocks.shape))
                elif p.is_contiguous():
                    add_blocks_(p.view(slot.rows, slot.cols), u_CHW, step)
                else:
                    delta = torch.zeros(slot.rows, slot.cols, dtype=u_CHW.dtype, device=p.device)
                    add_blocks_(delta, u_CHW, step)
                    p.add_(delta.view(p.shape))
            if params:
                torch._foreach_add_(params, updates, alpha=step)

    def _decode(self, bucket: Bucket, agg: Payload, u_BHW: torch.Tensor, group_e_s: list[int], sign: bool) -> None:
        """u = IDCT(aggregate) for the bucket's blocks, exactly (`decode_exact`), or sign(u) with `sign`
        (`decode_sign` where float32 GEMMs are IEEE: the same bits, faster): the same bits everywhere.
        `group_e_s`: each decode group's bound on a block's entries (`_group_terms_log2`)."""
        d_h, d_w = bucket.exact_bases
        parts = [agg.tensors[s.name] for s in bucket.slots]
        width = max(c.k for c in parts)
        # an aggregate decoded from the wire is on the CPU: it goes to the parameters' device
        idx_BS, val_BS = (t.to(u_BHW.device) for t in _padded_rows(bucket, parts, width))
        need = bucket.num_blocks * (width * (bucket.h + bucket.w) + bucket.h * bucket.w)
        work = self._exact_work.get(u_BHW.device)
        if work is None or work.numel() < need:
            work = self._exact_work[u_BHW.device] = torch.empty(need, dtype=torch.float64, device=u_BHW.device)
        e_s: int | torch.Tensor = group_e_s[bucket.decode_groups[0]]
        if bucket.group_B is not None:  # a bucket of several decode groups: each block its group's bound
            e_s = torch.tensor([group_e_s[g] for g in bucket.decode_groups])
            e_s = e_s.to(u_BHW.device)[bucket.group_B].unsqueeze(1)  # (B, 1)
        if sign and u_BHW.dtype == torch.float32 and fast_float32_gemm(u_BHW.device):
            decode_sign(idx_BS, val_BS, d_h, d_w, u_BHW, work, e_s)
            return
        decode_exact(idx_BS, val_BS, d_h, d_w, u_BHW, work, e_s)
        if sign:
            u_BHW.sign_()

    def _adam_direction(self, bucket: Bucket, u_BHW: torch.Tensor, t_BHW: torch.Tensor) -> None:
        """Replace u by Adam's bias-corrected m / (sqrt(v) + eps), updating the moments.

        One rounding per operation, in a fixed order (see `apply`): ``m = beta1*m + (1-beta1)*u``,
        ``v = beta2*v + (1-beta2)*u*u``, ``u = m / (sqrt(v) / sqrt(1-beta2^t) + eps) / (1-beta1^t)``
        with the two divisions by scalars done as multiplications by their reciprocals.
        """
        assert bucket.exp_avg_BN is not None and bucket.exp_avg_sq_BN is not None
        beta1, beta2 = self.options.betas
        step = int(self.state[bucket.slots[0].param]["step"])  # `_apply` has counted this step
        dtype = u_BHW.dtype
        u_BN = u_BHW.view_as(bucket.exp_avg_BN)
        t_BN = t_BHW.view_as(u_BN)
        m_BN, v_BN = bucket.exp_avg_BN, bucket.exp_avg_sq_BN
        m_BN.mul_(as_opmath(beta1, dtype)).add_(torch.mul(u_BN, as_opmath(1.0 - beta1, dtype), out=t_BN))
        torch.mul(u_BN, u_BN, out=t_BN).mul_(as_opmath(1.0 - beta2, dtype))
        v_BN.mul_(as_opmath(beta2, dtype)).add_(t_BN)
        inv_bias2 = as_opmath(1.0 / math.sqrt(1.0 - ipow(beta2, step)), dtype)  # math.sqrt is correctly rounded
        sqrt_exact(v_BN, out=t_BN, piece=bucket.cap).mul_(inv_bias2).add_(as_opmath(self.options.eps, dtype))
        torch.div(m_BN, t_BN, out=u_BN).mul_(as_opmath(1.0 / (1.0 - ipow(beta1, step)), dtype))

    @torch.no_grad()
    def restore(self, payload: Payload, kept: Payload | None = None) -> None:
        """Add back into the momentum what `compress` took out, for entries that reached no aggregate.

        Args:
            payload: this peer's payload, as `compress` returned it.
            kept: the aggregate that was applied, if any. Then only the payload's entries whose index
                the aggregate does not hold (a coordinator may keep only the largest merged
                coefficients) are restored; None restores the whole payload.

        A held `lookahead` is undone as well (the parameters and base state go back to their bits
        from before it); the momentum is not touched by a lookahead, only by this.
        """
        self._check_payload(payload)
        if kept is not None:
            self._check_payload(kept)
        self.undo_lookahead()
        copy_of = self._kept_momentum()
        alpha = self.options.alpha
        for bucket in self._buckets:  # one set of ops a bucket: its slots' rows are consecutive, in order
            m_BN, parts = bucket.momentum_BN, [payload.tensors[s.name] for s in bucket.slots]
            copy_BN = copy_of.get(id(m_BN))
            if len({c.k for c in parts}) > 1:  # not a payload of this optimizer's compress: slot by slot
                for slot, c in zip(bucket.slots, parts, strict=True):
                    rows = slice(slot.start, slot.stop)
                    held = None if kept is None else (kept.tensors[slot.name].idx, kept.tensors[slot.name].val)
                    _restore_rows(m_BN[rows], None if copy_BN is None else copy_BN[rows], c.idx, c.val, held, alpha)
                continue
            held_iv = None
            if kept is not None:  # padded with index 0 and value 0: not held
                held_parts = [kept.tensors[s.name] for s in bucket.slots]
                width = max(a.k for a in held_parts)
                held_iv = (torch.cat([_pad_cols(a.idx, width, 0) for a in held_parts]),
                           torch.cat([_pad_cols(a.val, width, 0.0) for a in held_parts]))
            _restore_rows(m_BN, copy_BN, torch.cat([c.idx for c in parts]), torch.cat([c.val for c in parts]),
                          held_iv, alpha)


def _restore_rows(m_CN: torch.Tensor, copy_CN: torch.Tensor | None, idx_CK: torch.Tensor, val_CK: torch.Tensor,
                  held: tuple[torch.Tensor, torch.Tensor] | None, alpha: float) -> None:
    """`DeMo.restore` for the momentum rows `m_CN`: add back ``alpha * val`` at `idx`, less the entries that
    `held` (an aggregate's indices and values for these rows) holds with a nonzero value; into `copy_CN`
    as well (an undoable compress's copy of the momentum)."""
    idx_CK = idx_CK.to(m_CN.device)  # an aggregate decoded from the wire is on the CPU
    back_CK = val_CK.to(m_CN.device, m_CN.dtype) * alpha
    if held is not None:
        # Count, not assign: padding repeats a real index with value 0 and must not unset it.
        held_CN = torch.zeros(m_CN.shape, dtype=torch.int32, device=m_CN.device)
        held_CN.scatter_add_(1, held[0].to(m_CN.device), (held[1] != 0).to(m_CN.device, torch.int32))
        back_CK = torch.where(held_CN.gather(1, idx_CK) > 0, 0.0, back_CK)
    m_CN.scatter_add_(1, idx_CK, back_CK)
    if copy_CN is not None:  # an undoable compress is pending: its undo keeps this restore
        copy_CN.scatter_add_(1, idx_CK, back_CK)


def _padded_rows(bucket: Bucket, parts: list[Compressed], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bucket's (B, S) indices and values, each tensor's rows padded to `width` entries with value 0 at
    the row's first index, in a fixed number of ops (multi-tensor copies into views of two buffers)."""
    idx_BS = torch.empty(bucket.num_blocks, width, dtype=parts[0].idx.dtype, device=parts[0].idx.device)
    val_BS = torch.zeros(bucket.num_blocks, width, dtype=parts[0].val.dtype, device=parts[0].val.device)
    rows = [slice(slot.start, slot.stop) for slot in bucket.slots]
    torch._foreach_copy_([idx_BS[r, :c.k] for r, c in zip(rows, parts, strict=True)], [c.idx for c in parts])
    torch._foreach_copy_([val_BS[r, :c.k] for r, c in zip(rows, parts, strict=True)], [c.val for c in parts])
    short = [(r, c) for r, c in zip(rows, parts, strict=True) if c.k < width]
    if short:
        torch._foreach_copy_([idx_BS[r, c.k:] for r, c in short],
                             [c.idx[:, :1].expand(-1, width - c.k) for _, c in short])
    return idx_BS, val_BS


def _group_terms_log2(buckets: list[Bucket], agg: Payload) -> list[int]:
    """Each decode group's e_S (`terms_log2`): of the most entries a tensor of the group has in `agg`."""
    widths: dict[int, int] = {}
    for bucket in buckets:
        for slot in bucket.slots:
            widths[slot.decode_group] = max(widths.get(slot.decode_group, 0), agg.tensors[slot.name].k)
    return [terms_log2(widths[g]) for g in range(len(widths))]


def _pad_cols(x_CK: torch.Tensor, width: int, fill: torch.Tensor | float) -> torch.Tensor:
    """Right-pad rows to `width` columns with `fill` (a scalar, or a (C, 1) column)."""
    if x_CK.shape[1] == width:
        return x_CK
    extra = width - x_CK.shape[1]
    pad = fill.expand(-1, extra) if isinstance(fill, torch.Tensor) else x_CK.new_full((x_CK.shape[0], extra), fill)
    return torch.cat([x_CK, pad], dim=1)
