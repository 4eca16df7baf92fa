"""FlexDeMo (From et al. 2025, arXiv 2502.06728): full sharding inside a node, DeMo between nodes.

Service layer: `shard` (FSDP2 + DeMo on each rank's shard, checkpoints), `replicate` (between nodes
over torch.distributed), `node` (a multi-rank node as one member of a coordinator run); the entry
point is ``python -m demonet.flex`` under torchrun.
"""
