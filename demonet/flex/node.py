"""A multi-rank FlexDeMo node as one member of a coordinator run.

Service layer: every rank of the node runs `run_node` (torchrun); local rank 0 alone talks to the
coordinator (`demonet.transport.grpc.GrpcClient`). Each round, rank 0 gathers its ranks' shard
payloads, submits their row-wise concatenation (the whole-parameter payload an unsharded peer would
send), and broadcasts the round's outcome; every rank applies its rows of the aggregate. All ranks
run the same steps in the same order, so the node's collectives always match.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from demonet.config import load_config
from demonet.errors import DemonetError, PeerUnavailable
from demonet.optim import Payload
from demonet.transport import Resync, RoundResult
from demonet.transport.grpc import GrpcClient, catch_up, catch_up_timeout_s, keep_alive
from demonet.wire.digest import param_digest

from .shard import FlexTrainer, join_shards

__all__ = ["NodeOptions", "run_node"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


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


class _Node:
    """One rank's view of the node; `client` is set on local rank 0 only."""

    def __init__(self, mesh: DeviceMesh, opts: NodeOptions, device: torch.device,
                 client: GrpcClient | None) -> None:
        self.mesh, self.opts, self.device, self.client = mesh, opts, device, client
        self.group = mesh.get_group()
        self.rank = mesh.get_local_rank()
        self.stop = asyncio.Event()
        self.round = 0
        self.digest = ""
        self.resyncs = 0
        """Whole-parameter downloads because the node's digest differed from the canonical one."""
        self.trainer: FlexTrainer | None = None

    @property
    def ckpt(self) -> Path:
        return self.opts.out / f"node-{self.opts.peer_id}"

    def _log(self, level: int, message: str, *args: Any) -> None:
        if self.rank == 0:
            logger.log(level, f"[{self.opts.peer_id} round={self.round}] {message}", *args)

    async def bcast(self, make: Callable[[], Any] | None = None, value: Any = None) -> Any:
        """Rank 0's value (``await make()`` if given) on every rank of the node."""
        box = [None]
        if self.rank == 0:
            box[0] = await make() if make is not None else value
        src = dist.get_global_rank(self.group, 0)
        await asyncio.to_thread(dist.broadcast_object_list, box, src=src, group=self.group)
        return box[0]

    async def run(self, f: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.to_thread(f, *args)

    # -- parameters ----------------------------------------------------------------------------------

    async def download(self, round: int, *, resync: bool = False) -> tuple[int, dict[str, torch.Tensor]]:
        assert self.client is not None and self.trainer is not None
        expected = {n: (s, torch.float32) for n, s in self.trainer.full_shapes.items()}
        got, tensors, size = await self.client.get_parameters(round, expected, resync=resync)
        self._log(logging.INFO, "parameters of round %d downloaded (%d bytes)", got, size)
        return got, tensors

    async def load_parameters(self, fetch: Callable[[], Any]) -> None:
        """Every rank takes its shard of the parameters rank 0 fetched (round, tensors)."""
        assert self.trainer is not None
        self.round, tensors = await self.bcast(fetch)
        await self.run(self.trainer.load_full, tensors)
        self.digest = param_digest(tensors.items())

    # -- one round -----------------------------------------------------------------------------------

    async def submit(self, shards: list[Payload] | None, losses: list[float] | None) -> Any:
        """Rank 0: the round's outcome, as a dict every rank can act on."""
        assert self.client is not None and self.trainer is not None and shards is not None and losses
        node_payload = join_shards(shards, self.trainer.full_shapes)
        loss = sum(losses) / len(losses)
        try:
            result: RoundResult = await self.client.gather(self.round, node_payload, loss=loss,
                                                           param_digest=self.digest)
        except PeerUnavailable as e:
            self._log(logging.ERROR, "%s", e)
            return {"kind": "unavailable"}
        except DemonetError as e:  # the payload reached no aggregate: restore it, get back in step
            self._log(logging.WARNING, "%s: %s; catching up", type(e).__name__, e)
            return {"kind": "catch_up", "params": await self.catch_up(e), "resync": isinstance(e, Resync)}
        return {"kind": "result", "result": result, "loss": loss,
                "contributed": self.opts.peer_id in result.contributors}

    async def catch_up(self, reason: DemonetError) -> tuple[int, dict[str, torch.Tensor]]:
        assert self.client is not None
        return await catch_up(reason, join=self.client.join, download=self.download, round=self.round,
                              timeout_s=catch_up_timeout_s(self.client.round_timeout_s))

    async def round_once(self, metrics: Any) -> bool:
        """Train, submit, apply one round on every rank; False when the node stops."""
        trainer = self.trainer
        assert trainer is not None
        t0 = time.perf_counter()
        loss, payload = await self.run(trainer.train_step)
        gathered: list[Any] = [None] * trainer.ranks if self.rank == 0 else []
        src = dist.get_global_rank(self.group, 0)
        await self.run(lambda: dist.gather_object((payload, loss), gathered if self.rank == 0 else None,
                                                  dst=src, group=self.group))
        outcome = await self.bcast(lambda: self.submit([g[0] for g in gathered], [g[1] for g in gathered]))
        if outcome["kind"] == "unavailable":
            await self.run(trainer.opt.restore, payload)
            raise PeerUnavailable("the coordinator stayed unreachable")
        if outcome["kind"] == "catch_up":
            if outcome["resync"]:  # told to: the coordinator holds other parameters
                self.resyncs += 1
            await self.run(trainer.opt.restore, payload)
            got, tensors = outcome["params"]
            self.round = got
            await self.run(trainer.load_full, tensors)
            self.digest = param_digest(tensors.items())
            return True
        result: RoundResult = outcome["result"]
        await self.run(self.settle, payload, result, outcome["contributed"])
        self.digest = await self.run(trainer.digest)
        line = {"round": self.round, "peer": self.opts.peer_id, "loss": outcome["loss"], "ranks": trainer.ranks,
                "bytes_up": result.bytes_up, "bytes_down": result.bytes_down, "param_digest": self.digest,
                "canonical_digest": result.param_digest, "contributors": len(result.contributors),
                "aborted": result.aborted}
        if await self.bcast(value=self.digest != result.param_digest):  # every rank takes the same branch
            self._log(logging.WARNING, "digest %s after applying, the coordinator has %s: downloading parameters",
                      self.digest[:12], result.param_digest[:12])
            await self.load_parameters(lambda: self.download(self.round + 1, resync=True))
            self.resyncs += 1
            line["param_digest"], line["resynced"] = self.digest, True
        else:
            self.round += 1
        line["resyncs"] = self.resyncs
        trainer.step = self.round
        line["round_time_s"] = time.perf_counter() - t0
        line["time"] = time.time()  # wall clock at the end of the round (the bench's time axis)
        if self.rank == 0:
            metrics.write(json.dumps(line) + "\n")
            metrics.flush()
        self._log(logging.INFO, "loss %.4f, up %d B, down %d B, %d contributors", outcome["loss"], result.bytes_up,
                  result.bytes_down, len(result.contributors))
        return True

    def settle(self, payload: Payload, result: RoundResult, contributed: bool) -> None:
        """`demonet.peer.settle` on this rank's rows: restore what the aggregate dropped, apply it."""
        assert self.trainer is not None
        opt = self.trainer.opt
        if result.aggregate is None:
            opt.restore(payload)
            return
        local = self.trainer.local_aggregate(result.aggregate)
        opt.restore(payload, kept=local if contributed else None)
        opt.apply(local)

    async def save(self) -> None:
        assert self.trainer is not None
        await self.run(self.trainer.save, self.ckpt)

    async def resume(self) -> None:
        """Take the node's checkpoint (momentum, data streams) if it was saved at the current round;
        the count of resyncs continues either way."""
        assert self.trainer is not None
        saved = await self.bcast(lambda: _saved(self.ckpt))
        if saved is None:
            return
        self.resyncs = int(saved.get("resyncs", 0))
        if saved["round"] == self.round:
            await self.run(self.trainer.load, self.ckpt)
            self._log(logging.INFO, "resumed the momentum from %s", self.ckpt)


async def _saved(folder: Path) -> dict[str, Any] | None:
    """The node checkpoint's round.json ({"round": N, "resyncs": M}), None without one."""
    path = folder / "round.json"
    return dict(json.loads(path.read_text())) if path.exists() else None


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
    client = (GrpcClient(opts.coordinator, token=opts.token, peer_id=opts.peer_id, root_cert=opts.root_cert,
                         reconnect_timeout_s=opts.reconnect_timeout_s) if rank == 0 else None)
    node = _Node(mesh, opts, device, client)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, node.stop.set)
    beats: asyncio.Task[None] | None = None
    try:
        async def join() -> Any:
            assert client is not None
            try:
                info = await client.join()
            except PeerUnavailable as e:
                logger.error("[%s] %s", opts.peer_id, e)
                return None
            return info
        info = await node.bcast(join)
        if info is None:
            return 1
        cfg = load_config(None, {}, overrides=info.run_config)
        node.trainer = FlexTrainer(cfg, mesh, data_seed=info.data_seed, data_rank=rank, data_world=mesh.size(),
                                   device=device)
        node._log(logging.INFO, "joined %s as one member of %d ranks", opts.coordinator, mesh.size())
        if info.total_rounds and info.round >= info.total_rounds:
            return 0
        if client is not None:  # alive from here on, the first download included
            beats = asyncio.create_task(keep_alive(client, lambda: node.round, info.heartbeat_interval_s,
                                                   lambda level, message: node._log(level, "%s", message)))
        await node.load_parameters(lambda: node.download(info.round))
        await node.resume()
        opts.out.mkdir(parents=True, exist_ok=True)
        with open(opts.out / f"metrics-{opts.peer_id}.jsonl", "a") if rank == 0 else contextlib.nullcontext() as m:
            while True:
                go = await node.bcast(value=not node.stop.is_set() and (not info.total_rounds
                                                                         or node.round < info.total_rounds))
                if not go:
                    break
                await node.round_once(m)
                every = opts.checkpoint_every
                if every and node.round % every == 0:
                    await _checkpoint(node)
        await _checkpoint(node)
        return 0
    except PeerUnavailable:
        return 1
    finally:
        if beats is not None:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if client is not None:
            await client.close()


async def _checkpoint(node: _Node) -> None:
    await node.save()
    if node.rank == 0:
        (node.ckpt / "round.json").write_text(json.dumps({"round": node.round, "resyncs": node.resyncs}))
