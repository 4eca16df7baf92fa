"""Benchmark: what a peer reads from a token data server, and what verifying it costs.

Writes a token file of random ids with its sidecar, serves it with tests/range_server.py (a range-capable HTTP
server in its own process on loopback), and walks a peer's batches from the URL: the bytes the server sent against
the bytes of the windows trained on, per batch and in all (the header and sidecar counted apart). Then the cost of
checking shards against their SHA-256, in ms per MB. Exits 1 if the bytes fetched exceed `--bound` times the
window bytes.
Run from the repo root: `python bench/data_reads.py`; `--smoke`: a small file and few batches.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from demonet.train.shards import ShardTable, split_shards, write_shards  # noqa: E402
from demonet.train.token_data import open_tokens  # noqa: E402
from demonet.train.tokens import write_tokens  # noqa: E402


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=40_000_000, help="tokens in the file (uint16)")
    parser.add_argument("--shard-tokens", type=int, default=65_536, help="tokens per shard")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[128, 1024], help="one row each")
    parser.add_argument("--batches", type=int, default=2000, help="batches each row draws (at most one epoch)")
    parser.add_argument("--bound", type=float, default=1.2, help="largest fetched / window bytes accepted")
    parser.add_argument("--smoke", action="store_true", help="a small file, few batches: checks that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.shard_tokens, args.seq_lens, args.batches = 400_000, 4096, [128], 40
    return args


def _served(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/_served", timeout=10) as response:
        return int(json.loads(response.read())["served"])


def _row(port: int, path: Path, cache: Path, seq_len: int, args: argparse.Namespace) -> tuple[float, str]:
    before = _served(port)
    data = open_tokens(f"http://127.0.0.1:{port}/{path.name}", cache_dir=cache / str(seq_len))
    meta = _served(port) - before
    stream = data.batches(batch_size=args.batch_size, seq_len=seq_len, seed=seq_len)
    assert data.reader is not None
    table = data.reader.table
    per_epoch = sum(table.tokens_of(s) // (seq_len + 1) for s in split_shards(table.num_shards)[0])
    num_batches = min(args.batches, per_epoch // args.batch_size)  # within one epoch: no shard read twice
    start = time.perf_counter()
    for _ in range(num_batches):
        next(stream)
    elapsed_s = time.perf_counter() - start
    data.close()
    fetched = _served(port) - before - meta
    windows = num_batches * args.batch_size * (seq_len + 1) * 2
    ratio = fetched / windows
    return ratio, (f"| {seq_len} | {args.batch_size} | {num_batches} | {windows:,} | {fetched:,} | {ratio:.3f}x | "
                   f"{fetched // num_batches:,} | {meta:,} | {1e3 * elapsed_s / num_batches:.2f} |")


def _verify_ms_per_mb(path: Path) -> float:
    """The time `ShardTable.verify` takes over every shard of the file (read into memory first), per MB."""
    table = ShardTable.unpack(Path(f"{path}.shards").read_bytes(), str(path))
    raw = path.read_bytes()
    shards = [raw[o : o + n] for o, n in (table.byte_range(i) for i in range(table.num_shards))]
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for i, data in enumerate(shards):
            table.verify(i, data, str(path))
        best = min(best, time.perf_counter() - start)
    return 1e3 * best / (sum(map(len, shards)) / 1e6)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        www = Path(tmp) / "www"
        www.mkdir()
        path = www / "corpus.tok"
        write_tokens(path, [np.random.default_rng(0).integers(0, 50_000, args.tokens)], vocab_size=50_000,
                     tokenizer="bench")
        write_shards(path, args.shard_tokens)
        server = subprocess.Popen([sys.executable, "-m", "tests.range_server", "--root", str(www)], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline().split()[-1])
            print(f"token file: {args.tokens:,} uint16 tokens, shards of {args.shard_tokens:,} tokens; "
                  "tests/range_server.py on loopback")
            print("| seq_len | batch | batches | window bytes | bytes fetched | fetched / windows | fetched per batch "
                  "| header + sidecar | ms per batch |")
            print("|---|---|---|---|---|---|---|---|---|")
            ratios = []
            for seq_len in args.seq_lens:
                ratio, line = _row(port, path, Path(tmp) / "cache", seq_len, args)
                ratios.append(ratio)
                print(line)
        finally:
            server.kill()
            server.wait()
        print(f"verification (SHA-256 of each shard): {_verify_ms_per_mb(path):.2f} ms per MB")
    met = max(ratios) <= args.bound
    print(f"largest fetched / windows: {max(ratios):.3f}x (bound {args.bound}x): {'met' if met else 'NOT met'}")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
