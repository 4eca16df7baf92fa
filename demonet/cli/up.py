"""`demonet up`: a coordinator (or a DHT) and N peers as processes on this machine, and their run folder.

The processes are the real `demonet coordinator` and `demonet peer` commands; this module starts
them, shows a progress bar, stops them, and turns their metrics into a run folder.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from tqdm import tqdm

from demonet.config import TOKEN_ENV
from demonet.errors import DemonetError
from demonet.loop.runfolder import merge_metrics, plot_loss, plot_pipeline, summarize_run, to_json
from demonet.transport.grpc import GrpcClient

__all__ = ["bar_figures", "run"]

_LR_ENV = "DEMONET_OPTIM_LR"
"""`--lr` reaches the run's config through the variable of `[optim] lr` (docs/configuration.md)."""


logger = logging.getLogger(__name__)

LISTEN_TIMEOUT_S = 60.0
"""How long `demonet up` waits for the coordinator's `listening on` line (imports, state load)."""
STOP_GRACE_S = 15.0
"""How long `demonet up` gives a child to exit after SIGTERM before it kills it."""
FINISH_GRACE_S = 60.0
"""How long `demonet up` waits for the peers once the coordinator has exited."""


@dataclasses.dataclass(eq=False)
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    stopped: bool = False
    """We sent it SIGTERM (its exit code then says how it stopped, not that it failed)."""


