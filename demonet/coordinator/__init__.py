"""The coordinator process: `serve()` runs the gRPC server; `main()` is `demonet coordinator`.

A service module: imports grpc, the servicer, the config. See proto/demonet.proto for the protocol.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from demonet.config import Config, load_config, load_token
from demonet.dashboard import page_routes, start_http
from demonet.errors import StateNotSaved, WeightsFileError
from demonet.log import setup_logging
from demonet.train.task import pin_tokenizer

from .handlers import add_to_server
from .metrics import Metrics
from .server import CoordinatorOptions, CoordinatorServicer

__all__ = ["CoordinatorOptions", "HttpPorts", "add_arguments", "main", "run", "serve", "total_rounds"]

logger = logging.getLogger(__name__)

SERVICE = "demonet.v1.Coordinator"
_SEND_MESSAGE_BYTES = 16 * 2**20  # parts are at most 2 MiB; room for headers
_STREAMS_PER_CONNECTION = 16
"""HTTP/2 streams one connection may have open (a peer has a few: a heartbeat, two Submits, GetAggregate)."""


@dataclass(frozen=True, kw_only=True)
class HttpPorts:
    """The coordinator's HTTP side: Prometheus /metrics and the dashboard (docs/dashboard.md)."""

    metrics: int = 0
    """Serve Prometheus /metrics on this port, on all interfaces, and the dashboard there too unless it
    has its own port or is off; 0: no metrics port."""
    dashboard: int | None = None
    """Serve the dashboard (and /metrics) on this port, on the interface of the gRPC address; 0: any free
    port; None: only on the metrics port."""
    dashboard_on: bool = True
    """False: no dashboard anywhere (the metrics port serves /metrics only)."""

    def __post_init__(self) -> None:
        if self.metrics < 0 or (self.dashboard is not None and self.dashboard < 0):
            raise ValueError("--metrics-port and --dashboard-port should be >= 0")


async def _start_http(servicer: CoordinatorServicer, ports: HttpPorts, listen_host: str
                      ) -> tuple[asyncio.Server, str] | None:
    """Open the HTTP ports: /metrics alone (prometheus_client's thread, as without a dashboard) and the
    dashboard (on this loop, which owns what it reads). Returns the dashboard's server and URL."""
    metrics = servicer.metrics
    shared = ports.dashboard is None or ports.dashboard == ports.metrics != 0  # the dashboard on the metrics port
    if ports.metrics and not (ports.dashboard_on and shared):
        metrics.serve(ports.metrics)
    if not ports.dashboard_on or (shared and not ports.metrics):
        return None
    routes = {**page_routes(servicer.status_document), "/metrics": lambda q: metrics.exposition()}
    host = "0.0.0.0" if shared else listen_host.strip("[]")
    site = await start_http(routes, host, ports.metrics if shared else ports.dashboard or 0)
    shown = "localhost" if host in ("", "0.0.0.0", "::") else host if ":" not in host else f"[{host}]"
    return site, f"http://{shown}:{site.sockets[0].getsockname()[1]}/"


