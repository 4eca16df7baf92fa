"""FlexDeMo between nodes over torch.distributed: a 2-D mesh (replicate, shard), as in the paper.

Service layer: torch.distributed and the math layer. Inside a node (the ``shard`` dimension) FSDP2
shards the model and reduce-scatters gradients; across nodes (``replicate``: the ranks holding the
same shard on every node) only the DeMo payloads of that shard travel, as one all_gather.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from demonet.optim import aggregate, gather_payloads

from .shard import FlexTrainer

__all__ = ["hybrid_mesh", "replicated_step"]


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


def replicated_step(trainer: FlexTrainer, replicate: dist.ProcessGroup) -> tuple[float, int]:
    """One FlexDeMo step: train, compress the shard, all_gather across nodes
    (`demonet.optim.gather_payloads`), apply the aggregate.

    Every rank holding the same shard applies the same aggregate to the same bits, so the nodes
    stay bit-identical. Returns (this rank's loss, bytes it sent across nodes).
    """
    loss, payload = trainer.train_step()
    payloads, sent = gather_payloads(payload, replicate)
    trainer.opt.apply(aggregate(payloads), lr=trainer.options.lr_at(trainer.step))
    trainer.step += 1
    return loss, sent
