"""The DeMo optimizer: a drop-in for bloc97/DeMo, split into compress / aggregate / apply for networks.

Math layer: imports torch only (no protobuf, grpc, hivemind or asyncio). `step()` inside a
torch.distributed group gathers through `demonet.optim.gather` (the drop-in contract needs an
all_gather); the networked path never does. `apply` and `restore` come from the mixin
`demonet.optim.outcome`, the overlapped rounds' lookahead and undoable compress from `demonet.optim.overlap`.

Shape legend: B = blocks of a bucket, N = h * w coefficients per block, K = entries kept per block.
The momentum lives in the DCT domain, in block layout (B, N): the transform is orthonormal and
linear, so ``DCT(beta*m + lr*g) = beta*DCT(m) + lr*DCT(g)``, and the reference's error feedback
``m -= IDCT(scatter(topk))`` is the same as zeroing the selected coefficients. That saves one of the
reference's three transforms per step and makes `restore` an exact scatter-add.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .aggregate import aggregate
from .buckets import Bucket, Slot, build_buckets, local_tensor
from .dct import block_view, encode, to_blocks
from .gather import gather_payloads, world_size
from .options import DeMoOptions, check_args
from .outcome import RoundOutcome
from .overlap import OverlapState
from .payload import Compressed, Payload, quantize_rows
from .topk import topk_abs

__all__ = ["DeMo"]

_STATE_KEYS = ("momentum", "exp_avg", "exp_avg_sq")


_disable_dynamo = getattr(torch, "_disable_dynamo", None)  # a torch without it wraps nothing of this kind
_NO_DYNAMO_CODE = None if _disable_dynamo is None else _disable_dynamo(lambda: None).__code__  # imports nothing


def _undecorated(method: Any) -> Any:
    """`method` without torch's `_disable_dynamo` wrapper, if it has that one (and only that one)."""
    code = getattr(method, "__code__", None)
    if code is not None and code is _NO_DYNAMO_CODE and callable(getattr(method, "__wrapped__", None)):
        return method.__wrapped__
    return method


