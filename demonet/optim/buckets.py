"""DeMo's memory layout: parameters grouped into buckets of blocks that share one transform.

Math layer: imports torch only (no protobuf, grpc, hivemind, asyncio or torch.distributed).

Shape legend: B = blocks of a bucket, N = h * w coefficients per block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .chunking import chunk_shape
from .dct import dct_matrix
from .payload import matrix_shape, num_chunks

__all__ = ["Bucket", "Slot", "build_buckets", "local_tensor"]


@dataclass(eq=False)
class Slot:
    """One parameter's rows in its bucket."""

    param: torch.Tensor
    name: str
    index: int  # position in the optimizer's param order (state_dict key)
    shape: tuple[int, ...]  # of the local tensor: a sharded (DTensor) parameter's own shard
    rows: int
    cols: int
    start: int
    stop: int


@dataclass(eq=False)
class Bucket:
    """Parameters of one group sharing a chunk shape, device and momentum dtype: one batch of blocks."""

    group: int
    h: int
    w: int
    slots: list[Slot] = field(default_factory=list)
    num_blocks: int = 0
    momentum_BN: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    exp_avg_BN: torch.Tensor | None = None
    exp_avg_sq_BN: torch.Tensor | None = None
    bases: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))  # (D_h, D_w.T) for encode
    exact_bases: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))  # (D_h, D_w), float64


def build_buckets(param_groups: Sequence[Mapping[str, Any]], *, chunks: Mapping[str, tuple[int, int]],
                  compression_chunk: int, chunk_policy: str, bucket_cap: int,
                  adam: bool) -> tuple[list[Bucket], list[Slot]]:
    """Lay out every trainable parameter's blocks in buckets and allocate their zeroed buffers.

    Args:
        param_groups: the optimizer's groups; a group's ``param_names`` name its params, else
            their position in the optimizer's order does.
        chunks: an explicit (h, w) per parameter name; the others get `chunk_shape`.
        compression_chunk, chunk_policy: `chunk_shape`'s target side and policy.
        bucket_cap: coefficients per bucket at most (a larger tensor gets a bucket of its own).
        adam: allocate Adam's two moments too.

    Returns:
        (the buckets, in the order they were opened; the slots, in param order).

    Raises:
        ValueError: two parameters share a name.
    """
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    names_seen: set[str] = set()
    open_buckets: dict[tuple[Any, ...], Bucket] = {}
    index = -1
    for gi, group in enumerate(param_groups):
        names = group.get("param_names")
        for pi, p in enumerate(group["params"]):
            index += 1
            if not p.requires_grad:
                continue
            name = names[pi] if names else str(index)
            if name in names_seen:
                raise ValueError(f"parameter name {name!r} appears twice")
            names_seen.add(name)
            shape = tuple(local_tensor(p).shape)
            rows, cols = matrix_shape(shape)
            h, w = chunks.get(name) or chunk_shape(rows, cols, compression_chunk, chunk_policy)
            num_blocks = num_chunks(shape, (h, w))
            key = (gi, h, w, p.device, _momentum_dtype(p.dtype))
            bucket = open_buckets.get(key)
            if bucket is None or (bucket.num_blocks + num_blocks) * h * w > bucket_cap:
                bucket = open_buckets[key] = Bucket(group=gi, h=h, w=w)
                buckets.append(bucket)
            slot = Slot(p, name, index, shape, rows, cols, bucket.num_blocks, bucket.num_blocks + num_blocks)
            bucket.slots.append(slot)
            bucket.num_blocks += num_blocks
            slots.append(slot)
    for bucket in buckets:
        _allocate(bucket, adam)
    return buckets, slots


def _allocate(bucket: Bucket, adam: bool) -> None:
    p = bucket.slots[0].param
    dtype = _momentum_dtype(p.dtype)
    shape = (bucket.num_blocks, bucket.h * bucket.w)
    bucket.momentum_BN = torch.zeros(shape, dtype=dtype, device=p.device)
    if adam:
        bucket.exp_avg_BN = torch.zeros(shape, dtype=dtype, device=p.device)
        bucket.exp_avg_sq_BN = torch.zeros(shape, dtype=dtype, device=p.device)
    bucket.bases = (dct_matrix(bucket.h, dtype, p.device), dct_matrix(bucket.w, dtype, p.device).t().contiguous())
    bucket.exact_bases = (dct_matrix(bucket.h, torch.float64, p.device),
                          dct_matrix(bucket.w, torch.float64, p.device))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor DeMo reads and writes: a DTensor's local shard (duck-typed: no torch.distributed
    import), or the tensor itself. Under no_grad the shard shares the parameter's storage."""
    to_local = getattr(t, "to_local", None)
    if to_local is None:
        return t
    with torch.no_grad():
        local: torch.Tensor = to_local()
    return local


def _momentum_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 momentum under half-precision params: the reference's bf16 error feedback is lossy."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
