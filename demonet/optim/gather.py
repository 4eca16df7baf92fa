"""All-gather of DeMo payloads over a torch.distributed process group, in one collective.

Math layer: imports torch (torch.distributed included, which `import torch` loads anyway) only:
no protobuf, grpc, hivemind or asyncio. `DeMo.step()` and FlexDeMo's replicate step use it; the
networked path (compress / aggregate / apply) never does.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from .payload import Compressed, Payload

__all__ = ["gather_payloads", "world_size"]


def world_size(group: Any = None) -> int:
    """Ranks in `group` (None: the world); 1 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return int(dist.get_world_size(group))


def gather_payloads(payload: Payload, group: Any = None) -> tuple[list[Payload], int]:
    """Every rank's payload in rank order: one all_gather of raw bytes, indices then values.

    The bytes carry the payload exactly in the narrowest dtypes (`_wire_dtypes`), and come back in
    the payload's own dtypes. Raw bytes travel on every backend (gloo has no int16). The `scale`
    of an encoding does not travel: the values are already decoded, and `aggregate` reads only them.

    Args:
        payload: this rank's payload; every rank's has the same names, shapes and entries per chunk.
        group: the process group (None: the world).

    Returns:
        (the payloads, the bytes this rank put on the wire for them).
    """
    idx_dtype, val_dtype = _wire_dtypes(payload)
    parts = list(payload.tensors.values())
    idx_bytes = torch.cat([c.idx.reshape(-1) for c in parts]).to(idx_dtype).view(torch.uint8)
    val_bytes = torch.cat([c.val.reshape(-1).to(val_dtype) for c in parts]).view(torch.uint8)
    buf = torch.cat([idx_bytes, val_bytes])
    bufs = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(bufs, buf, group=group)
    sizes = [c.idx.numel() for c in parts]
    out = []
    for got in bufs:
        idx_w = got[:idx_bytes.numel()].view(idx_dtype)
        val_w = got[idx_bytes.numel():].view(val_dtype)
        tensors = {}
        for (name, c), i_flat, v_flat in zip(payload.tensors.items(), torch.split(idx_w, sizes),
                                             torch.split(val_w, sizes), strict=True):
            tensors[name] = Compressed(idx=i_flat.long().view_as(c.idx), val=v_flat.to(c.val.dtype).view_as(c.val),
                                       shape=c.shape, chunk=c.chunk)
        out.append(Payload(tensors=tensors, encoding=payload.encoding))
    return out, buf.numel()


def _wire_dtypes(payload: Payload) -> tuple[torch.dtype, torch.dtype]:
    """Index and value dtypes that carry the payload exactly: indices below h * w fit int16 for
    chunks up to 32768 coefficients; bf16-encoded values are bf16 numbers; other values travel in
    the widest of their own dtypes."""
    parts = list(payload.tensors.values())
    idx_dtype = torch.int16 if max(c.totalk for c in parts) <= 2**15 else torch.int32
    if payload.encoding == "bf16":
        return idx_dtype, torch.bfloat16
    val_dtype = functools.reduce(torch.promote_types, (c.val.dtype for c in parts))
    return idx_dtype, val_dtype