async def serve(cfg: Config, opts: CoordinatorOptions, *, listen: str = "127.0.0.1:0",
                http: HttpPorts = HttpPorts(), tls: tuple[bytes, bytes] | None = None,
                on_listening: Callable[[str], None] | None = None,
                on_dashboard: Callable[[str], None] | None = None, linger_s: float = 10.0) -> None:
    """Run a coordinator until the run's last round closes, or SIGTERM/SIGINT; with a state folder, the
    newest closed round's state is on disk when it returns.

    Args:
        cfg: the run.
        opts: token, state folder, number of rounds.
        listen: HOST:PORT; port 0 takes a free one (passed to `on_listening`).
        http: the metrics and dashboard ports.
        tls: (certificate chain, private key) in PEM, or None for plaintext.
        on_listening: called with "HOST:PORT" once the server accepts calls.
        on_dashboard: then called with the dashboard's URL, if one is served.
        linger_s: after the last round, how long peers may still download its aggregate.

    Raises:
        StateNotSaved: the newest round's state could not be written (the error is logged).
    """
    metrics = Metrics()
    servicer = CoordinatorServicer(cfg, opts, metrics)  # before any port opens: it may refuse --init's file
    host = listen.rsplit(":", 1)[0]
    web = await _start_http(servicer, http, host)
    # The largest message read is one part of the largest payload of this run (limits.LimitsConfig): grpc
    # refuses a longer one from its length prefix, before it holds the rest.
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", servicer.limits.cfg.max_message_bytes),
                                      ("grpc.max_send_message_length", _SEND_MESSAGE_BYTES),
                                      ("grpc.max_concurrent_streams", _STREAMS_PER_CONNECTION)])
    add_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = (server.add_secure_port(listen, grpc.ssl_server_credentials([(tls[1], tls[0])])) if tls
            else server.add_insecure_port(listen))
    await server.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[None]] = set()

    def reload() -> None:  # SIGHUP: read the allowlist again
        task = loop.create_task(servicer.reload_allowlist())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, reload)
    # The canonical apply runs on these kernels; peers whose kernels round differently resync.
    logger.info("[coordinator] listening on %s:%d; CPU kernels %s, %d threads", host, port,
                torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())
    if on_listening is not None:
        on_listening(f"{host}:{port}")
    if web is not None:
        logger.info("[coordinator] dashboard on %s (no token needed to view it)", web[1])
        if on_dashboard is not None:
            on_dashboard(web[1])
    ticker = asyncio.create_task(servicer.core.tick_forever())
    finished = asyncio.create_task(servicer.core.finished.wait())
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({finished, stopped, ticker}, return_when=asyncio.FIRST_COMPLETED)
        if ticker.done() and not ticker.cancelled() and (bug := ticker.exception()) is not None:
            raise bug  # the round loop failed (a bug, or a bug in the state writer): crash, do not hang
        if servicer.core.finished.is_set() and not stop.is_set():
            logger.info("[coordinator] the run's %d rounds are done; serving the last aggregate for %.0f s",
                        opts.total_rounds, linger_s)
            await asyncio.wait({stopped}, timeout=linger_s)
    finally:
        for name in ("", SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        for task in (ticker, finished, stopped):
            task.cancel()
        if servicer.core.advancing is not None:  # a published round's apply (shielded): its digest and its state
            await asyncio.wait({servicer.core.advancing})
        if web is not None:
            web[0].close()
        await server.stop(grace=3.0)
        if servicer.core.persister is not None:  # the newest round's state, before the process exits
            await servicer.core.persist_last()
            await servicer.core.persister.flush()
        logger.info("[coordinator] stopped at round %d", servicer.core.rounds.round)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `demonet coordinator` flags."""
    parser.add_argument("--listen", default="127.0.0.1:7450", help="HOST:PORT to serve on (port 0: any free one)")
    parser.add_argument("--config", help="TOML file with [model], [optim], [train] and [net] tables")
    parser.add_argument("--steps", type=int, help="rounds in the run (default: train.steps; 0: no end)")
    parser.add_argument("--state-dir", help="persist the state here after every round (in the background, once "
                                            "the round is published), and resume from it")
    parser.add_argument("--state-every-s", type=float, default=0.0,
                        help="write the state at most this often (seconds from one write's start to the next; "
                             "0: after every round the writer is free for); a crash loses up to this much")
    parser.add_argument("--token-file", help="file holding the run token (default: the DEMONET_TOKEN env var)")
    parser.add_argument("--round-timeout-s", type=float, help="close a round this long after it opens (30)")
    parser.add_argument("--min-peers", type=int, help="payloads needed to apply a round at its deadline (1)")
    parser.add_argument("--start-peers", type=int, help="the first round opens once this many peers joined (1)")
    parser.add_argument("--max-idle-rounds", type=int, help="rounds stop waiting for a member whose payload is "
                        "missing from this many rounds in a row, until it submits again (3; 0: off)")
    parser.add_argument("--seed", type=int, help="seed of the initial parameters and the peers' data (0)")
    parser.add_argument("--task", metavar="MODULE:FUNCTION",
                        help="the run's model, data and loss, a demonet.Task (default: the built-in GPT); the "
                             "coordinator builds only its model")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus /metrics on this port (all interfaces), and the dashboard at / there "
                             "unless --dashboard-port or --no-dashboard")
    parser.add_argument("--dashboard-port", type=int,
                        help="serve the dashboard (a page at /, /status.json, /metrics; no token) on this port, on "
                             "the --listen interface (0: any free port)")
    parser.add_argument("--no-dashboard", action="store_true", help="serve no dashboard")
    parser.add_argument("--tls-cert", help="PEM certificate chain (with --tls-key: serve TLS)")
    parser.add_argument("--tls-key", help="PEM private key")
    parser.add_argument("--init", metavar="FILE.safetensors",
                        help="initial parameters by name instead of the seeded init (a state in --state-dir wins)")


def total_rounds(steps_flag: int | None, cfg: Config) -> int:
    """The run's rounds: --steps when given (0: no end), else train.steps."""
    if steps_flag is None:
        return cfg.train.steps
    if steps_flag < 0:
        raise ValueError("--steps should be >= 0")
    return steps_flag


def run(args: argparse.Namespace) -> int:
    """Run `demonet coordinator` with parsed flags; returns the exit code."""
    try:
        token = load_token(args.token_file, os.environ)
        cfg = load_config(args.config, os.environ, {
            "train": {"seed": args.seed, "task": args.task},
            "net": {"round_timeout_s": args.round_timeout_s, "min_peers": args.min_peers,
                    "start_peers": args.start_peers, "max_idle_rounds": args.max_idle_rounds},
        })
        cfg = pin_tokenizer(cfg)  # the peers' token files must be this one (its tokenizer, its pin)
        if cfg.train.task:
            from demonet.tasks.hf import pin_task_tokens  # only its own task is changed

            cfg = Config.from_dict(pin_task_tokens(cfg.to_dict()))
        if cfg.optim.base == "adamw":
            # Adam's moments are canonical (they follow from the applied aggregates alone), but the
            # coordinator does not hand them to joiners yet: a late joiner would drift. Refuse.
            raise ValueError("coordinator mode supports optim.base sign or sgd; adamw joiners would not get "
                             "the Adam moments")
        tls = None
        if args.tls_cert or args.tls_key:
            if not (args.tls_cert and args.tls_key):
                raise ValueError("--tls-cert and --tls-key go together")
            tls = (Path(args.tls_cert).read_bytes(), Path(args.tls_key).read_bytes())
        steps = total_rounds(args.steps, cfg)
        if not args.state_every_s >= 0:
            raise ValueError(f"--state-every-s should be >= 0, got {args.state_every_s}")
        http = HttpPorts(metrics=args.metrics_port, dashboard=args.dashboard_port, dashboard_on=not args.no_dashboard)
    except (ValueError, OSError) as e:
        print(f"demonet coordinator: {e}", file=sys.stderr)
        return 2
    opts = CoordinatorOptions(token=token, state_dir=Path(args.state_dir) if args.state_dir else None,
                              state_every_s=args.state_every_s, total_rounds=steps,
                              init_file=Path(args.init) if args.init else None)

    def announce(address: str) -> None:
        print(f"listening on {address}", flush=True)

    def announce_dashboard(url: str) -> None:
        print(f"dashboard on {url}", flush=True)

    coro = serve(cfg, opts, listen=args.listen, http=http, tls=tls, on_listening=announce,
                 on_dashboard=announce_dashboard)
    runner: Callable[[Coroutine[Any, Any, None]], None]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(coro)
    except (ValueError, WeightsFileError) as e:  # the run's task, --init or state cannot be used: nothing served
        print(f"demonet coordinator: {e}", file=sys.stderr)
        return 2
    except StateNotSaved as e:  # logged with its cause; the exit status says it too
        print(f"demonet coordinator: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`coordinator.py` / `python -m demonet.coordinator`: the same as `demonet coordinator`."""
    setup_logging()
    parser = argparse.ArgumentParser(prog="demonet coordinator", description="Run a demonet coordinator.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
