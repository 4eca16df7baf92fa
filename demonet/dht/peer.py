"""A peer in DHT mode: no coordinator. Peers meet on a hivemind DHT and build each round's aggregate together.

Service layer: the same round loop, checkpoints and metrics as a coordinator-mode peer (`demonet.peer`),
with `demonet.dht.gatherer.DhtGatherer` as its transport. hivemind is imported only when a DHT peer
runs (the optional extra ``dht``), never by importing this module.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from demonet.config import Config, load_config, load_token
from demonet.coordinator.state import data_seed
from demonet.errors import DemonetError, PeerUnavailable
from demonet.peer import _Peer, _rounds, _warm_up
from demonet.transport.grpc import JoinInfo
from demonet.wire.digest import param_digest
from demonet.wire.merge import MergeRules

if TYPE_CHECKING:
    from .gatherer import DhtGatherer, DhtOptions

__all__ = ["add_arguments", "run", "run_dht_peer"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _DhtPeer(_Peer):
    """A `_Peer` whose transport is the DHT: it publishes its state each round and rejoins by itself."""

    @property
    def dht(self) -> DhtGatherer:
        return self.client  # type: ignore[return-value]

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id

    publishing: asyncio.Task[None] | None = None

    async def begin_round(self) -> None:
        """Tell the DHT this peer starts the round with its digest, and serve its parameters to joiners.

        The records are stored while the peer trains (the previous round's stores are awaited first).
        """
        if self.publishing is not None:
            try:
                await self.publishing
            except PeerUnavailable as e:
                self._log(logging.WARNING, "publishing the round's state: %s", e)
        self.publishing = asyncio.create_task(
            self.dht.publish_state(self.round, self.digest, lambda: list(self.model.named_parameters())))

    async def load_parameters(self, round: int, *, resync: bool = False) -> None:
        """Load the parameters at the start of `round` from several donors into the model (`resync`
        only matters to a coordinator; the donors keep no count)."""
        expected = {name: (tuple(p.shape), p.dtype) for name, p in self.model.named_parameters()}
        tensors, size, donors = await self.dht.load_parameters(round, expected)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(tensors[name])
        self.round, self.digest = round, param_digest(self.model.named_parameters())
        self._log(logging.INFO, "parameters of round %d loaded from %d donors (%s; %d bytes, digest %s)", round,
                  len(donors), ", ".join(donors), size, self.digest[:12])

    async def catch_up(self, reason: DemonetError) -> None:
        """Late, or not the majority's parameters: register for the next rounds and load the parameters."""
        self._log(logging.INFO, "catching up (%s)", reason)
        await self.rejoin()

    async def rejoin(self) -> None:
        """Register for the next rounds, wait to be admitted to one, and load its parameters."""
        opts = self.dht.opts
        wait_s = opts.window_s + 3 * opts.exchange_timeout_s + 30.0
        # Bounded by time, not by tries: while rounds are shorter than a DHT store, a registration
        # can miss the rounds it names several times in a row before one lands in time.
        give_up_at = time.monotonic() + wait_s
        tries = 0
        while tries == 0 or time.monotonic() < give_up_at:
            tries += 1
            head = await self.dht.head_round()
            if head is None:
                raise PeerUnavailable("the DHT knows no round of this run")
            targets = [head + 1, head + 2, head + 3]
            await self.dht.register(targets)
            for r in targets:
                if await self.dht.admitted(r, wait_s):
                    try:
                        await self.load_parameters(r)
                        return
                    except DemonetError as e:
                        self._log(logging.WARNING, "could not load the parameters of round %d: %s", r, e)
                        break
        raise PeerUnavailable(f"not admitted to the run after {tries} tries in {wait_s:.0f} s")


async def run_dht_peer(cfg: Config, opts: DhtOptions, *, peer_id: str, out: Path, total_rounds: int,
                       device: str = "cpu", threads: int | None = None, accumulate: int = 1,
                       checkpoint_every: int = 10, stop: asyncio.Event | None = None,
                       on_ready: Callable[[list[str]], None] | None = None) -> int:
    """Train as one peer of a DHT run until its last round, SIGTERM or `stop`.

    Args:
        cfg: the run (every peer must use the same model, optimizer and seed).
        opts: the DHT, the token and the round timing.
        peer_id: this peer's id; the same id resumes its checkpoint.
        out: folder for ``metrics-<peer_id>.jsonl`` and the checkpoint.
        total_rounds: the run ends after this many rounds.
        device, threads, accumulate, checkpoint_every: as for `demonet.peer.run_peer`.
        stop: set it to stop as SIGTERM does.
        on_ready: called with this peer's visible multiaddrs once its DHT node runs.

    Returns:
        0 after the last round or a graceful stop; 1 if the run could not be reached or joined.
    """
    from .gatherer import DhtGatherer

    if threads:
        torch.set_num_threads(threads)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    gatherer: DhtGatherer | None = None
    peer: _DhtPeer | None = None
    try:
        await asyncio.to_thread(_warm_up)
        gatherer = await DhtGatherer.create(opts, peer_id, {})
        if on_ready is not None:
            on_ready(gatherer.visible_maddrs())
        await gatherer.check_initial_peers()
        info = JoinInfo(peer_id=peer_id, round=0, run_config=cfg.to_dict(),
                        data_seed=data_seed(cfg.train.seed, peer_id), round_timeout_s=opts.window_s,
                        heartbeat_interval_s=1.0, total_rounds=total_rounds)
        peer = _DhtPeer(gatherer, info, cfg, out, torch.device(device),  # type: ignore[arg-type]
                        accumulate, checkpoint_every, stop=stop)
        gatherer.specs = dict(peer.opt.param_specs())
        peer.digest = param_digest(peer.model.named_parameters())
        # kernels that differ between peers are what would make them resync
        peer._log(logging.INFO, "CPU kernels %s, %d threads", torch.backends.cpu.get_cpu_capability(),
                  torch.get_num_threads())
        head = await gatherer.head_round()
        if head is None or head == 0:  # a new run: every peer starts from the seeded init
            peer._log(logging.INFO, "starting the run (%d parameters, digest %s)", peer.model.num_params(),
                      peer.digest[:12])
        else:
            peer._log(logging.INFO, "the run is at round %d: joining", head)
            if total_rounds and head + 1 >= total_rounds:
                peer._log(logging.INFO, "the run is over")
                return 0
            await peer.rejoin()
        await asyncio.to_thread(peer.resume)
        return await _rounds(peer, None)  # a DHT peer's announcements each round are its heartbeat
    except PeerUnavailable as e:
        logger.error("[%s] %s", peer_id, e)
        return 1
    except PermissionError as e:
        logger.error("[%s] %s", peer_id, e)
        return 2
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if peer is not None and peer.publishing is not None:
            peer.publishing.cancel()
            with contextlib.suppress(asyncio.CancelledError, DemonetError):
                await peer.publishing
        if gatherer is not None:
            await gatherer.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `demonet peer --dht` flags (added to `demonet peer`)."""
    group = parser.add_argument_group("DHT mode (no coordinator; needs the extra: pip install 'demonet[dht]')")
    group.add_argument("--dht", action="store_true", help="meet the other peers on a hivemind DHT")
    group.add_argument("--initial-peers", action="append", default=[], metavar="MADDR",
                       help="multiaddr of a peer already in the run (repeat for several; none: start a new DHT)")
    group.add_argument("--host-maddr", action="append", default=[], metavar="MADDR",
                       help="where to listen (default /ip4/0.0.0.0/tcp/0: all interfaces, any free port)")
    group.add_argument("--announce-maddr", action="append", default=[], metavar="MADDR",
                       help="public multiaddr to advertise (a forwarded port)")
    group.add_argument("--identity", metavar="FILE",
                       help="libp2p private key file (created if missing): the same peer id, hence the same "
                            "multiaddr, after a restart")
    group.add_argument("--client-mode", action="store_true",
                       help="behind NAT: only dial out (trains and sends, owns no slice, donates nothing)")
    group.add_argument("--run", default="demonet", help="the run's name in the DHT (demonet)")
    group.add_argument("--config", help="TOML file with the run's [model], [optim], [train] and [net] tables")
    group.add_argument("--steps", type=int, help="rounds in the run (default: train.steps)")
    group.add_argument("--start-peers", type=int, help="the first round freezes once this many peers are in "
                                                      "(default: net.start_peers)")
    group.add_argument("--round-timeout-s", type=float,
                       help="a round freezes at most this long after its first peer is ready (net.round_timeout_s)")
    group.add_argument("--exchange-timeout-s", type=float, default=10.0,
                       help="bound of each exchange phase of a round (10)")
    group.add_argument("--settle-s", type=float, default=0.2, help="DHT store latency allowed (0.2)")


def run(args: argparse.Namespace) -> int:
    """Run `demonet peer --dht` with parsed flags; returns the exit code."""
    try:
        from .gatherer import DhtOptions
    except ImportError as e:
        print(f"demonet peer: DHT mode needs hivemind (pip install 'demonet[dht]'): {e}", file=sys.stderr)
        return 2
    try:
        token = load_token(args.token_file, os.environ)
        cfg = load_config(args.config, os.environ, {
            "net": {"round_timeout_s": args.round_timeout_s, "start_peers": args.start_peers}})
        if args.accumulate < 1:
            raise ValueError("--accumulate should be >= 1")
        steps = args.steps if args.steps is not None else cfg.train.steps
        if steps < 1:
            raise ValueError("--steps should be >= 1")
        if cfg.optim.base == "adamw":
            raise ValueError("DHT mode supports optim.base sign or sgd; adamw joiners would not get the Adam moments")
        opts = DhtOptions(run=args.run, token=token, initial_peers=tuple(args.initial_peers),
                          host_maddrs=tuple(args.host_maddr) or ("/ip4/0.0.0.0/tcp/0",),
                          announce_maddrs=tuple(args.announce_maddr), client_mode=args.client_mode,
                          identity_path=args.identity,
                          window_s=cfg.net.round_timeout_s, exchange_timeout_s=args.exchange_timeout_s,
                          settle_s=args.settle_s, start_peers=cfg.net.start_peers,
                          rules=MergeRules.from_config(cfg))
    except (ValueError, OSError) as e:
        print(f"demonet peer: {e}", file=sys.stderr)
        return 2

    def announce(maddrs: list[str]) -> None:
        for maddr in maddrs:
            print(f"dht listening on {maddr}", flush=True)

    kwargs: dict[str, Any] = dict(peer_id=args.peer_id, out=Path(args.out), total_rounds=steps, device=args.device,
                                  threads=args.threads, accumulate=args.accumulate,
                                  checkpoint_every=args.checkpoint_every, on_ready=announce)
    return asyncio.run(run_dht_peer(cfg, opts, **kwargs))
