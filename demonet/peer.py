"""A peer in coordinator mode: join, download the parameters, then train round after round.

Service layer: builds the model, data and DeMo from the run config the coordinator hands out, and
talks to it only through `demonet.transport.grpc.GrpcClient`; never imports grpc or protobuf.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from demonet.config import Config, load_config, load_token
from demonet.errors import DemonetError, PeerUnavailable
from demonet.log import setup_logging
from demonet.optim import DeMo, Payload
from demonet.train.data import Batches, load_corpus, split
from demonet.train.model import GPT
from demonet.transport import Resync, RoundResult
from demonet.transport.grpc import GrpcClient, JoinInfo, catch_up, catch_up_timeout_s, keep_alive
from demonet.wire.digest import param_digest

__all__ = ["add_arguments", "main", "run", "run_peer", "settle"]

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
"""After SIGTERM, how long the peer still waits for the open round's aggregate before abandoning it."""


def settle(opt: DeMo, payload: Payload, result: RoundResult, peer_id: str) -> None:
    """Apply a round's outcome to this peer's optimizer.

    The aggregate may hold only the largest merged coefficients, so a contributor restores the
    entries of its payload that the aggregate dropped; a peer whose payload missed the round
    restores all of it; an aborted round restores the payload and applies nothing.
    """
    if result.aggregate is None:
        opt.restore(payload)
        return
    kept = result.kept if result.kept is not None else result.aggregate
    opt.restore(payload, kept=kept if peer_id in result.contributors else None)
    opt.apply(result.aggregate)


