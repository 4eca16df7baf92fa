"""`demonet data tokenize`: text files in, one token file and its sidecar of shard hashes out; `demonet data shard`:
the sidecar of an existing token file (the formats: docs/data.md, demonet.train.tokens and .shards).

Reads its flags and hands explicit arguments to demonet.train.tokenizer and .tokens; no training, no network.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy.typing as npt
from tqdm import tqdm

from demonet.train.shards import DEFAULT_SHARD_TOKENS, SIDECAR_SUFFIX, write_shards
from demonet.train.tokenizer import Tokenizer, load_tokenizer
from demonet.train.tokens import DTYPES, write_tokens

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `data` command's own subcommands and their flags."""
    sub = parser.add_subparsers(dest="data_command", required=True)
    tokenize = sub.add_parser(
        "tokenize", help="encode text files into one token file for [train] tokens",
        description="Encode the inputs, in order and with nothing between them, into one token file: a "
                    "256-byte header (tokenizer, vocab, token type and count), then the ids (docs/data.md).")
    tokenize.add_argument("inputs", nargs="+", metavar="INPUT", help="text files")
    tokenize.add_argument("--out", required=True, help="the token file to write (replaced if it exists)")
    tokenize.add_argument("--tokenizer", default="bytes",
                          help="'bytes' (UTF-8 bytes, vocab 256; the default) or a local Hugging Face tokenizer "
                               "directory holding tokenizer.json (needs pip install 'demonet[hf]')")
    tokenize.add_argument("--dtype", choices=sorted(DTYPES),
                          help="token type (default: uint16 when the vocab fits, else uint32)")
    tokenize.add_argument("--no-progress", action="store_true", help="no progress bar")
    _shard_tokens(tokenize)
    shard = sub.add_parser(
        "shard", help="write the sidecar (FILE.shards) of an existing token file",
        description="Cut a token file into shards and write the SHA-256 of each to FILE.shards, so peers can read it "
                    "by range from a URL and verify every shard; prints the file's pin (docs/data.md).")
    shard.add_argument("file", metavar="FILE", help="a token file written by `demonet data tokenize`")
    _shard_tokens(shard)


def _shard_tokens(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                        help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS}); a peer fetches whole shards")


def run(args: argparse.Namespace) -> int:
    """Runs `demonet data ...`; prints what it wrote as JSON; 2 on bad input, with nothing written."""
    if args.data_command == "shard":
        return _shard(args)
    inputs = [Path(p) for p in args.inputs]
    try:
        if args.shard_tokens < 1:
            raise ValueError(f"--shard-tokens should be >= 1, got {args.shard_tokens}")
        missing = [str(p) for p in inputs if not p.is_file()]
        if missing:
            raise ValueError(f"input files not found: {', '.join(missing)}")
        tokenizer = load_tokenizer(args.tokenizer)
        total = sum(p.stat().st_size for p in inputs)
        with tqdm(total=total, unit="B", unit_scale=True, desc="tokenize",
                  disable=args.no_progress or not sys.stderr.isatty()) as bar:
            header = write_tokens(args.out, _encode(tokenizer, inputs, bar), vocab_size=tokenizer.vocab_size,
                                  tokenizer=tokenizer.name, dtype=args.dtype)
        table, pin = write_shards(args.out, args.shard_tokens)
    except (ValueError, OSError, ImportError) as e:
        print(f"demonet data tokenize: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": args.out, "inputs": len(inputs), "input_bytes": total, **vars(header),
                      "shards": table.num_shards, "shard_tokens": table.shard_tokens, "pin": pin}, indent=2))
    return 0


def _shard(args: argparse.Namespace) -> int:
    try:
        table, pin = write_shards(args.file, args.shard_tokens)
    except (ValueError, OSError) as e:
        print(f"demonet data shard: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"file": args.file, "sidecar": args.file + SIDECAR_SUFFIX, "shards": table.num_shards,
                      "shard_tokens": table.shard_tokens, "num_tokens": table.num_tokens, "pin": pin}, indent=2))
    return 0


def _encode(tokenizer: Tokenizer, inputs: list[Path], bar: tqdm[Any]) -> Iterator[npt.NDArray[Any]]:
    for path in inputs:
        bar.set_postfix_str(path.name)
        for ids, num_bytes in tokenizer.encode_file(path):
            bar.update(num_bytes)
            yield ids
