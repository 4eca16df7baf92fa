"""``python -m demonet.flex``: a FlexDeMo training process, one per rank, started by torchrun.

Entry point: reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), picks the
device (cuda:LOCAL_RANK with NCCL when CUDA is present, else CPU with gloo) and runs either mode:

- ``--coordinator HOST:PORT``: this torchrun is one node, one member of a coordinator run.
- otherwise: every node is in one torch.distributed world (torchrun --nnodes N), DeMo between nodes.

A rank that returns from `main` ends with `end_process`: its process groups destroyed, logs flushed,
then `os._exit`, without finalizing the interpreter (why: `end_process`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

from demonet.config import Config, load_config, load_token
from demonet.log import setup_logging

from .node import NodeOptions, run_node
from .replicate import hybrid_mesh, replicated_step
from .shard import FlexTrainer, state_bytes

logger = logging.getLogger(__name__)

PG_TIMEOUT_S = 1800.0
"""How long a collective may wait for the node's other ranks (rank 0 may wait on the coordinator)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m demonet.flex",
                                description="FlexDeMo: FSDP inside a node, DeMo between nodes (run under torchrun).")
    p.add_argument("--config", help="TOML file with [model], [optim] and [train] tables (hybrid mode)")
    p.add_argument("--steps", type=int, help="steps (hybrid mode; default train.steps)")
    p.add_argument("--out", default="runs/flex", help="metrics and checkpoints (runs/flex)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps/rounds between checkpoints (0: at exit)")
    p.add_argument("--resume", action="store_true", help="hybrid mode: resume each node from its checkpoint")
    p.add_argument("--threads", type=int, help="torch CPU threads per rank (default: torch's choice)")
    p.add_argument("--coordinator", help="HOST:PORT: join a coordinator run, this torchrun being one node")
    p.add_argument("--token-file", help="file holding the run token (default: the DEMONET_TOKEN env var)")
    p.add_argument("--peer-id", default=f"{socket.gethostname()}-node", help="the node's id in a coordinator run")
    p.add_argument("--tls-root-cert", help="PEM file to verify a TLS coordinator (default: plaintext)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _init() -> tuple[torch.device, int]:
    """Start torch.distributed from torchrun's environment; returns (device, ranks per node)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        if key not in os.environ:
            raise ValueError(f"{key} is not set: start this under torchrun, e.g. "
                             "torchrun --nproc-per-node 2 -m demonet.flex ...")
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"  # gloo for the small object broadcasts on the host
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=PG_TIMEOUT_S))
    return device, int(os.environ["LOCAL_WORLD_SIZE"])


def run_hybrid(cfg: Config, *, steps: int, out: Path, device: torch.device, ranks_per_node: int,
               checkpoint_every: int = 0, resume: bool = False, progress: bool = True) -> None:
    """Train `steps` steps with every node in this torch.distributed world (all ranks call it)."""
    mesh = hybrid_mesh(device.type, ranks_per_node)
    rank, world = dist.get_rank(), dist.get_world_size()
    node = rank // ranks_per_node
    trainer = FlexTrainer(cfg, mesh["shard"], data_seed=cfg.train.seed, data_rank=rank, data_world=world,
                          device=device)
    replicate = mesh["replicate"].get_group()
    ckpt = out / f"node-{node}"
    if resume:
        found = torch.tensor([int((ckpt / ".metadata").exists())])
        dist.all_reduce(found, op=dist.ReduceOp.MIN)
        if not found.item():
            raise ValueError(f"--resume: some node has no checkpoint under {out} (node-<i>/)")
        trainer.load_folder(ckpt)
        steps_at = torch.tensor([trainer.step, -trainer.step])
        dist.all_reduce(steps_at, op=dist.ReduceOp.MAX)
        if steps_at[0] != -steps_at[1]:
            raise ValueError(f"--resume: the nodes' checkpoints are from different steps ({-int(steps_at[1])} to "
                             f"{int(steps_at[0])})")
    out.mkdir(parents=True, exist_ok=True)
    metrics = open(out / "metrics.jsonl", "a") if rank == 0 else None
    try:
        with tqdm(total=steps, initial=trainer.step, disable=not progress or rank != 0, desc="flex",
                  unit="step") as bar:
            while trainer.step < steps:
                loss, sent = replicated_step(trainer, replicate)
                stats = torch.tensor([loss, float(sent)], dtype=torch.float64)
                dist.all_reduce(stats)
                if metrics is not None:
                    metrics.write(json.dumps({"step": trainer.step, "loss": float(stats[0]) / world,
                                              "inter_node_bytes_per_node": float(stats[1]) * ranks_per_node / world,
                                              **state_bytes(trainer.model, trainer.opt)}) + "\n")
                    metrics.flush()
                bar.update(1)
                bar.set_postfix(loss=f"{float(stats[0]) / world:.4f}")
                if checkpoint_every and trainer.step % checkpoint_every == 0:
                    trainer.save_folder(ckpt)
        trainer.save_folder(ckpt)
    finally:
        if metrics is not None:
            metrics.close()


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    args = _parser().parse_args(argv)
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        device, ranks_per_node = _init()
    except ValueError as e:
        print(f"demonet.flex: {e}", file=sys.stderr)
        return 2
    try:
        if args.coordinator:
            if dist.get_world_size() != ranks_per_node:
                raise ValueError("with --coordinator, start one torchrun per node (--nnodes 1): each node is "
                                 "one member of the run")
            opts = NodeOptions(coordinator=args.coordinator, token=load_token(args.token_file, os.environ),
                               peer_id=args.peer_id, out=Path(args.out), checkpoint_every=args.checkpoint_every,
                               root_cert=Path(args.tls_root_cert).read_bytes() if args.tls_root_cert else None)
            mesh = init_device_mesh(device.type, (ranks_per_node,), mesh_dim_names=("shard",))
            return asyncio.run(run_node(mesh, opts, device=device))
        cfg = load_config(args.config, os.environ)
        run_hybrid(cfg, steps=args.steps or cfg.train.steps, out=Path(args.out), device=device,
                   ranks_per_node=ranks_per_node, checkpoint_every=args.checkpoint_every, resume=args.resume,
                   progress=not args.no_progress)
        return 0
    except (ValueError, OSError) as e:
        print(f"demonet.flex: {e}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()


def end_process(code: int) -> NoReturn:
    """End this rank's process with `code` once `main` returned: flush the logs and standard streams, then
    `os._exit`, so the interpreter is not finalized.

    Each gloo process group has worker threads that release a finished collective's Work after its
    caller has moved on; a Work (or a barrier's, which holds the works before it) can hold the last
    reference to a tensor whose Python object the caller has dropped, so the release takes the GIL.
    If that happens while the main thread finalizes the interpreter, Python ends the worker thread
    with pthread_exit inside a (noexcept) tensor destructor, and the C++ runtime aborts the process
    ("terminate called without an active exception"), although the run ended and everything was
    written. `destroy_process_group` only unregisters the groups: their threads stop when the last
    reference to a group goes, and a device mesh still holds the node's group after `main` returns,
    so there is no point at which the threads are known to be idle. `main` has closed every file and
    destroyed the process groups by now; nothing else is left to do at exit.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    end_process(main())