class DeMo(OverlapState, RoundOutcome, torch.optim.Optimizer):
    """Decoupled Momentum Optimization (Peng, Quesnelle, Kingma 2024; arXiv 2411.19870).

    Drop-in for bloc97/DeMo: ``DeMo(params, lr=..., compression_decay=0.999, compression_topk=32,
    compression_chunk=64, weight_decay=0.0, process_group=None)``; `step()` gathers over the
    torch.distributed group when one is initialised, and runs as a world of one otherwise.

    Networked use splits the step::

        payload = opt.compress()        # momentum update, DCT, top-k, error feedback
        agg = aggregate([payload, ...])  # anyone can merge: mean over the peers that sent each entry
        opt.apply(agg)                   # decode, base optimizer, weight decay
        opt.restore(payload)             # instead of apply, if the payload missed the aggregate

    `apply` gives the same bits on every IEEE-754 machine (any CPU vector width or thread count, CUDA):
    peers on different hardware that apply the same aggregate stay bit-identical. `compress` and the
    model's forward/backward run on each machine's own kernels and need not agree (docs/determinism.md).

    Args:
        params: parameters or param groups (names allowed: ``model.named_parameters()``). Groups may
            set ``lr`` and ``weight_decay``.
        lr: learning rate; folded into the momentum as the reference does (``m = beta*m + lr*g``).
        compression_decay: momentum decay beta, in [0, 1).
        compression_topk: coefficients kept per chunk (clamped to the chunk size).
        compression_chunk: target chunk side.
        weight_decay: decoupled weight decay, the default for groups that do not set it.
        process_group: torch.distributed group for `step()` (default: the world, if initialised).
        options: the settings beyond the reference's (`DeMoOptions`); or give its fields as keywords,
            e.g. ``DeMo(params, lr=1e-3, base="sgd")``.
    """

    # torch.optim.Optimizer wraps these in torch._disable_dynamo, which imports torch._dynamo at their first
    # call: about 2 s of CPU and 70 MB in every peer and coordinator process. DeMo is never traced by
    # torch.compile (its apply must give the same bits everywhere), so it calls them unwrapped.
    add_param_group = _undecorated(torch.optim.Optimizer.add_param_group)
    state_dict = _undecorated(torch.optim.Optimizer.state_dict)
    zero_grad = _undecorated(torch.optim.Optimizer.zero_grad)

    # The drop-in signature is fixed by the reference; everything else is one DeMoOptions.
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, compression_decay: float = 0.999,
                 compression_topk: int = 32, compression_chunk: int = 64, weight_decay: float = 0.0,
                 process_group: Any = None, *, options: DeMoOptions | None = None, **extras: Any) -> None:
        if options is not None and extras:
            raise TypeError(f"give either options or its fields as keywords, not both: {sorted(extras)}")
        self.options = options if options is not None else DeMoOptions(**extras)  # TypeError: an unknown name
        check_args(lr, compression_decay, compression_topk, compression_chunk, weight_decay)
        self._chunks = dict(self.options.chunks)
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.compression_decay = compression_decay
        self.compression_topk = compression_topk
        self.compression_chunk = compression_chunk
        self.process_group = process_group
        self.data_transmit = 0
        self.data_receive = 0
        self._scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._exact_work: dict[torch.device, torch.Tensor] = {}  # float64 work space of the exact decode
        self._init_overlap()
        self._build_buckets()

    @classmethod
    def from_settings(cls, params: Iterable[Any], settings: Any, **options: Any) -> DeMo:
        """DeMo with a run's optimizer settings: any object holding the reference's argument names
        and `DeMoOptions` fields as attributes (e.g. `demonet.config.OptimConfig`). `options` adds or
        overrides `DeMoOptions` fields (e.g. ``chunks``)."""
        names = {f.name for f in dataclasses.fields(DeMoOptions)}
        extras = {name: getattr(settings, name) for name in names if hasattr(settings, name)} | options
        return cls(params, lr=settings.lr, compression_decay=settings.compression_decay,
                   compression_topk=settings.compression_topk, compression_chunk=settings.compression_chunk,
                   weight_decay=settings.weight_decay, options=DeMoOptions(**extras))

    # -- construction --------------------------------------------------------------------------------

    def _build_buckets(self) -> None:
        self._buckets, self._slots = build_buckets(
            self.param_groups, chunks=self._chunks, compression_chunk=self.compression_chunk,
            chunk_policy=self.options.chunk_policy, bucket_cap_mb=self.options.bucket_cap_mb,
            adam=self.options.base == "adamw")
        self._bucket_of = {slot.name: bucket for bucket in self._buckets for slot in bucket.slots}
        for bucket in self._buckets:
            for slot in bucket.slots:
                self._bind_state(bucket, slot)

    def _bind_state(self, bucket: Bucket, slot: Slot) -> None:
        """Point the param's entries in `self.state` at its rows of the bucket buffers."""
        state = self.state[slot.param]
        state["momentum"] = bucket.momentum_BN[slot.start:slot.stop]
        if bucket.exp_avg_BN is not None and bucket.exp_avg_sq_BN is not None:
            state["exp_avg"] = bucket.exp_avg_BN[slot.start:slot.stop]
            state["exp_avg_sq"] = bucket.exp_avg_sq_BN[slot.start:slot.stop]
            state.setdefault("step", torch.zeros((), dtype=torch.float32))

    def _scratch_for(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """Two (B, h, w) work buffers, kept between steps: large fresh tensors cost page faults."""
        m = bucket.momentum_BN
        numel = m.numel()
        key = (m.device, m.dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < 2 * numel:
            need = 2 * max(numel, max(b.momentum_BN.numel() for b in self._buckets
                                      if (b.momentum_BN.device, b.momentum_BN.dtype) == key))
            buf = self._scratch[key] = torch.empty(need, dtype=m.dtype, device=m.device)
        shape = (bucket.num_blocks, bucket.h, bucket.w)
        return buf[:numel].view(shape), buf[numel:2 * numel].view(shape)

    # -- the split step ------------------------------------------------------------------------------

    def param_specs(self) -> dict[str, tuple[tuple[int, ...], tuple[int, int]]]:
        """Each payload tensor's (shape, chunk), by name: what a valid payload for this model holds."""
        return {s.name: (s.shape, (self._bucket_of[s.name].h, self._bucket_of[s.name].w)) for s in self._slots}

    @torch.no_grad()
    def compress(self, undoable: bool = False, topk: int | None = None) -> Payload:
        """Update the momentum with the current gradients and extract its fast components.

        Per parameter: ``m = beta*m + lr*DCT(g)`` (a missing grad counts as zero), keep the top-k
        coefficients of |m| per chunk, round them through the value encoding, and subtract
        ``alpha * sent`` from m (error feedback).

        Args:
            undoable: keep a copy of the momentum first, so that `undo_compress` can put it back to the
                bit (an overlapped peer compresses round r+1 before it knows round r's outcome); until
                `commit_compress` or `undo_compress`, each `restore` goes into the copy as well.
            topk: the coefficients kept per chunk this time (a peer on a slow uplink sends fewer: what it
                does not send stays in its momentum); None: `compression_topk`.

        Returns:
            this peer's payload: one `Compressed` per trainable parameter.
        """
        if topk is not None and topk < 1:
            raise ValueError(f"topk should be >= 1, got {topk}")
        if undoable:
            self._keep_momentum()
        out: dict[str, Compressed] = {}
        for bucket in self._buckets:
            lr = self.param_groups[bucket.group]["lr"]
            x_BHW, t_BHW = self._scratch_for(bucket)
            dst, src = [], []  # gradients that tile exactly: one batched copy per bucket
            for slot in bucket.slots:
                grad, x_CHW = slot.param.grad, x_BHW[slot.start:slot.stop]
                grad = None if grad is None else local_tensor(grad)
                if grad is None:
                    x_CHW.zero_()
                    continue
                g2d = grad.reshape(slot.rows, slot.cols)
                g_blocks = block_view(g2d, bucket.h, bucket.w)
                if g_blocks is None:
                    to_blocks(g2d, bucket.h, bucket.w, x_CHW)
                else:
                    dst.append(x_CHW.view(g_blocks.shape))
                    src.append(g_blocks)
            if dst:
                torch._foreach_copy_(dst, src)
            m_BN = bucket.momentum_BN
            d_h, d_wt = bucket.bases
            encode(x_BHW, d_h, d_wt, t_BHW, m_BN.view_as(x_BHW), beta=self.compression_decay, alpha=lr)
            k = min(topk or self.compression_topk, bucket.h * bucket.w)
            idx_BK = topk_abs(m_BN, k, bucket.w)
            val_BK = m_BN.gather(1, idx_BK)
            exact = self.options.encoding == "fp32" and self.options.alpha == 1.0
            if exact:
                m_BN.scatter_(1, idx_BK, 0.0)  # m - 1.0 * m, exactly
            sent_BK, scales = quantize_rows(val_BK, self.options.encoding, bucket.slot_B, len(bucket.slots))
            if not exact:
                m_BN.scatter_add_(1, idx_BK, sent_BK * -self.options.alpha)
            for i, slot in enumerate(bucket.slots):  # views of the bucket's tensors: no kernel
                rows = slice(slot.start, slot.stop)
                scale = None if scales is None else scales[i] if scales.dim() == 1 else scales[rows]
                out[slot.name] = Compressed(idx=idx_BK[rows], val=sent_BK[rows], shape=slot.shape,
                                            chunk=(bucket.h, bucket.w), scale=scale)
        return Payload(tensors={s.name: out[s.name] for s in self._slots}, encoding=self.options.encoding)

    def _check_payload(self, payload: Payload) -> None:
        """Names, shapes, chunks and row counts must match this model; raises before any change."""
        if set(payload.tensors) != set(self._bucket_of):
            missing = sorted(set(self._bucket_of) - set(payload.tensors))[:3]
            extra = sorted(set(payload.tensors) - set(self._bucket_of))[:3]
            raise ValueError(f"payload does not match the parameters: missing {missing}, unknown {extra}")
        for slot in self._slots:
            c = payload.tensors[slot.name]
            bucket = self._bucket_of[slot.name]
            rows = slot.stop - slot.start
            if (c.shape != slot.shape or c.chunk != (bucket.h, bucket.w)
                    or c.idx.shape != c.val.shape or c.idx.dim() != 2 or c.idx.shape[0] != rows):
                raise ValueError(f"payload tensor {slot.name!r} has shape {c.shape}, chunk {c.chunk}, "
                                 f"entries {tuple(c.idx.shape)}; expected {slot.shape}, "
                                 f"{(bucket.h, bucket.w)}, ({rows}, K)")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """compress, all_gather over the process group (if torch.distributed is initialised), aggregate, apply."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        payload = self.compress()
        payloads = [payload]
        if world_size(self.process_group) > 1:
            payloads, _ = gather_payloads(payload, self.process_group)
        self.apply(aggregate(payloads))
        # The reference's accounting (int64 indices), not the narrower bytes gather_payloads sends.
        per_peer = sum(c.idx.numel() * (8 + c.val.element_size()) for c in payload.tensors.values())
        self.data_transmit, self.data_receive = per_peer, per_peer * len(payloads)
        return loss

    # -- checkpoints ---------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer keeps only defaults, state and param_groups: copy the buckets too, so
        # copy.deepcopy(opt) works (deepcopy keeps the state entries as views of the copied buckets).
        return self.__dict__.copy()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load, then copy the saved buffers into this optimizer's buckets at full precision."""
        saved = {int(i): dict(s) for i, s in state_dict["state"].items()}
        by_index = {slot.index: slot for slot in self._slots}
        for i, entries in saved.items():
            slot = by_index.get(i)
            for key in _STATE_KEYS:
                if key in entries and (slot is None or entries[key].shape != (slot.stop - slot.start,
                                                                             self._bucket_of[slot.name].momentum_BN.shape[1])):
                    raise ValueError(f"state_dict entry {i}.{key} does not fit this optimizer's parameters")
        _undecorated(torch.optim.Optimizer.load_state_dict)(self, state_dict)
        self._kept = None  # a pending compress is of the momentum this replaces
        for slot in self._slots:
            bucket = self._bucket_of[slot.name]
            entries = saved.get(slot.index, {})
            self._bind_state(bucket, slot)
            for key in _STATE_KEYS:
                if key in self.state[slot.param]:
                    view = self.state[slot.param][key]
                    view.copy_(entries[key]) if key in entries else view.zero_()
            if "step" in entries:
                self.state[slot.param]["step"] = entries["step"].detach().clone().float().cpu()
