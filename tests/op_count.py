"""Count the kernel-launching ATen ops of DeMo's split step: one `compress()` and one `apply()`.

An op counts when it would launch a kernel on an accelerator: every ATen call that reaches the dispatcher
below autograd, except views and aliases (`OpOverload.is_view`: they change only metadata), the
metadata-only ops of `_METADATA` (allocation without writing, shape queries, detach) and nothing else.
`item()` counts: it is a copy (and on a GPU a synchronisation). Used by `bench/step_ops.py` and
`tests/unit/test_step_ops.py`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from demonet.optim import DeMo, aggregate
from demonet.train.model import GPT, ModelConfig

_METADATA = frozenset({
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
    "aten::detach", "aten::lift_fresh", "aten::sym_size", "aten::sym_stride", "aten::sym_numel",
    "aten::sym_storage_offset", "aten::is_contiguous", "aten::resize_", "aten::set_",
})
"""Ops that write no tensor data: no kernel launch on any device."""


class OpCounter(TorchDispatchMode):
    """Counts the kernel-launching ATen ops run inside it, by op name (`counts`)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        if not func.is_view and name not in _METADATA:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def stack_model(num_blocks: int, d_model: int = 64) -> GPT:
    """A GPT of `num_blocks` identical transformer blocks (attention qkv and proj, MLP, two layer norms)."""
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=256, seq_len=32, d_model=d_model, n_layers=num_blocks, n_heads=2))


def step_ops(model: torch.nn.Module, **options: Any) -> tuple[Counter[str], Counter[str]]:
    """The ops of one `compress()` and of one `apply()` of its merge with another payload, on `model`, after a
    warm step.

    The gradients are fixed random tensors; `options` go to `DeMo` (e.g. ``base="adamw"``; its defaults
    otherwise: chunks of 64 x 64, k = 32)."""
    opt = DeMo(model.named_parameters(), lr=1e-3, **options)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    opt.apply(aggregate([opt.compress()]))  # the first step allocates its work buffers
    with OpCounter() as compress_ops:
        payload = opt.compress()
    for p in model.parameters():  # a second peer's payload: the merged tensors differ in width, as in a round
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    agg = aggregate([payload, opt.compress()])
    with OpCounter() as apply_ops:
        opt.apply(agg)
    return compress_ops.counts, apply_ops.counts