@dataclass(eq=False)
class _Peer:
    """One running peer: its connection, replica, optimizer and data stream, and where it is."""

    client: GrpcClient
    info: JoinInfo
    cfg: Config
    out: Path
    device: torch.device
    accumulate: int
    checkpoint_every: int
    model: GPT = field(init=False)
    opt: DeMo = field(init=False)
    batches: Batches = field(init=False)
    round: int = 0
    digest: str = ""
    resyncs: int = 0
    """Whole-parameter downloads because this peer's digest differed from the canonical one (the
    `resyncs` field of every metrics row): each is the dense transfer the compressed rounds avoid."""
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        cfg, o = self.cfg, self.cfg.optim
        torch.manual_seed(cfg.train.seed)  # the downloaded parameters replace these weights
        self.model = GPT(cfg.model).to(self.device)
        self.opt = DeMo.from_settings(self.model.named_parameters(), o)
        train_data, _ = split(load_corpus(cfg.train.corpus or None))
        self.batches = Batches(train_data, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len,
                               seed=self.info.data_seed, rank=0, world=1)
        self.round = self.info.round

    @property
    def peer_id(self) -> str:
        return self.client.peer_id

    @property
    def checkpoint_path(self) -> Path:
        return self.out / f"peer-{self.peer_id}.pt"

    def _log(self, level: int, message: str, *args: Any) -> None:
        logger.log(level, f"[{self.peer_id} round={self.round}] {message}", *args)

    # -- state -----------------------------------------------------------------------------------------

    async def load_parameters(self, round: int, *, resync: bool = False) -> None:
        """Download the canonical parameters at the start of `round` into the model; `resync`: because
        the digest after applying round - 1 differed (the coordinator counts it)."""
        expected = {name: (tuple(p.shape), p.dtype) for name, p in self.model.named_parameters()}
        got, tensors, size = await self.client.get_parameters(round, expected, resync=resync)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(tensors[name])
        self.round, self.digest = got, param_digest(self.model.named_parameters())
        self._log(logging.INFO, "parameters of round %d loaded (%d bytes, digest %s)", got, size, self.digest[:12])

    def save_checkpoint(self) -> None:
        """Model, momentum and data stream at the start of `self.round`; atomic (temp file, then rename)."""
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint_path.with_suffix(".pt.tmp")
        torch.save({"peer_id": self.peer_id, "round": self.round, "param_digest": self.digest,
                    "model": self.model.state_dict(), "optim": self.opt.state_dict(),
                    "data": self.batches.state_dict(), "resyncs": self.resyncs}, tmp)
        os.replace(tmp, self.checkpoint_path)

    def resume(self) -> None:
        """Take the momentum from the checkpoint if it was saved at the round the parameters are at.

        Otherwise the momentum starts at zero, as a late joiner's does. The data stream continues
        where it stopped either way (same seed), so a restarted peer does not see its batches again,
        and so does the count of resyncs its metrics rows carry.
        """
        if not self.checkpoint_path.exists():
            return
        ckpt = torch.load(self.checkpoint_path, map_location=self.device, weights_only=True)
        with contextlib.suppress(ValueError):  # another data seed: keep the fresh stream
            self.batches.load_state_dict(ckpt["data"])
        self.resyncs = int(ckpt.get("resyncs", 0))
        if ckpt.get("peer_id") == self.peer_id and ckpt["round"] == self.round:
            self.opt.load_state_dict(ckpt["optim"])
            self._log(logging.INFO, "resumed the momentum from %s", self.checkpoint_path)
        else:
            self._log(logging.INFO, "checkpoint is from round %d: starting with zero momentum", ckpt["round"])

    # -- one round -------------------------------------------------------------------------------------

    def train_step(self) -> tuple[float, Payload]:
        """Forward and backward over `accumulate` micro-batches, then compress (blocking torch work)."""
        total = 0.0
        for _ in range(self.accumulate):
            x_BT, y_BT = next(self.batches)
            _, loss = self.model(x_BT.to(self.device), y_BT.to(self.device))
            assert loss is not None
            (loss / self.accumulate).backward()
            total += float(loss.detach())
        payload = self.opt.compress()
        self.opt.zero_grad(set_to_none=True)
        return total / self.accumulate, payload

    def finish_round(self, payload: Payload, result: RoundResult) -> None:
        """Restore/apply the outcome and take the new digest (blocking torch work)."""
        settle(self.opt, payload, result, self.peer_id)
        self.digest = param_digest(self.model.named_parameters())

    async def gather_or_stop(self, payload: Payload, loss: float) -> RoundResult | None:
        """The round's outcome; None if SIGTERM came and the round did not end within STOP_GRACE_S."""
        gather = asyncio.create_task(self.client.gather(self.round, payload, loss=loss, param_digest=self.digest))
        stopped = asyncio.create_task(self.stop.wait())
        await asyncio.wait({gather, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not gather.done():
            self._log(logging.INFO, "stopping: waiting up to %.0f s for the round to close", STOP_GRACE_S)
            await asyncio.wait({gather}, timeout=STOP_GRACE_S)
        if not gather.done():
            gather.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gather
            return None
        return gather.result()

    async def run_round(self, metrics: TextIO) -> bool:
        """Train, submit, apply one round; False when the peer should stop (SIGTERM)."""
        await self.begin_round()
        t0 = time.perf_counter()
        loss, payload = await asyncio.to_thread(self.train_step)
        compute_s = time.perf_counter() - t0  # the blocking torch work: train_step, then finish_round
        try:
            result = await self.gather_or_stop(payload, loss)
        except DemonetError as e:  # the payload reached no aggregate this peer will apply
            await asyncio.to_thread(self.opt.restore, payload)
            if isinstance(e, PeerUnavailable):
                raise
            if isinstance(e, Resync):  # the coordinator (or the DHT's majority) holds other parameters
                self.resyncs += 1
            self._log(logging.WARNING, "%s: %s; catching up", type(e).__name__, e)
            await self.catch_up(e)
            return True
        if result is None:
            await asyncio.to_thread(self.opt.restore, payload)
            self._log(logging.INFO, "abandoned the round")
            return False
        t1 = time.perf_counter()
        await asyncio.to_thread(self.finish_round, payload, result)
        compute_s += time.perf_counter() - t1
        line = {"round": self.round, "peer": self.peer_id, "loss": loss, "bytes_up": result.bytes_up,
                "bytes_down": result.bytes_down, "param_digest": self.digest,
                "round_time_s": time.perf_counter() - t0, "compute_s": compute_s, "time": time.time(),
                "contributors": len(result.contributors), "aborted": result.aborted}
        if result.param_digest and self.digest != result.param_digest:
            self._log(logging.WARNING, "digest %s after applying, the coordinator has %s: downloading parameters",
                      self.digest[:12], result.param_digest[:12])
            await self.load_parameters(self.round + 1, resync=True)
            self.resyncs += 1
            line["param_digest"], line["resynced"] = self.digest, True
        else:
            self.round += 1
        line["resyncs"] = self.resyncs
        metrics.write(json.dumps(line) + "\n")
        metrics.flush()
        self._log(logging.INFO, "loss %.4f, up %d B, down %d B, %d contributors%s", loss, result.bytes_up,
                  result.bytes_down, len(result.contributors), " (aborted)" if result.aborted else "")
        if self.checkpoint_every and self.round % self.checkpoint_every == 0:
            await asyncio.to_thread(self.save_checkpoint)
        return True

    async def begin_round(self) -> None:
        """Called before each round's training (the coordinator needs nothing then)."""

    async def catch_up(self, reason: DemonetError) -> None:
        """Get back in step after the round's payload was refused (the payload is already restored)."""
        async def join() -> JoinInfo:
            self.info = await self.client.join()
            return self.info

        await catch_up(reason, join=join, download=self.load_parameters, round=self.round,
                       timeout_s=catch_up_timeout_s(self.info.round_timeout_s))

    def _log_line(self, level: int, message: str) -> None:
        self._log(level, "%s", message)


def _warm_up() -> None:
    """Pay torch's one-time costs before joining: the optimizer's lazy import of torch._dynamo and the
    first backward take seconds, and a peer admitted at once must train within the round timeout."""
    p = torch.zeros(2, requires_grad=True)
    torch.optim.SGD([p], lr=0.1)
    torch.autograd.backward((p * 2).sum())


async def run_peer(*, coordinator: str, token: str, peer_id: str, out: Path, device: str = "cpu",
                   threads: int | None = None, accumulate: int = 1, checkpoint_every: int = 10,
                   root_cert: bytes | None = None, reconnect_timeout_s: float = 120.0,
                   stop: asyncio.Event | None = None) -> int:
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
        stop: set it to stop as SIGTERM does (tests); SIGTERM and SIGINT are handled either way.

    Returns:
        0 after the run's last round or a graceful stop; 1 if the coordinator stayed unreachable.
    """
    if accumulate < 1:
        raise ValueError("accumulate should be >= 1")
    if threads:
        torch.set_num_threads(threads)
    client = GrpcClient(coordinator, token=token, peer_id=peer_id, root_cert=root_cert,
                        reconnect_timeout_s=reconnect_timeout_s)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.to_thread(_warm_up)
        info = await client.join()
        cfg = load_config(None, {}, overrides=info.run_config)
        peer = _Peer(client, info, cfg, out, torch.device(device), accumulate, checkpoint_every, stop=stop)
        peer._log(logging.INFO, "joined %s: %d parameters, %d rounds in the run; CPU kernels %s, %d threads",
                  coordinator, peer.model.num_params(), info.total_rounds, torch.backends.cpu.get_cpu_capability(),
                  torch.get_num_threads())  # kernels that differ between peers are what makes them resync
        if info.total_rounds and info.round >= info.total_rounds:
            peer._log(logging.INFO, "the run is over")
            return 0
        # Alive from here on, the first download included (a joiner on a slow link is not dropped).
        beats = asyncio.create_task(keep_alive(client, lambda: peer.round, info.heartbeat_interval_s, peer._log_line))
        await peer.load_parameters(info.round)
        await asyncio.to_thread(peer.resume)
        return await _rounds(peer, beats)
    except PeerUnavailable as e:
        logger.error("[%s] %s", peer_id, e)
        return 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await client.close()


async def _rounds(peer: _Peer, beats: asyncio.Task[None] | None) -> int:
    """The round loop; cancels the heartbeat task (if any) and saves a checkpoint however it ends."""
    out, total = peer.out, peer.info.total_rounds
    out.mkdir(parents=True, exist_ok=True)
    try:
        with open(out / f"metrics-{peer.peer_id}.jsonl", "a") as metrics:
            while (not total or peer.round < total) and not peer.stop.is_set():
                if not await peer.run_round(metrics):
                    break
                if beats is not None and beats.done():
                    beats.result()  # a bug in the heartbeat task: raise it here
        peer._log(logging.INFO, "stopping" if peer.stop.is_set() else "the run is over")
        return 0
    finally:
        if beats is not None:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
        await asyncio.to_thread(peer.save_checkpoint)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `demonet peer` flags."""
    parser.add_argument("--coordinator", help="HOST:PORT of the coordinator (required without --dht)")
    parser.add_argument("--token-file", help="file holding the run token (default: the DEMONET_TOKEN env var)")
    parser.add_argument("--peer-id", default=f"{socket.gethostname()}-{os.getpid()}",
                        help="this peer's id; the same id resumes its checkpoint (default: HOST-PID)")
    parser.add_argument("--out", default="runs/peer", help="folder for metrics and the checkpoint (runs/peer)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (cpu)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per round (1)")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="rounds between checkpoints (10)")
    parser.add_argument("--tls-root-cert", help="PEM file to verify a TLS coordinator (default: plaintext)")
    parser.add_argument("--reconnect-timeout-s", type=float, default=120.0,
                        help="give up after the coordinator was unreachable this long (120)")


def run(args: argparse.Namespace) -> int:
    """Run `demonet peer` with parsed flags; returns the exit code."""
    try:
        if not args.coordinator:
            raise ValueError("--coordinator HOST:PORT is required (or --dht for DHT mode)")
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
            reconnect_timeout_s=args.reconnect_timeout_s))
    except PermissionError as e:
        print(f"demonet peer: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """`peer.py` / `demonet-peer`: the same as `demonet peer`."""
    setup_logging()
    parser = argparse.ArgumentParser(prog="demonet peer", description="Train as one peer of a coordinator's run.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
