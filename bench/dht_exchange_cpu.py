"""Benchmark: one DHT peer's CPU work in a round's exchange, timed alone (no sockets, no DHT).

For N in --peers-list it makes N real payloads of the model (one training step each, data seeds 0..N-1),
cuts them into N slices as `demonet.dht.rules.SlicePlan` does for N owners, and times, as one peer
does them each round (`demonet/dht/exchange.py`): cutting and encoding its N parts (entropy-coded
indices, as parts travel, in one `wire.encode_many`), decoding the N parts of the slice it owns, merging
them (the coordinator's merge rules: top-k, median-norm clipping), and decoding the N-1 merged slices it
fetches. Medians over --reps, in milliseconds, one torch thread. What a DHT round costs beyond these is waiting (see
`bench/dht_round.py` and its phases). Run from the repo root: `python bench/dht_exchange_cpu.py`.
Prints a table; not a test. `--smoke`: 4 peers, 2 reps: checks that it runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any


def _ms(f: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(peers: int, reps: int, config: str | None) -> dict[str, float]:
    import torch

    from demonet import wire
    from demonet.config import load_config
    from demonet.dht.options import DhtOptions
    from demonet.dht.rules import SlicePlan
    from demonet.train.trainer import Trainer
    from demonet.wire.merge import decode_contribution, merge

    torch.set_num_threads(1)
    cfg = load_config(config, {}, {})
    payloads = []
    for i in range(peers):
        trainer = Trainer.for_run(cfg, data_seed=i, device=torch.device("cpu"))
        payloads.append(trainer.train_step()[1])
    specs = dict(trainer.opt.param_specs())
    rules = DhtOptions(run="bench", token="t").rules
    plan = SlicePlan(specs, peers)
    mine = plan.slice_specs(0)
    parts = [wire.encode(plan.cut(p, 0), step=1, index_coding="entropy") for p in payloads]
    decoded = [decode_contribution(d, expected=mine, rules=rules)[1] for d in parts]
    merged = merge(decoded, step=1, rules=rules, expected=mine)
    out = {
        "encode_parts": _ms(lambda: wire.encode_many([plan.cut(payloads[0], s) for s in range(plan.n)], step=1,
                                                     index_coding="entropy"), reps),
        "decode_parts": _ms(lambda: [decode_contribution(d, expected=mine, rules=rules) for d in parts], reps),
        "merge": _ms(lambda: merge(decoded, step=1, rules=rules, expected=mine), reps),
        "decode_merged": (plan.n - 1) * _ms(lambda: wire.decode(merged.data, expected=mine), reps),
    }
    out["total"] = sum(out.values())
    out["part_bytes"] = sum(map(len, parts)) / len(parts)
    out["slice_bytes"] = len(merged.data)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers-list", default="4,8", help="peer counts, comma-separated (4,8)")
    parser.add_argument("--reps", type=int, default=40, help="timings per figure; the median is printed (40)")
    parser.add_argument("--config", help="TOML run config (default: the embedded default model)")
    parser.add_argument("--smoke", action="store_true", help="4 peers, 2 reps: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.peers_list, args.reps = "4", 2
    print("| peers | encode N parts ms | decode N parts of its slice ms | merge ms | decode N-1 merged slices ms "
          "| total ms | part B | merged slice B |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.peers_list.split(",") if x.strip()):
        f = measure(n, args.reps, args.config)
        print(f"| {n} | {f['encode_parts']:.2f} | {f['decode_parts']:.2f} | {f['merge']:.2f} | "
              f"{f['decode_merged']:.2f} | {f['total']:.2f} | {f['part_bytes']:,.0f} | {f['slice_bytes']:,} |")


if __name__ == "__main__":
    main()
