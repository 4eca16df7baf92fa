"""A peer in coordinator mode: join, download the parameters, then train round after round.

Service layer: builds the replica from the run config the coordinator hands out and runs the one
`demonet.loop.RoundLoop` over `demonet.transport.grpc.GrpcClient`; never imports grpc or protobuf.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from demonet.config import load_config, load_token
from demonet.errors import InvalidPayload, KeyFileError, PeerUnavailable
from demonet.log import setup_logging
from demonet.loop import RoundLoop
from demonet.loop.lifecycle import stop_on_signals, warm_up
from demonet.loop.link import LinkPace
from demonet.tasks import hf
from demonet.train.task import first_difference, param_specs
from demonet.train.trainer import Trainer
from demonet.transport import JoinInfo
from demonet.transport.coordinated import CoordinatorMembership
from demonet.transport.grpc import GrpcClient
from demonet.wire import task_files
from demonet.wire.identity import Identity

__all__ = ["add_arguments", "main", "run", "run_peer"]

logger = logging.getLogger(__name__)


async def run_peer(*, coordinator: str, token: str, peer_id: str, out: Path, device: str = "cpu",
                   threads: int | None = None, accumulate: int = 1, checkpoint_every: int = 10,
                   root_cert: bytes | None = None, reconnect_timeout_s: float = 120.0,
                   task: str | None = None, key: Path | None = None, stop: asyncio.Event | None = None) -> int:
    """Train as one peer of a coordinator's run until its last round, SIGTERM or `stop`.

    Args:
        coordinator: HOST:PORT of the coordinator.
        token: the run token.
        peer_id: this peer's id (letters, digits, '.', '_', '-'); the same id resumes its checkpoint.
        out: folder for ``metrics-<peer_id>.jsonl`` and the checkpoint ``peer-<peer_id>.pt``.
        device: torch device of the replica.
        threads: torch CPU threads (None: torch's choice).
        accumulate: micro-batches per round (gradient accumulation).
        checkpoint_every: save every this many rounds (and at exit); 0: only at exit.
        root_cert: PEM root certificate(s) for a TLS coordinator; None for plaintext.
        reconnect_timeout_s: how long calls keep retrying while the coordinator is unreachable.
        task: MODULE:FUNCTION of this peer's task, instead of the run's `[train] task` (the same task
            under another import name); the run's `[task]` table is its arguments either way.
        key: this peer's Ed25519 key file (`demonet keygen`), made there if missing; None:
            ``<out>/peer-<peer_id>.key``, so a restart keeps the identity the peer id is bound to.
        stop: set it to stop as SIGTERM does (tests); SIGTERM and SIGINT are handled either way.

    Returns:
        0 after the run's last round or a graceful stop; 1 if the coordinator stayed unreachable; 2 if
        this peer's model does not fit the run (it is never admitted), or the run's task files or token file
        are not to be had here (refused before training).
    """
    if accumulate < 1:
        raise ValueError("accumulate should be >= 1")
    if threads:
        torch.set_num_threads(threads)
    stop = stop or asyncio.Event()
    try:
        identity = Identity.load_or_create(key or out / f"peer-{peer_id}.key")
    except (OSError, KeyFileError) as e:
        logger.error("[%s] %s", peer_id, e)
        return 2
    client = GrpcClient(coordinator, token=token, peer_id=peer_id, root_cert=root_cert,
                        reconnect_timeout_s=reconnect_timeout_s, identity=identity)
    membership = CoordinatorMembership(client, coordinator)
    with stop_on_signals(stop):
        try:
            await asyncio.to_thread(warm_up)
            run_info = await membership.probe()  # build and check the model before being admitted
            overrides = dict(run_info.run_config)
            if task:
                overrides["train"] = {**overrides.get("train", {}), "task": task}
            overrides, joined = await _task_files(client, membership, run_info, overrides, out)
            cfg = load_config(None, {}, overrides=overrides)
            trainer = Trainer.for_run(cfg, data_seed=run_info.data_seed, device=torch.device(device),
                                      accumulate=accumulate, checkpoint=out / f"peer-{peer_id}.pt")
            if run_info.param_specs is not None:
                diff = first_difference(param_specs(trainer.model.named_parameters()), list(run_info.param_specs))
                if diff is not None:
                    logger.error("[%s] refused: this peer's model does not fit the run's: %s", peer_id, diff)
                    if joined:  # to fetch the task files: the rounds need not wait for it
                        await membership.leave(run_info.round)
                    return 2
            info = await membership.join()
            loop = RoundLoop(trainer, membership, membership.client, peer_id, out / f"metrics-{peer_id}.jsonl",
                             checkpoint_every, stop, overlap=cfg.net.overlap, lookahead=cfg.net.lookahead,
                             round_s=cfg.net.round_s,
                             link=LinkPace(max_k=cfg.optim.compression_topk, min_k=cfg.optim.topk_floor,
                                           adaptive=cfg.optim.adaptive_topk))
            # kernels that differ between peers are what makes them resync
            loop.log.info("joined %s as key %s: %d parameters, %d rounds in the run; CPU kernels %s, %d threads",
                          coordinator, identity.fingerprint, trainer.num_params(), info.total_rounds,
                          torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())
            return await loop.run(info)
        except PeerUnavailable as e:
            logger.error("[%s] %s", peer_id, e)
            return 1
        except (ValueError, InvalidPayload) as e:  # the task cannot be built, or its files are not the run's
            logger.error("[%s] %s", peer_id, e)
            return 2
        finally:
            await membership.close()


async def _task_files(client: GrpcClient, membership: CoordinatorMembership, run_info: JoinInfo,
                      overrides: dict[str, Any], out: Path) -> tuple[dict[str, Any], bool]:
    """The run config with the Hugging Face task built from this peer's copy of the files the coordinator ships
    (``OUT/task-HASH/``): fetched (which takes a join: GetTaskFiles is a member's call), checked against the
    JoinReply's hashes and stored there, unless a copy there has them all already. Returns the config, and
    whether it joined.

    Raises:
        ValueError: the run's token file is a path this machine does not have.
        InvalidPayload: a file missing, one not listed, or bytes whose hash is not the listed one.
    """
    if not run_info.task_files or overrides.get("train", {}).get("task") != hf.TASK:
        return overrides, False
    listing = tuple(task_files.TaskFile(*f) for f in run_info.task_files)
    folder = out / task_files.folder_name(listing)
    overrides = hf.with_shipped_files(overrides, folder)
    if task_files.stored(folder, listing):
        return overrides, False
    await membership.join()
    start_s = time.monotonic()
    files = await client.get_task_files(run_info.task_files)
    await asyncio.to_thread(task_files.store, folder, files)
    logger.info("[%s] the run's task files (%s: %d bytes, fetched and checked in %.3f s) are in %s", client.peer_id,
                ", ".join(f.name for f in listing), sum(f.size for f in listing), time.monotonic() - start_s, folder)
    return overrides, True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `demonet peer` flags."""
    parser.add_argument("--coordinator", help="HOST:PORT of the coordinator (required without --dht)")
    parser.add_argument("--token-file", help="file holding the run token (default: the DEMONET_TOKEN env var)")
    parser.add_argument("--peer-id", default=f"{socket.gethostname()}-{os.getpid()}",
                        help="this peer's id; the same id resumes its checkpoint (default: HOST-PID)")
    parser.add_argument("--out", default="runs/peer", help="folder for metrics and the checkpoint (runs/peer)")
    parser.add_argument("--key", help="this peer's Ed25519 key file (demonet keygen), made if missing; its peer id "
                                      "is bound to it; with --dht it signs the peer's records and messages (default: "
                                      "OUT/peer-PEER_ID.key)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (cpu)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per round (1)")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="rounds between checkpoints (10)")
    parser.add_argument("--tls-root-cert", help="PEM file to verify a TLS coordinator (default: plaintext)")
    parser.add_argument("--reconnect-timeout-s", type=float, default=120.0,
                        help="give up after the coordinator was unreachable this long (120)")
    parser.add_argument("--task", metavar="MODULE:FUNCTION",
                        help="the model, data and loss to train (default: the run's [train] task; with --dht: "
                             "the built-in GPT)")


def run(args: argparse.Namespace) -> int:
    """Run `demonet peer` with parsed flags; returns the exit code."""
    try:
        if not args.coordinator:
            raise ValueError("--coordinator HOST:PORT is required (or --dht for DHT mode)")
        if getattr(args, "dashboard_port", None) is not None:
            raise ValueError("--dashboard-port is for DHT mode; in coordinator mode the coordinator serves the "
                             "dashboard (demonet coordinator --metrics-port or --dashboard-port)")
        token = load_token(args.token_file, os.environ)
        root_cert = Path(args.tls_root_cert).read_bytes() if args.tls_root_cert else None
        if args.accumulate < 1:
            raise ValueError("--accumulate should be >= 1")
    except (ValueError, OSError) as e:
        print(f"demonet peer: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run_peer(
            coordinator=args.coordinator, token=token, peer_id=args.peer_id, out=Path(args.out),
            device=args.device, threads=args.threads, accumulate=args.accumulate,
            checkpoint_every=args.checkpoint_every, root_cert=root_cert,
            reconnect_timeout_s=args.reconnect_timeout_s, task=args.task, key=Path(args.key) if args.key else None))
    except PermissionError as e:
        print(f"demonet peer: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """`peer.py` / `demonet-peer`: the same as `demonet peer`."""
    setup_logging()
    parser = argparse.ArgumentParser(prog="demonet peer", description="Train as one peer of a coordinator's run.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
