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

__all__ = ["ACCELERATOR_BUCKET_CAP_MB", "CPU_BUCKET_CAP_MB", "DECODE_GROUP_MB", "Bucket", "Slot", "build_buckets",
           "default_bucket_cap_mb", "local_tensor"]

CPU_BUCKET_CAP_MB = 4.0
"""A CPU's bucket: its passes (transform, top-k, decode) stay in the last-level cache. A CPU launches no
kernels, and measured its step about 10% slower in 128 MiB buckets (docs/optimizer.md, "Kernels a step
launches"): it keeps this size, and a set of ops per bucket."""

ACCELERATOR_BUCKET_CAP_MB = 128.0
"""An accelerator's bucket: each pass over a bucket is a fixed set of kernel launches, so a small cap
would make a deep model pay a set per 4 MiB (docs/optimizer.md, "Kernels a step launches"). A model of
up to 32M coefficients of one chunk shape takes one pass; the scratch (two buckets) and the exact
decode's float64 work space ((S / 16 + 2)x a bucket for aggregates of S entries a 64 x 64 chunk: 4x at
S = 32) stay bounded."""


DECODE_GROUP_MB = 4.0
"""The exact decode bounds a block's sum by the most entries any tensor has in the block's decode group: the
tensors of one chunk shape, in order, in groups of at most this size (a larger tensor is a group of its own),
whatever buckets a device batches them in. The bound sets the rounding of the decode's first product
(`demonet.optim.exact.decode_exact`), so the groups are part of what the apply computes: the same on every
device and for every `bucket_cap_mb`. They are the buckets DeMo had on every device before buckets followed
the device (4 MiB), so the apply kept its bits."""


def _cap(cap_mb: float) -> int:
    """Float32 coefficients in `cap_mb` MiB (at least 1)."""
    return max(1, int(cap_mb * 2**20 / 4))


def default_bucket_cap_mb(device: torch.device) -> float:
    """The bucket size for parameters on `device` when `DeMoOptions.bucket_cap_mb` is None."""
    return CPU_BUCKET_CAP_MB if device.type == "cpu" else ACCELERATOR_BUCKET_CAP_MB


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
    decode_group: int = 0  # the apply's decode group (`DECODE_GROUP_MB`), numbered over all buckets


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
    slot_B: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # (B,) each block's slot in `slots`
    cap: int = 0  # coefficients a bucket holds at most (one tensor may exceed it in a bucket of its own)
    decode_groups: list[int] = field(default_factory=list)  # its slots' decode groups, in order
    group_B: torch.Tensor | None = None  # (B,) each block's position in `decode_groups`; None: one group


def build_buckets(param_groups: Sequence[Mapping[str, Any]], *, chunks: Mapping[str, tuple[int, int]],
                  compression_chunk: int, chunk_policy: str, bucket_cap_mb: float | None,
                  adam: bool) -> tuple[list[Bucket], list[Slot]]:
    """Lay out every trainable parameter's blocks in buckets and allocate their zeroed buffers.

    Args:
        param_groups: the optimizer's groups; a group's ``param_names`` name its params, else
            their position in the optimizer's order does.
        chunks: an explicit (h, w) per parameter name; the others get `chunk_shape`.
        compression_chunk, chunk_policy: `chunk_shape`'s target side and policy.
        bucket_cap_mb: MiB of float32 coefficients per bucket at most (a larger tensor gets a bucket of
            its own); None: `default_bucket_cap_mb` of the parameter's device.
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
    open_groups: dict[tuple[Any, ...], tuple[int, int]] = {}  # key -> (decode group, its blocks so far)
    index, num_groups = -1, 0
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
            cap_mb = default_bucket_cap_mb(p.device) if bucket_cap_mb is None else bucket_cap_mb
            if bucket is None or (bucket.num_blocks + num_blocks) * h * w > _cap(cap_mb):
                bucket = open_buckets[key] = Bucket(group=gi, h=h, w=w, cap=_cap(cap_mb))
                buckets.append(bucket)
            decode_group, filled = open_groups.get(key, (-1, 0))
            if decode_group < 0 or (filled + num_blocks) * h * w > _cap(DECODE_GROUP_MB):
                decode_group, filled, num_groups = num_groups, 0, num_groups + 1
            open_groups[key] = (decode_group, filled + num_blocks)
            slot = Slot(p, name, index, shape, rows, cols, bucket.num_blocks, bucket.num_blocks + num_blocks,
                        decode_group)
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
    rows = torch.tensor([slot.stop - slot.start for slot in bucket.slots])
    slot_B = torch.repeat_interleave(torch.arange(len(bucket.slots)), rows)
    bucket.slot_B = slot_B.to(p.device)
    bucket.decode_groups = list(dict.fromkeys(slot.decode_group for slot in bucket.slots))
    if len(bucket.decode_groups) > 1:
        position = torch.tensor([bucket.decode_groups.index(slot.decode_group) for slot in bucket.slots])
        bucket.group_B = position[slot_B].to(p.device)


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
