"""The `demonet` command: one entry point with subcommands.

Reads configuration (demonet.config) and hands explicit arguments to the library; `demonet up`
launches a coordinator and peers as processes and turns their metrics into a run folder.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch
from tqdm import tqdm

from . import health, peer, peer_dht
from .config import load_config
from .errors import DemonetError
from .log import setup_logging
from .transport.grpc import TOKEN_ENV, GrpcClient, load_token

__all__ = ["main", "merge_metrics", "plot_loss", "summarize_run"]

logger = logging.getLogger(__name__)

LISTEN_TIMEOUT_S = 60.0
"""How long `demonet up` waits for the coordinator's `listening on` line (imports, state load)."""
STOP_GRACE_S = 15.0
"""How long `demonet up` gives a child to exit after SIGTERM before it kills it."""
FINISH_GRACE_S = 60.0
"""How long `demonet up` waits for the peers once the coordinator has exited."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="demonet", description="Decentralized training with DeMo.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train the embedded default on a local cluster of peers in this process",
        description="N peers in one process, each with its own model replica, data shard and DeMo "
                    "optimizer; payloads go through the wire format. Settings: --config TOML < "
                    "DEMONET_<SECTION>_<FIELD> env vars < these flags.")
    train.add_argument("--config", help="TOML file with [model], [optim] and [train] tables")
    train.add_argument("--peers", type=int, help="number of peers (default 4)")
    train.add_argument("--steps", type=int, help="training rounds (default 200)")
    train.add_argument("--out", help="run folder (default runs/demo)")
    train.add_argument("--corpus", help="a text file to train on (default: Python's own help topics)")
    train.add_argument("--lr", type=float, help="learning rate (default 3e-3)")
    train.add_argument("--topk", type=int, dest="compression_topk", help="coefficients kept per chunk (32)")
    train.add_argument("--encoding", help="payload values: fp32, bf16, fp16, int8 or sign (fp32)")
    train.add_argument("--seed", type=int, help="seed of the init and the data streams (0)")
    train.add_argument("--device", help="cpu, cuda or cuda:N (cpu)")
    train.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    # The coordinator parses its own flags (demonet.coordinator.add_arguments), imported only when run.
    sub.add_parser("coordinator", add_help=False, help="serve a run's rounds over gRPC (--help for its flags)")
    peer_parser = sub.add_parser("peer", help="train as one peer of a coordinator's run (or of a DHT run: --dht)",
                                 description="Join a coordinator, download its parameters, train its rounds; or, "
                                             "with --dht, meet the other peers on a hivemind DHT.")
    peer.add_arguments(peer_parser)
    peer_dht.add_arguments(peer_parser)
    status = sub.add_parser("status", help="print a coordinator's status as JSON")
    status.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    status.add_argument("--token-file", help=f"file holding the run token (default: the {TOKEN_ENV} env var)")
    status.add_argument("--tls-root-cert", help="PEM file to verify a TLS coordinator (default: plaintext)")
    health.add_arguments(sub.add_parser("health", help="exit 0 if a coordinator's gRPC health service serves",
                                        description="Ask a coordinator's standard gRPC health service (no "
                                                    "token needed); exit 0 on SERVING, 1 otherwise."))
    up = sub.add_parser("up", help="a coordinator and N peers on this machine, as processes",
                        description="Start a coordinator and N peers on localhost, show the progress, then "
                                    "write metrics.jsonl, loss.png and summary.json into the run folder.")
    up.add_argument("--peers", type=int, required=True, help="number of peer processes")
    up.add_argument("--steps", type=int, required=True, help="rounds in the run")
    up.add_argument("--out", required=True, help="run folder (logs/, metrics, checkpoints, summary)")
    up.add_argument("--config", help="TOML file with the run's [model], [optim], [train] and [net] tables")
    up.add_argument("--round-timeout-s", type=float, help="close a round this long after it opens")
    up.add_argument("--threads-per-peer", type=int, default=1, help="torch CPU threads of each peer (1)")
    up.add_argument("--no-progress", action="store_true", help="no progress bar")
    up.add_argument("--dht", action="store_true", help="no coordinator: the peers meet on a hivemind DHT on loopback")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `demonet` command; returns the process exit code."""
    setup_logging()
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "coordinator":
        return _coordinator(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "train":
        return _train(args)
    if args.command == "peer":
        return peer_dht.run(args) if args.dht else peer.run(args)
    if args.command == "status":
        return _status(args)
    if args.command == "health":
        return health.run(args)
    if args.command == "up":
        return _up(args)
    return 2  # unreachable: argparse requires a command


def _train(args: argparse.Namespace) -> int:
    from .local import run_local

    try:
        cfg = load_config(args.config, os.environ, {
            "train": {"peers": args.peers, "steps": args.steps, "out": args.out, "corpus": args.corpus,
                      "seed": args.seed, "device": args.device},
            "optim": {"lr": args.lr, "compression_topk": args.compression_topk, "encoding": args.encoding},
        })
    except (ValueError, FileNotFoundError) as e:
        print(f"demonet train: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    summary = run_local(cfg, progress=not args.no_progress and sys.stderr.isatty())
    print(json.dumps(summary, indent=2))
    return 0


def _coordinator(argv: list[str]) -> int:
    try:
        from . import coordinator
    except ImportError as e:
        print(f"demonet coordinator: the coordinator cannot be imported ({e})", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="demonet coordinator", description="Serve a run's rounds over gRPC.")
    coordinator.add_arguments(parser)
    return coordinator.run(parser.parse_args(argv))


def _status(args: argparse.Namespace) -> int:
    try:
        token = load_token(args.token_file, os.environ)
        root_cert = Path(args.tls_root_cert).read_bytes() if args.tls_root_cert else None
    except (ValueError, OSError) as e:
        print(f"demonet status: {e}", file=sys.stderr)
        return 2

    async def ask() -> dict[str, Any]:
        client = GrpcClient(args.coordinator, token=token, root_cert=root_cert, reconnect_timeout_s=10.0)
        try:
            return dataclasses.asdict(await client.status())
        finally:
            await client.close()

    try:
        status = asyncio.run(ask())
    except (DemonetError, PermissionError) as e:
        print(f"demonet status: {e}", file=sys.stderr)
        return 1
    print(_json(status))
    return 0


# -- demonet up ----------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    stopped: bool = False
    """We sent it SIGTERM (its exit code then says how it stopped, not that it failed)."""


def _spawn(name: str, argv: list[str], logs: Path, env: dict[str, str]) -> _Child:
    log = open(logs / f"{name}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "demonet.cli", *argv], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env)
    return _Child(name, proc, log)


def _wait_listening(child: _Child, log_path: Path, timeout_s: float) -> str:
    """The HOST:PORT from the coordinator's `listening on HOST:PORT` line in its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith("listening on "):
                return line.removeprefix("listening on ").strip()
        if child.proc.poll() is not None:
            raise RuntimeError(f"the coordinator exited with code {child.proc.returncode}; see {log_path}")
        time.sleep(0.1)
    raise RuntimeError(f"the coordinator did not say where it listens within {timeout_s:.0f} s; see {log_path}")


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
                    bar.set_postfix(loss=f"{status.last_loss:.3f}", peers=len(status.members))
            await asyncio.sleep(0.5)
    finally:
        bar.close()
        await client.close()


def _up(args: argparse.Namespace) -> int:
    if args.peers < 1 or args.steps < 1 or args.threads_per_peer < 1:
        print("demonet up: --peers, --steps and --threads-per-peer should be >= 1", file=sys.stderr)
        return 2
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(24)
    env = {**os.environ, TOKEN_ENV: token}  # never on a command line, where `ps` shows it
    if args.dht:
        return _up_dht(args, out, env)
    argv = ["coordinator", "--listen", "127.0.0.1:0", "--steps", str(args.steps),
            "--state-dir", str(out / "coordinator"), "--start-peers", str(args.peers)]
    if args.config:
        argv += ["--config", args.config]
    if args.round_timeout_s:
        argv += ["--round-timeout-s", str(args.round_timeout_s)]
    coordinator = _spawn("coordinator", argv, logs, env)
    peers: list[_Child] = []
    interrupted = False
    try:
        address = _wait_listening(coordinator, logs / "coordinator.log", LISTEN_TIMEOUT_S)
        logger.info("coordinator listening on %s; starting %d peers; logs in %s", address, args.peers, logs)
        for i in range(args.peers):
            peers.append(_spawn(f"peer-{i}", ["peer", "--coordinator", address, "--peer-id", f"peer-{i}",
                                              "--out", str(out), "--threads", str(args.threads_per_peer)], logs, env))
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
    """Write the run folder's metrics.jsonl, loss.png and summary.json; returns `demonet up`'s exit code."""
    failed = {c.name: c.proc.returncode for c in (*services, *peers)
              if c.proc.returncode != 0 and not (c.stopped and c.proc.returncode in (-signal.SIGTERM, 0))}
    unfinished = [c.name for c in peers if c.stopped]
    rows = merge_metrics(out)
    summary = summarize_run(rows)
    summary.update(failed=failed, unfinished=unfinished, interrupted=interrupted)
    if rows:
        plot_loss(rows, out / "loss.png")
    (out / "summary.json").write_text(_json(summary) + "\n")
    print(_json(summary))
    if interrupted:
        return 130
    return 1 if failed or unfinished or not rows else 0


def _up_dht(args: argparse.Namespace, out: Path, env: dict[str, str]) -> int:
    """`demonet up --dht`: N peers on a DHT over loopback; peer-0 starts it, the others bootstrap from it."""
    logs = out / "logs"
    argv = ["peer", "--dht", "--run", "up", "--steps", str(args.steps),
            "--start-peers", str(args.peers), "--out", str(out), "--threads", str(args.threads_per_peer)]
    if args.config:
        argv += ["--config", args.config]
    if args.round_timeout_s:
        argv += ["--round-timeout-s", str(args.round_timeout_s)]
    # peer-0 starts the DHT at a multiaddr known in advance (its identity and port chosen here), so
    # all peers start at once; the others retry until peer-0 answers.
    from hivemind.p2p import P2P, PeerID

    identity = out / "peer-0.identity"
    if not identity.exists():
        P2P.generate_identity(str(identity))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    maddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{PeerID.from_identity(identity.read_bytes())}"
    peers = [_spawn("peer-0", [*argv, "--peer-id", "peer-0", "--identity", str(identity), "--host-maddr",
                               f"/ip4/127.0.0.1/tcp/{port}"], logs, env)]
    logger.info("peer-0 starts the DHT at %s; logs in %s", maddr, logs)
    for i in range(1, args.peers):
        peers.append(_spawn(f"peer-{i}", [*argv, "--peer-id", f"peer-{i}", "--initial-peers", maddr, "--host-maddr",
                                          "/ip4/127.0.0.1/tcp/0"], logs, env))
    interrupted = False
    bar = tqdm(total=args.steps, disable=args.no_progress or not sys.stderr.isatty(), desc="up --dht", unit="round")
    try:
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


def _json(obj: Any) -> str:
    """Indented JSON with null for NaN and infinities (which JSON does not have)."""

    def finite(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [finite(v) for v in x]
        return x

    return json.dumps(finite(obj), indent=2, allow_nan=False)


# -- the run folder ------------------------------------------------------------------------------------


def merge_metrics(out: Path) -> list[dict[str, Any]]:
    """Merge the peers' ``metrics-<peer>.jsonl`` files into ``<out>/metrics.jsonl``, sorted by (round, peer).

    Returns:
        the merged rows.
    """
    rows = []
    for path in sorted(out.glob("metrics-*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: (r["round"], str(r["peer"])))
    with open(out / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize_run(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What a run folder's metrics say: losses, bytes, and whether the peers' digests agreed.

    Returns:
        rounds and peers seen; first and last loss (mean over peers, then over the first and last
        max(1, min(10, rounds // 4)) rounds); mean bytes up/down per peer per round, overall and by
        peer; digests_agree (every round's peers reported one digest) and the rounds where not.
    """
    by_round: dict[int, list[dict[str, Any]]] = {}
    by_peer: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_round.setdefault(int(r["round"]), []).append(r)
        by_peer.setdefault(str(r["peer"]), []).append(r)
    rounds = sorted(by_round)
    history = [_mean([float(r["loss"]) for r in by_round[n]]) for n in rounds]
    window = max(1, min(10, len(history) // 4))
    disagree = [n for n in rounds if len({r["param_digest"] for r in by_round[n]}) > 1]
    return {
        "rounds": len(rounds),
        "peers": len(by_peer),
        "first_loss": _mean(history[:window]),
        "last_loss": _mean(history[-window:]),
        "bytes_up_per_round": _mean([r["bytes_up"] for r in rows]),
        "bytes_down_per_round": _mean([r["bytes_down"] for r in rows]),
        "per_peer": {peer_id: {"rounds": len(rs), "bytes_up_per_round": _mean([r["bytes_up"] for r in rs]),
                               "bytes_down_per_round": _mean([r["bytes_down"] for r in rs])}
                     for peer_id, rs in sorted(by_peer.items())},
        "digests_agree": bool(rows) and not disagree,
        "disagreeing_rounds": disagree,
    }


def plot_loss(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Write a PNG of each peer's training loss by round, and their mean."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    by_peer: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        by_peer.setdefault(str(r["peer"]), []).append((int(r["round"]), float(r["loss"])))
    for peer_id, points in sorted(by_peer.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], linewidth=0.8, alpha=0.5, label=peer_id)
    by_round: dict[int, list[float]] = {}
    for r in rows:
        by_round.setdefault(int(r["round"]), []).append(float(r["loss"]))
    rounds = sorted(by_round)
    ax.plot(rounds, [_mean(by_round[n]) for n in rounds], color="black", linewidth=1.6, label="mean")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    if len(by_peer) <= 10:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
