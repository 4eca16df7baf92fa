"""A multi-rank FlexDeMo node as one member of a coordinator run.

Service layer: every rank of the node runs `run_node` (torchrun), the same `demonet.loop.RoundLoop`
as a single-process peer, over a `demonet.flex.link.NodeLink`: local rank 0 alone talks to the
coordinator (`demonet.transport.grpc.GrpcClient`), and every rank applies its rows of the aggregate.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

from demonet.config import load_config
from demonet.errors import PeerUnavailable
from demonet.loop import RoundLoop
from demonet.loop.lifecycle import stop_on_signals
from demonet.transport.coordinated import CoordinatorMembership
from demonet.transport.grpc import GrpcClient
from demonet.wire.identity import Identity

from .link import NodeLink
from .shard import FlexTrainer

__all__ = ["NodeOptions", "run_node"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class NodeOptions:
    """How a node joins a coordinator run."""

    coordinator: str
    """HOST:PORT of the coordinator."""
    token: str
    """The run token."""
    peer_id: str
    """The node's id in the run (one member, however many ranks)."""
    out: Path
    """Folder for ``metrics-<peer_id>.jsonl`` and the node's checkpoint ``node-<peer_id>/``."""
    checkpoint_every: int = 10
    """Rounds between checkpoints (and one at exit); 0: only at exit."""
    root_cert: bytes | None = None
    """PEM root certificate(s) of a TLS coordinator; None for plaintext."""
    reconnect_timeout_s: float = 120.0
    """How long rank 0's calls keep retrying while the coordinator is unreachable."""
    key: Path | None = None
    """The node's Ed25519 key file, made if missing (None: ``<out>/node-<peer_id>.key``); rank 0 uses it."""


async def run_node(mesh: DeviceMesh, opts: NodeOptions, *, device: torch.device) -> int:
    """Run one rank of a node in a coordinator's run, until its last round or SIGTERM (every rank calls it).

    Args:
        mesh: the node's ranks (1-D): the model is sharded over them.
        opts: coordinator, token, ids and folders.
        device: this rank's device.

    Returns:
        0 after the run's last round or a graceful stop; 1 if the coordinator stayed unreachable.
    """
    rank = mesh.get_local_rank()
    inner = (CoordinatorMembership(GrpcClient(
        opts.coordinator, token=opts.token, peer_id=opts.peer_id, root_cert=opts.root_cert,
        reconnect_timeout_s=opts.reconnect_timeout_s,
        identity=Identity.load_or_create(opts.key or opts.out / f"node-{opts.peer_id}.key")), opts.coordinator)
             if rank == 0 else None)
    link: NodeLink | None = None
    stop = asyncio.Event()
    with stop_on_signals(stop):
        try:
            link = NodeLink(mesh.get_group(), inner, {})
            info = await link.join()
            cfg = load_config(None, {}, overrides=info.run_config)
            trainer = FlexTrainer(cfg, mesh, data_seed=info.data_seed, data_rank=rank, data_world=mesh.size(),
                                  device=device, checkpoint=opts.out / f"node-{opts.peer_id}")
            link.full_shapes = dict(trainer.full_shapes)
            loop = RoundLoop(trainer, link, link, opts.peer_id,
                             opts.out / f"metrics-{opts.peer_id}.jsonl" if rank == 0 else None,
                             opts.checkpoint_every, stop, stop_grace_s=None, row_extra={"ranks": mesh.size()},
                             overlap=cfg.net.overlap, lookahead=cfg.net.lookahead)
            if rank == 0:
                loop.log.info("joined %s as one member of %d ranks", opts.coordinator, mesh.size())
            return await loop.run(info)
        except PeerUnavailable as e:
            logger.error("[%s] %s", opts.peer_id, e)
            return 1
        finally:
            if link is not None:
                await link.close()
