"""Benchmark: DHT mode next to coordinator mode, with `demonet up` and `demonet up --dht` on loopback.

For N in --peers-list (2, 4, 8), one after the other in the same run, it runs `demonet up --peers N
--steps S` (a coordinator and N peers over gRPC) and `demonet up --dht --peers N --steps S` (N peers
on a hivemind DHT, payload slices over libp2p streams, no coordinator), and prints per mode and N
the median round time, the median slowest peer's compute per round, their ratio (the round
overhead), the bytes up and down per peer per round and their ratio, and whether every round's
digests agreed (`bench/round_overhead.py` measures the same way; round 0 is left out). DHT mode runs
once per `--verify` fraction (`[net] verify_slices`: 0 is off, 0.25 the default, 1 every slice merged
by a second owner), so the cost of verified slices is measured in the same run. With --baseline DIR
(a checkout of another commit), every run is made on that code too, right after the same run on this
tree. With --own-cores each process runs on a CPU of its own (peer-i and its p2pd on the i-th CPU it may use, the
coordinator on the next), as on a machine each; a mode whose processes outnumber the CPUs is not run. Goals:
- DHT mode: per-peer download at most 2x upload at 8 peers;
- DHT mode's round overhead comparable to coordinator mode's (the ratio of the two is printed).
Run from the repo root: `python bench/dht_round.py`. Prints a table; not a test. `--smoke`: 2 peers, 3 rounds,
a check that the script runs (it exits 1 when a run fails).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_overhead import COORDINATOR_PHASES, fits_own_cores, measure, phase_means, print_phases, run_up  # noqa: E402  (a sibling script, not a package)

GOAL_DOWN_UP = 2.0
GOAL_PEERS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers-list", default="2,4,8", help="peer counts, comma-separated (2,4,8)")
    parser.add_argument("--steps", type=int, default=30, help="rounds per run (30)")
    parser.add_argument("--config", help="TOML run config (default: the embedded default model)")
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit: each run on it too, right "
                        "after the same run on this tree")
    parser.add_argument("--verify", default="0.25", help="DHT runs' verify_slices fractions, comma-separated "
                        "(0.25, the default; e.g. 0,0.25,1 for the cost of verification)")
    parser.add_argument("--own-cores", action="store_true", help="each process on a CPU of its own (peer-i and "
                        "its p2pd on the i-th CPU, the coordinator on the next; Linux): as on a machine each; a mode "
                        "with more processes than CPUs is not run")
    parser.add_argument("--smoke", action="store_true", help="2 peers, 3 rounds: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.peers_list, args.steps = "2", 3
    counts = [int(n) for n in args.peers_list.split(",") if n.strip()]
    fractions = [float(f) for f in args.verify.split(",") if f.strip()]
    modes = [("coordinator", None)] + [(f"dht verify={f:g}", f) for f in fractions]
    codes: list[tuple[str, Path | None]] = [("", None)] + ([(" (baseline)", args.baseline)] if args.baseline else [])

    import torch

    print(f"# DHT mode vs coordinator mode: `demonet up [--dht]`, {args.steps} rounds, "
          f"{'config ' + args.config if args.config else 'the embedded default model'} (torch {torch.__version__})")
    where = "each on a CPU of its own" if args.own_cores else f"sharing this machine's {os.cpu_count()} cores"
    print(f"# Peers {where}, one torch thread each; the modes alternate per N.")
    print()
    print("| mode | peers | round s (median) | slowest compute s | round / compute | up B/peer/round "
          "| down B/peer/round | down / up | digests agree | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    results: dict[tuple[str, int], dict[str, Any]] = {}
    failed = False
    with tempfile.TemporaryDirectory(prefix="dht_round-") as tmp:
        for n in counts:
            for (base_mode, fraction), (tag, tree) in ((m, c) for m in modes for c in codes):
                mode = base_mode + tag
                out = Path(tmp) / f"{mode.replace(' ', '-').replace('(', '').replace(')', '')}-{n}"
                env = {} if fraction is None else {"DEMONET_NET_VERIFY_SLICES": str(fraction)}
                if args.own_cores and not fits_own_cores(n, dht=fraction is not None):
                    print(f"| {mode} | {n} | not run: needs a CPU for each process | | | | | | | |")
                    continue
                code, wall, err = run_up(n, args.steps, args.config, out, dht=fraction is not None, env=env,
                                         code=tree, own_cores=args.own_cores)
                metrics = out / "metrics.jsonl"
                rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
                if code != 0 or not rows:
                    failed = True
                    print(f"| {mode} | {n} | exited with {code}, {len(rows)} rows | | | | | | | {wall:.0f} |")
                    print(err, file=sys.stderr)
                    continue
                m = results[(mode, n)] = measure(rows)
                m["phases"] = phase_means(rows)
                print(f"| {mode} | {n} | {m['round_s']:.3f} | {m['slowest_s']:.3f} | {m['overhead_slowest']:.2f}x "
                      f"| {m['up']:,.0f} | {m['down']:,.0f} | {m['down_up']:.2f}x | {'yes' if m['agree'] else 'NO'} "
                      f"| {wall:.0f} |", flush=True)

    dht_names = ("announce", "freeze", "scatter", "gather", "recover", "serve", "dht_reads", "verified")
    print_phases("where a DHT round's time goes (scatter and gather run at once)", dht_names,
                 {key: m for key, m in results.items() if key[0].startswith("dht")})
    print_phases("where a coordinator round's exchange goes", COORDINATOR_PHASES,
                 {key: m for key, m in results.items() if key[0].startswith("coordinator")})

    print()
    print("## goals")
    dht = modes[1][0] if len(modes) > 1 else "dht"
    at = results.get((dht, GOAL_PEERS))
    if at:
        verdict = "met" if at["down_up"] <= GOAL_DOWN_UP else "NOT met"
        print(f"DHT mode: download <= {GOAL_DOWN_UP}x upload per peer at {GOAL_PEERS} peers: {verdict} "
              f"({at['down_up']:.2f}x)")
    else:
        print(f"DHT mode: download <= {GOAL_DOWN_UP}x upload at {GOAL_PEERS} peers: NOT met (not measured)")
    downs = {n: results[(dht, n)]["down"] for n in counts if (dht, n) in results}
    if len(downs) > 1:
        first, last = min(downs), max(downs)
        print(f"DHT mode: per-peer download {downs[first]:,.0f} B at {first} peers, {downs[last]:,.0f} B at {last} "
              f"peers ({downs[last] / downs[first]:.2f}x for {last / first:.0f}x the peers)")
    for n, (tag, _) in ((n, c) for n in counts for c in codes):
        c = results.get(("coordinator" + tag, n))
        for base_mode, _ in modes[1:]:
            mode = base_mode + tag
            d = results.get((mode, n))
            if c and d:
                print(f"round overhead at {n} peers: {mode} {d['overhead_slowest']:.2f}x, coordinator "
                      f"{c['overhead_slowest']:.2f}x (round time DHT / coordinator {d['round_s'] / c['round_s']:.2f}x, "
                      f"bytes up+down DHT / coordinator {(d['up'] + d['down']) / (c['up'] + c['down']):.2f}x)")
    if not all(m["agree"] for m in results.values()):
        print("digests: some round's peers disagreed (see the table)")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
