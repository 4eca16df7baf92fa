"""The `demonet` command: one entry point with subcommands.

Reads configuration (demonet.config) and hands explicit arguments to the library; `demonet up`
(demonet.cli.up) launches a coordinator and peers as processes and turns their metrics into a run folder.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from demonet.log import setup_logging

__all__ = ["main"]

logger = logging.getLogger(__name__)

def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command's parser. Only `command`'s own flags are added (its module imported), so that `demonet --help`
    and the light subcommands do not import torch (bench/cli_start.py)."""
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
    train.add_argument("--task", metavar="MODULE:FUNCTION", help="the model, data and loss to train, a demonet.Task "
                                                                 "(default: the built-in byte-level GPT)")
    train.add_argument("--tokens", help="a token file to train on (demonet data tokenize; default: the corpus)")
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
    data_parser = sub.add_parser("data", help="prepare training data: tokenize text into a token file, shard one",
                                 description="Prepare training data (docs/data.md).")
    sub.add_parser("bench", add_help=False, help="compare with AdamW-DDP and hivemind over shaped links (root)")
    status_parser = sub.add_parser(
        "status", help="print a run's status: the run, recent rounds, members, refusals (--json: as JSON)",
        description="Ask a coordinator (gRPC, with the run token) or a dashboard (HTTP, e.g. a DHT peer's) for the "
                    "run's status document (docs/dashboard.md) and print it as tables, or as JSON with --json.")
    health_parser = sub.add_parser("health", help="exit 0 if a coordinator's gRPC health service serves",
                                   description="Ask a coordinator's standard gRPC health service (no "
                                               "token needed); exit 0 on SERVING, 1 otherwise.")
    export_parser = sub.add_parser(
        "export", help="write a coordinator's saved parameters as a safetensors file",
        description="Read DIR/coordinator-state.pt (a coordinator's --state-dir) and write its canonical "
                    "parameters, by name, as a safetensors file (needs the extra: pip install 'demonet[hf]').")
    keygen_parser = sub.add_parser(
        "keygen", help="write a peer's Ed25519 key file and print its allowlist line",
        description="Write a new Ed25519 key (a peer's identity in coordinator mode; `demonet peer --key`) and print "
                    "its public key as the line an allowlist file takes (docs/security.md).")
    parsers = {"peer": peer_parser, "data": data_parser, "status": status_parser, "health": health_parser,
               "export": export_parser, "keygen": keygen_parser}
    if command in parsers:
        _command_module(command).add_arguments(parsers[command])
    if command == "peer":
        from demonet.dht import peer as peer_dht

        peer_dht.add_arguments(peer_parser)
    up = sub.add_parser("up", help="a coordinator and N peers on this machine, as processes",
                        description="Start a coordinator and N peers on localhost, show the progress, then "
                                    "write metrics.jsonl, loss.png and summary.json into the run folder.")
    up.add_argument("--peers", type=int, required=True, help="number of peer processes")
    up.add_argument("--steps", type=int, required=True, help="rounds in the run")
    up.add_argument("--out", required=True, help="run folder (logs/, metrics, checkpoints, summary)")
    up.add_argument("--config", help="TOML file with the run's [model], [optim], [train] and [net] tables")
    up.add_argument("--task", metavar="MODULE:FUNCTION", help="the model, data and loss to train, a demonet.Task "
                                                              "(default: the built-in byte-level GPT)")
    up.add_argument("--lr", type=float, help="learning rate, the run's [optim] lr (default 3e-3, for the built-in "
                                              "GPT; examples.custom_task wants 0.03)")
    up.add_argument("--round-timeout-s", type=float, help="close a round this long after it opens")
    up.add_argument("--state-every-s", type=float, default=0.0,
                    help="the coordinator writes its state at most this often (0: after every round it can)")
    up.add_argument("--threads-per-peer", type=int, default=1, help="torch CPU threads of each peer (1)")
    up.add_argument("--device", default="cpu", help="every peer's device: cpu, cuda or cuda:N (cpu)")
    up.add_argument("--no-progress", action="store_true", help="no progress bar")
    up.add_argument("--dht", action="store_true", help="no coordinator: the peers meet on a hivemind DHT on loopback")
    up.add_argument("--dashboard-port", type=int, default=0,
                    help="the run's dashboard on this port of 127.0.0.1 (0: any free port; the address is printed)")
    up.add_argument("--no-dashboard", action="store_true", help="no dashboard")
    return parser


def _command_module(command: str) -> Any:
    """The module of a subcommand (its `add_arguments` and `run`), imported now."""
    if command == "peer":
        from demonet import peer

        return peer
    if command == "health":
        from demonet import health

        return health
    return importlib.import_module(f"demonet.cli.{command}")


def _parser_for(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser of a command line: with the flags of its subcommand (the first word that is not a flag)."""
    return _parser(next((a for a in argv if not a.startswith("-")), None))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `demonet` command; returns the process exit code."""
    setup_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser_for(argv)
    args, rest = parser.parse_known_args(argv)
    if args.command == "coordinator":
        return _coordinator(rest)
    if args.command == "bench":
        from demonet.lab.evidence.cli import main as bench

        return bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "train":
        return _train(args)
    if args.command == "peer" and args.dht:
        from demonet.dht import peer as peer_dht

        return int(peer_dht.run(args))
    return int(_command_module(args.command).run(args))


def _train(args: argparse.Namespace) -> int:
    import torch

    from demonet.config import load_config
    from demonet.loop.local import run_local
    from demonet.train.token_data import open_tokens

    try:
        cfg = load_config(args.config, os.environ, {
            "train": {"peers": args.peers, "steps": args.steps, "out": args.out, "corpus": args.corpus,
                      "tokens": args.tokens, "seed": args.seed, "device": args.device, "task": args.task},
            "optim": {"lr": args.lr, "compression_topk": args.compression_topk, "encoding": args.encoding},
        })
        if cfg.train.tokens:  # before any peer starts: a missing file, a vocab the model does not cover, no
            tokens = open_tokens(cfg.train.tokens)  # validation part to evaluate on
            tokens.check_vocab(cfg.model.vocab_size)
            if cfg.train.eval_every and not cfg.train.task:
                tokens.batches(batch_size=1, seq_len=cfg.train.seq_len, seed=0, part="val")
    except (ValueError, OSError, ImportError, RuntimeError) as e:
        print(f"demonet train: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    summary = run_local(cfg, progress=not args.no_progress and sys.stderr.isatty())
    print(json.dumps(summary, indent=2))
    return 0


def _coordinator(argv: list[str]) -> int:
    try:
        from demonet import coordinator
    except ImportError as e:
        print(f"demonet coordinator: the coordinator cannot be imported ({e})", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="demonet coordinator", description="Serve a run's rounds over gRPC.")
    coordinator.add_arguments(parser)
    return coordinator.run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
