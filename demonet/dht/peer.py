"""A peer in DHT mode: no coordinator. Peers meet on a hivemind DHT and build each round's aggregate together.

Service layer: the same round loop, checkpoints and metrics as a coordinator-mode peer (`demonet.peer`),
with `demonet.dht.gatherer.DhtGatherer` as its transport. hivemind is imported only when a DHT peer
runs (the optional extra ``dht``), never by importing this module.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from demonet.config import Config, load_config, load_token
from demonet.dashboard import page_routes, start_http
from demonet.errors import KeyFileError, PeerUnavailable
from demonet.loop import RoundLoop
from demonet.loop.lifecycle import stop_on_signals, warm_up
from demonet.loop.link import LinkPace
from demonet.train.data import data_seed
from demonet.train.trainer import Trainer
from demonet.transport import JoinInfo
from demonet.wire.identity import Identity, read_allowlist
from demonet.wire.merge import MergeRules

from . import rules
from .membership import DhtMembership
from .view import DhtView

if TYPE_CHECKING:
    from .gatherer import DhtOptions

__all__ = ["add_arguments", "allowed_keys", "run", "run_dht_peer"]

logger = logging.getLogger(__name__)


def _dashboard_host(host_maddrs: tuple[str, ...]) -> str:
    """The interface of the peer's first listening multiaddr (/ip4/HOST/... or /ip6/HOST/...); else all."""
    parts = host_maddrs[0].split("/") if host_maddrs else []
    return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6") else "0.0.0.0"


async def _serve_view(view: DhtView, host: str, port: int, on_dashboard: Callable[[str], None] | None
                      ) -> asyncio.Server:
    site = await start_http(page_routes(view.document), host, port)
    shown = "localhost" if host in ("0.0.0.0", "::") else host if ":" not in host else f"[{host}]"
    url = f"http://{shown}:{site.sockets[0].getsockname()[1]}/"
    logger.info("[%s] dashboard on %s (no token needed to view it)", view.peer_id, url)
    if on_dashboard is not None:
        on_dashboard(url)
    return site


def allowed_keys(cfg: Config) -> dict[bytes, str | None] | None:
    """The keys whose DHT records and messages count under `[net] admission = "allowlist"` (key -> the
    one peer id it may use); None under "token" and "open" (in DHT mode both need the run token, and
    each peer id counts the first key seen for it).

    Raises:
        OSError, ValueError: the allowlist file cannot be read or parsed.
    """
    return read_allowlist(Path(cfg.net.allowlist)) if cfg.net.admission == "allowlist" else None


def _reload_on_sighup(gatherer: Any, path: Path, peer_id: str) -> None:
    """SIGHUP reads the allowlist again: the records and messages of keys it no longer lists stop counting."""
    def reload() -> None:
        try:
            allowed = read_allowlist(path)
        except (OSError, ValueError) as e:
            logger.error("[%s] SIGHUP: the allowlist was not reloaded, the old one stays: %s", peer_id, e)
            return
        dropped = gatherer.reload_allowlist(allowed)
        logger.info("[%s] allowlist reloaded: %d keys%s", peer_id, len(allowed),
                    f"; no longer counted: {', '.join(dropped)}" if dropped else "")

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)


