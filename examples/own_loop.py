"""Your own training loop as one peer of a demonet run (docs/own-loop.md).

The run's coordinator hands out the config; this script builds the model it names (the built-in GPT,
as the coordinator's parameters are that model's), and owns the batches (byte windows of this very
file) and the loss. Each `opt.step()` is one round of the run, and prints a line. The token comes from
DEMONET_TOKEN or --token-file; the last line is a JSON summary.

    DEMONET_TOKEN=... python examples/own_loop.py --coordinator HOST:7450 --peer-id alice --out runs/alice
    DEMONET_TOKEN=... python examples/own_loop.py --dht --config run.toml --steps 20 --peer-id bob \\
        [--initial-peers MADDR]          # DHT mode: no coordinator; the first peer prints its MADDR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

import demonet
from demonet.config import load_token
from demonet.errors import PeerUnavailable
from demonet.joined import JoinedRun
from demonet.train.model import GPT


def batches(seq_len: int, batch_size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (x, y) next-byte batches from random windows of this file."""
    data = torch.tensor(list(Path(__file__).read_bytes() * 4), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=gen)
        x = torch.stack([data[s:s + seq_len] for s in starts])
        y = torch.stack([data[s + 1:s + seq_len + 1] for s in starts])
        yield x, y


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="the run's coordinator")
    parser.add_argument("--dht", action="store_true", help="DHT mode: no coordinator")
    parser.add_argument("--initial-peers", action="append", default=[], help="DHT mode: a peer's multiaddr")
    parser.add_argument("--host-maddr", default="/ip4/0.0.0.0/tcp/0", help="DHT mode: where to listen")
    parser.add_argument("--config", help="DHT mode: the run's TOML config")
    parser.add_argument("--steps", type=int, help="DHT mode: rounds in the run")
    parser.add_argument("--token-file", help="a file holding the run token (default: DEMONET_TOKEN)")
    parser.add_argument("--peer-id", required=True)
    parser.add_argument("--out", help="folder for the metrics rows and the checkpoint")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    args = parser.parse_args()
    if args.dht == (args.coordinator is not None):
        parser.error("give either --coordinator HOST:PORT or --dht (DHT mode)")
    try:
        args.token = load_token(args.token_file, os.environ)
    except ValueError as e:
        parser.error(str(e))
    return args


def main() -> int:
    args = _arguments()
    if args.threads:
        torch.set_num_threads(args.threads)
    where = (dict(dht_initial_peers=args.initial_peers, config=args.config, steps=args.steps,
                  dht_options={"host_maddrs": (args.host_maddr,)}) if args.dht else dict(coordinator=args.coordinator))
    try:
        with demonet.join(peer_id=args.peer_id, out=args.out, token=args.token, **where) as run:
            for maddr in run.maddrs:
                print(f"dht listening on {maddr}", flush=True)
            train(run, args.peer_id)
            print(json.dumps({"peer": args.peer_id, "round": run.round, "digest": run.digest, "reason": run.reason}))
    except (ValueError, PeerUnavailable) as e:  # a bad config, a model that does not fit, no coordinator there
        print(f"own_loop.py: {e}", file=sys.stderr)
        return 2
    return 0


def train(run: JoinedRun, peer_id: str) -> None:
    """The user's loop: one `opt.step()` per round of the run, until it is over."""
    cfg = run.config
    torch.manual_seed(cfg.train.seed)  # DHT mode: a new run starts from every peer's own, equal, weights
    model = GPT(cfg.model)
    opt = run.optimizer(model)  # now holds the run's parameters
    data = batches(cfg.train.seq_len, cfg.train.batch_size, seed=zlib.crc32(peer_id.encode()))
    while not run.done:
        x, y = next(data)
        logits, _ = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        round = run.round
        opt.step(loss=loss)  # one round: compress, submit, wait, apply or restore
        opt.zero_grad()
        print(f"round {round}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