def _spawn(name: str, argv: list[str], logs: Path, env: dict[str, str]) -> _Child:
    log = open(logs / f"{name}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "demonet", *argv], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env)
    return _Child(name, proc, log)


def _tail(log_path: Path, lines: int = 8) -> str:
    """The last lines of a child's log, indented, for an error message that says why it stopped."""
    text = log_path.read_text(errors="replace").rstrip().splitlines() if log_path.exists() else []
    return "\n".join(f"  {line}" for line in text[-lines:]) or "  (its log is empty)"


def _wait_line(child: _Child, log_path: Path, prefix: str, timeout_s: float) -> str:
    """The rest of the first line of the child's log that starts with `prefix` (e.g. "listening on ")."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith(prefix):
                return line.removeprefix(prefix).strip()
        if child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited with code {child.proc.returncode}:\n{_tail(log_path)}\n"
                               f"(the whole log: {log_path})")
        time.sleep(0.1)
    raise RuntimeError(f"{child.name} did not say {prefix!r}... within {timeout_s:.0f} s; see {log_path}")


def _dashboard_argv(args: argparse.Namespace) -> list[str]:
    return [] if args.no_dashboard else ["--dashboard-port", str(args.dashboard_port)]


def _announce_dashboard(child: _Child, log_path: Path, args: argparse.Namespace) -> None:
    """Print where the dashboard of the run is (stderr: stdout is the run's JSON summary)."""
    if not args.no_dashboard:
        url = _wait_line(child, log_path, "dashboard on ", LISTEN_TIMEOUT_S)
        print(f"dashboard: {url}", file=sys.stderr, flush=True)


def _stop(children: list[_Child], grace_s: float) -> None:
    """SIGTERM to the children still running, then SIGKILL to those still there after `grace_s`."""
    for child in children:
        if child.proc.poll() is None:
            child.stopped = True
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0f s: killing it", child.name, grace_s)
            child.proc.kill()
            child.proc.wait()
        child.log.close()


async def _watch(address: str, token: str, coordinator: _Child, peers: list[_Child], steps: int,
                 progress: bool) -> None:
    """Poll the children and the coordinator's status until the peers are done or something failed."""
    client = GrpcClient(address, token=token, reconnect_timeout_s=1.0, call_timeout_s=2.0)
    bar = tqdm(total=steps, disable=not progress, desc="up", unit="round")
    finished_at: float | None = None
    try:
        while True:
            codes = [c.proc.poll() for c in (coordinator, *peers)]
            if any(code not in (None, 0) for code in codes) or all(code == 0 for code in codes[1:]):
                return
            if codes[0] == 0:  # the run is over: the peers finish their last round
                finished_at = finished_at or time.monotonic()
                if time.monotonic() - finished_at > FINISH_GRACE_S:
                    return
            else:
                try:
                    status = await client.status()
                except DemonetError:
                    pass
                else:
                    bar.update(min(status.rounds_closed, steps) - bar.n)
                    bar.set_postfix(bar_figures(status.last_loss, len(status.members)))
            await asyncio.sleep(0.5)
    finally:
        bar.close()
        await client.close()


def bar_figures(last_loss: float, members: int) -> dict[str, str]:
    """The progress bar's figures: the loss once a round reported one, the peers once any joined."""
    figures = {"loss": f"{last_loss:.3f}"} if math.isfinite(last_loss) else {}
    figures["peers"] = str(members) if members else "joining"
    return figures


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    if args.peers < 1 or args.steps < 1 or args.threads_per_peer < 1:
        print("demonet up: --peers, --steps and --threads-per-peer should be >= 1", file=sys.stderr)
        return 2
    if not args.state_every_s >= 0:  # NaN too
        print(f"demonet up: --state-every-s should be >= 0, got {args.state_every_s}", file=sys.stderr)
        return 2
    if args.lr is not None and not args.lr > 0:
        print(f"demonet up: --lr should be > 0, got {args.lr}", file=sys.stderr)
        return 2
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(24)
    env = {**os.environ, TOKEN_ENV: token}  # never on a command line, where `ps` shows it
    if args.lr is not None:  # above --config's [optim] lr (CLI > env > TOML), for the coordinator and DHT peers alike
        env[_LR_ENV] = repr(args.lr)
    token_file = out / "token"  # for `demonet status --coordinator ADDR --token-file OUT/token` while it runs
    token_file.touch(mode=0o600)
    token_file.chmod(0o600)
    token_file.write_text(token + "\n")
    signal.signal(signal.SIGTERM, _interrupt)  # stop the children as Ctrl-C does
    if args.dht:
        return _up_dht(args, out, env)
    argv = ["coordinator", "--listen", "127.0.0.1:0", "--steps", str(args.steps),
            "--state-dir", str(out / "coordinator"), "--state-every-s", str(args.state_every_s),
            "--start-peers", str(args.peers), *_dashboard_argv(args)]
    if args.config:
        argv += ["--config", args.config]
    if args.task:  # the peers take it from the run's config
        argv += ["--task", args.task]
    if args.round_timeout_s:
        argv += ["--round-timeout-s", str(args.round_timeout_s)]
    coordinator = _spawn("coordinator", argv, logs, env)
    peers: list[_Child] = []
    interrupted = False
    try:
        address = _wait_line(coordinator, logs / "coordinator.log", "listening on ", LISTEN_TIMEOUT_S)
        _announce_dashboard(coordinator, logs / "coordinator.log", args)
        logger.info("coordinator listening on %s; starting %d peers; logs in %s; `demonet status --coordinator %s "
                    "--token-file %s` shows the run", address, args.peers, logs, address, token_file)
        for i in range(args.peers):
            peers.append(_spawn(f"peer-{i}", ["peer", "--coordinator", address, "--peer-id", f"peer-{i}",
                                              "--out", str(out), "--threads", str(args.threads_per_peer),
                                              "--device", args.device], logs, env))
        asyncio.run(_watch(address, token, coordinator, peers, args.steps,
                           not args.no_progress and sys.stderr.isatty()))
    except KeyboardInterrupt:
        interrupted = True
    except RuntimeError as e:
        print(f"demonet up: {e}", file=sys.stderr)
    finally:
        _stop(peers, STOP_GRACE_S)
        _stop([coordinator], STOP_GRACE_S)
    return _finish_run(out, [coordinator], peers, interrupted)


def _finish_run(out: Path, services: list[_Child], peers: list[_Child], interrupted: bool) -> int:
    """Write the run folder's metrics.jsonl, loss.png, compute_wait.png and summary.json; returns `demonet up`'s
    exit code."""
    failed = {c.name: c.proc.returncode for c in (*services, *peers)
              if c.proc.returncode != 0 and not (c.stopped and c.proc.returncode in (-signal.SIGTERM, 0))}
    unfinished = [c.name for c in peers if c.stopped]
    rows = merge_metrics(out)
    summary = summarize_run(rows)
    summary.update(failed=failed, unfinished=unfinished, interrupted=interrupted)
    if rows:
        plot_loss(rows, out / "loss.png")
        plot_pipeline(rows, out / "compute_wait.png")
    (out / "summary.json").write_text(to_json(summary) + "\n")
    print(to_json(summary))
    if interrupted:
        return 130
    return 1 if failed or unfinished or not rows else 0


def _up_dht(args: argparse.Namespace, out: Path, env: dict[str, str]) -> int:
    """`demonet up --dht`: N peers on a DHT over loopback; peer-0 starts it, the others bootstrap from it."""
    logs = out / "logs"
    argv = ["peer", "--dht", "--run", "up", "--steps", str(args.steps),
            "--start-peers", str(args.peers), "--out", str(out), "--threads", str(args.threads_per_peer),
            "--device", args.device]
    if args.config:
        argv += ["--config", args.config]
    if args.task:
        argv += ["--task", args.task]
    if args.round_timeout_s:
        argv += ["--round-timeout-s", str(args.round_timeout_s)]
    # peer-0 starts the DHT at a multiaddr known in advance (its identity and port chosen here); the others
    # start once it listens, so that their first start of the DHT finds it (a start that found no initial
    # peer is retried, which costs its start's time bound).
    from hivemind.p2p import P2P, PeerID

    identity = out / "peer-0.identity"
    if not identity.exists():
        P2P.generate_identity(str(identity))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    maddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{PeerID.from_identity(identity.read_bytes())}"
    peers = [_spawn("peer-0", [*argv, "--peer-id", "peer-0", "--identity", str(identity), "--host-maddr",
                               f"/ip4/127.0.0.1/tcp/{port}", *_dashboard_argv(args)], logs, env)]
    logger.info("peer-0 starts the DHT at %s; logs in %s", maddr, logs)
    try:
        _wait_line(peers[0], logs / "peer-0.log", "dht listening on ", LISTEN_TIMEOUT_S)
    except RuntimeError as e:
        print(f"demonet up: {e}", file=sys.stderr)
        _stop(peers, STOP_GRACE_S)
        return _finish_run(out, [], peers, False)
    for i in range(1, args.peers):
        peers.append(_spawn(f"peer-{i}", [*argv, "--peer-id", f"peer-{i}", "--initial-peers", maddr, "--host-maddr",
                                          "/ip4/127.0.0.1/tcp/0"], logs, env))
    interrupted = False
    bar = tqdm(total=args.steps, disable=args.no_progress or not sys.stderr.isatty(), desc="up --dht", unit="round")
    try:
        _announce_dashboard(peers[0], logs / "peer-0.log", args)  # peer-0's view of the run
        while True:
            codes = [c.proc.poll() for c in peers]
            if any(code not in (None, 0) for code in codes) or all(code == 0 for code in codes):
                break
            done = max((len(p.read_text().splitlines()) for p in out.glob("metrics-*.jsonl")), default=0)
            bar.update(min(done, args.steps) - bar.n)
            time.sleep(0.5)
    except KeyboardInterrupt:
        interrupted = True
    except RuntimeError as e:
        print(f"demonet up: {e}", file=sys.stderr)
    finally:
        bar.close()
        _stop(peers, STOP_GRACE_S)
    return _finish_run(out, [], peers, interrupted)
