"""The `demonet` command: one entry point with subcommands.

Reads configuration (demonet.config) and hands explicit arguments to the library.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

import torch

from .config import load_config

__all__ = ["main"]

logger = logging.getLogger(__name__)


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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `demonet` command; returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    if args.command == "train":
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
    return 2  # unreachable: argparse requires a command


if __name__ == "__main__":
    raise SystemExit(main())
