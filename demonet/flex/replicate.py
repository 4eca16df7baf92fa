"""FlexDeMo between nodes over torch.distributed: a 2-D mesh (replicate, shard), as in the paper.

Service layer: torch.distributed and the math layer. Inside a node (the ``shard`` dimension) FSDP2
shards the model and reduce-scatters gradients; across nodes (``replicate``: the ranks holding the
same shard on every node) only the DeMo payloads of that shard travel, as one all_gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from demonet.optim import Compressed, Payload, aggregate

from .shard import FlexTrainer

__all__ = ["gather_payloads", "hybrid_mesh", "replicated_step"]


def hybrid_mesh(device_type: str, ranks_per_node: int) -> DeviceMesh:
    """The world as (nodes, ranks per node): dim ``replicate`` across nodes, ``shard`` inside one.

    Raises:
        ValueError: the world is not a whole number of nodes.
    """
    world = dist.get_world_size()
    if ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(f"world size {world} should be a multiple of the ranks per node ({ranks_per_node})")
    return init_device_mesh(device_type, (world // ranks_per_node, ranks_per_node),
                            mesh_dim_names=("replicate", "shard"))


def _wire_dtypes(payload: Payload) -> tuple[torch.dtype, torch.dtype]:
    """Index and value dtypes that carry the payload exactly: indices below h * w fit int16 for
    chunks up to 32768 coefficients; bf16-encoded values are bf16 numbers."""
    largest = max((c.totalk for c in payload.tensors.values()), default=1)
    idx_dtype = torch.int16 if largest <= 2**15 else torch.int32
    val_dtype = torch.bfloat16 if payload.encoding == "bf16" else torch.float32
    return idx_dtype, val_dtype


def gather_payloads(payload: Payload, group: dist.ProcessGroup) -> tuple[list[Payload], int]:
    """Every node's payload for this rank's shard, in node order: one all_gather of raw bytes
    (indices then values; gloo has no int16, bytes travel as they are on every backend).

    Returns:
        (the payloads, the bytes this rank put on the wire for them).
    """
    idx_dtype, val_dtype = _wire_dtypes(payload)
    parts = list(payload.tensors.values())
    idx_flat = torch.cat([c.idx.reshape(-1) for c in parts]).to(idx_dtype)
    val_flat = torch.cat([c.val.reshape(-1) for c in parts]).to(val_dtype)
    idx_bytes = idx_flat.view(torch.uint8)
    buf = torch.cat([idx_bytes, val_flat.view(torch.uint8)])
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


def replicated_step(trainer: FlexTrainer, replicate: dist.ProcessGroup) -> tuple[float, int]:
    """One FlexDeMo step: train, compress the shard, all_gather across nodes, apply the aggregate.

    Every rank holding the same shard applies the same aggregate to the same bits, so the nodes
    stay bit-identical. Returns (this rank's loss, bytes it sent across nodes).
    """
    loss, payload = trainer.train_step()
    payloads, sent = gather_payloads(payload, replicate)
    trainer.opt.apply(aggregate(payloads))
    trainer.step += 1
    return loss, sent