async def run_dht_peer(cfg: Config, opts: DhtOptions, *, peer_id: str, out: Path, total_rounds: int,
                       device: str = "cpu", threads: int | None = None, accumulate: int = 1,
                       checkpoint_every: int = 10, stop: asyncio.Event | None = None,
                       on_ready: Callable[[list[str]], None] | None = None, dashboard_port: int | None = None,
                       on_dashboard: Callable[[str], None] | None = None, key: Path | None = None) -> int:
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
        dashboard_port: serve this peer's view of the run (docs/dashboard.md) on this port (0: any free
            one), on the interface of its first host multiaddr; None: no dashboard.
        on_dashboard: called with the dashboard's URL.
        key: this peer's Ed25519 key file (`demonet keygen`), made there if missing; None:
            ``<out>/peer-<peer_id>.key``. It signs the peer's DHT records and stream messages.

    Returns:
        0 after the last round or a graceful stop; 1 if the run could not be reached or joined.
    """
    from .gatherer import DhtGatherer

    if threads:
        torch.set_num_threads(threads)
    stop = stop or asyncio.Event()
    try:
        identity = Identity.load_or_create(key or out / f"peer-{peer_id}.key")
    except (OSError, KeyFileError) as e:
        logger.error("[%s] %s", peer_id, e)
        return 2
    membership: DhtMembership | None = None
    view, site = DhtView(peer_id, total_rounds=total_rounds, window_s=opts.window_s), None
    with stop_on_signals(stop):
        try:
            if dashboard_port is not None:
                site = await _serve_view(view, _dashboard_host(opts.host_maddrs), dashboard_port, on_dashboard)
            await asyncio.to_thread(warm_up)
            gatherer = await DhtGatherer.create(opts, peer_id, {}, identity=identity)
            if cfg.net.admission == "allowlist":
                _reload_on_sighup(gatherer, Path(cfg.net.allowlist), peer_id)
            if site is not None:
                gatherer.view, view.refused = view, lambda: gatherer.refused
            membership = DhtMembership(gatherer, JoinInfo(
                peer_id=peer_id, round=0, run_config=cfg.to_dict(), data_seed=data_seed(cfg.train.seed, peer_id),
                round_timeout_s=opts.window_s, heartbeat_interval_s=0.0, total_rounds=total_rounds))
            if on_ready is not None:
                on_ready(gatherer.visible_maddrs())
            await gatherer.check_initial_peers()
            trainer = Trainer.for_run(cfg, data_seed=membership.info.data_seed, device=torch.device(device),
                                      accumulate=accumulate, checkpoint=out / f"peer-{peer_id}.pt")
            gatherer.specs = dict(trainer.opt.param_specs())
            loop = RoundLoop(trainer, membership, gatherer, peer_id, out / f"metrics-{peer_id}.jsonl",
                             checkpoint_every, stop, overlap=cfg.net.overlap, lookahead=cfg.net.lookahead,
                             round_s=cfg.net.round_s,
                             link=LinkPace(max_k=cfg.optim.compression_topk, min_k=cfg.optim.topk_floor,
                                           adaptive=cfg.optim.adaptive_topk))
            info = await membership.join()
            # kernels that differ between peers are what would make them resync
            loop.log.info("%s (%d parameters); CPU kernels %s, %d threads",
                          "starting the run" if info.fresh else f"the run is at round {info.round - 1}: joining",
                          trainer.num_params(), torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())
            return await loop.run(info)
        except PeerUnavailable as e:
            logger.error("[%s] %s", peer_id, e)
            return 1
        except (PermissionError, ValueError) as e:  # a refused token, a task that cannot be built
            logger.error("[%s] %s", peer_id, e)
            return 2
        finally:
            if membership is not None:
                await membership.close()
            if site is not None:
                site.close()


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
    group.add_argument("--dashboard-port", type=int, metavar="PORT",
                       help="serve this peer's view of the run as a dashboard (a page at /, /status.json; no token) "
                            "on this port, on the interface of the first --host-maddr (0: any free port)")


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
            "net": {"round_timeout_s": args.round_timeout_s, "start_peers": args.start_peers},
            "train": {"task": args.task}})
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
                          round_s=cfg.net.round_s, lockstep=cfg.net.lockstep,
                          max_micro_batches=cfg.net.max_micro_batches, spans=not cfg.net.overlap,
                          settle_s=args.settle_s, start_peers=cfg.net.start_peers,
                          leave_after_s=cfg.net.leave_after_s, verify_fraction=cfg.net.verify_slices,
                          exclude_rounds=cfg.net.exclude_owner_rounds, slice_entries=cfg.net.slice_entries,
                          stack_slices=rules.stacks_slices(cfg.optim.encoding), rules=MergeRules.from_config(cfg),
                          allowed=allowed_keys(cfg))
    except (ValueError, OSError) as e:
        print(f"demonet peer: {e}", file=sys.stderr)
        return 2

    def announce(maddrs: list[str]) -> None:
        for maddr in maddrs:
            print(f"dht listening on {maddr}", flush=True)

    def announce_dashboard(url: str) -> None:
        print(f"dashboard on {url}", flush=True)

    kwargs: dict[str, Any] = dict(peer_id=args.peer_id, out=Path(args.out), total_rounds=steps, device=args.device,
                                  threads=args.threads, accumulate=args.accumulate,
                                  checkpoint_every=args.checkpoint_every, on_ready=announce,
                                  dashboard_port=args.dashboard_port, on_dashboard=announce_dashboard,
                                  key=Path(args.key) if args.key else None)
    return asyncio.run(run_dht_peer(cfg, opts, **kwargs))
