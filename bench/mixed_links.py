"""Benchmark: a swarm whose peers differ in their links, coordinator mode (or, with --dht, DHT mode) in the network
lab (docs/coordinator.md#links, docs/dht.md#mixed-speed-peers).

Four peers, each in its own network namespace with a tbf-shaped link to the lab's switch (demonet.lab.netlab):
three at --fast-mbit (100) and one at --slow-mbit (1), each way. They train a 400k-parameter MLP on a synthetic
teacher task, whose payload at compression_topk 128 is about 50 kB; every micro-batch's loss sleeps --sleep-s
(0.25 s), as an accelerator's compute would. Three systems, each a real coordinator and peer processes (with
--dht: `demonet peer --dht` processes, the first one's DHT node the others' initial peer):

- `lockstep`: `[net] lockstep = true`: every round waits for the slow link's upload;
- `automatic`: nothing set (the default): rounds by the clock long enough for the slow peer's round at the full
  k, and each peer's payload sized to its own uplink (`[optim] adaptive_topk`);
- `fast-only`: the three fast peers alone, nothing set.

It prints each system's samples computed and applied per second, and the slow peer's median k and payload bytes;
then automatic against the goal: at least 0.9 x 4/3 of the three fast peers alone. Needs root (network
namespaces). Run from the repo root: `python bench/mixed_links.py` (`--dht`: DHT mode; `--systems`: some of
them). `--smoke`: 4 rounds, short sleeps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from mixed_speed import _first_maddr, summarize  # noqa: E402 - the same figures as the compute benchmark

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "mixed-links-bench"
PORT = 7460
GOAL = 0.9 * 4 / 3


def task(**table: Any) -> Any:
    """A 400k-parameter MLP learning a fixed random teacher's classes; its loss sleeps DEMONET_BENCH_SLEEP_S."""
    import torch

    import demonet

    sleep_s = float(os.environ.get("DEMONET_BENCH_SLEEP_S", "0"))
    batch_size = int(table.get("batch_size", 16))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10))
    teacher = torch.randn(256, 10, generator=torch.Generator().manual_seed(1))

    def batches(seed: int) -> Any:
        g = torch.Generator().manual_seed(seed)
        while True:
            x = torch.randn(batch_size, 256, generator=g)  # (B, 256)
            yield x, (x @ teacher).argmax(dim=1)  # (B,)

    def loss(model: Any, batch: Any) -> Any:
        time.sleep(sleep_s)
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    return demonet.Task(model=model, batches=batches, loss=loss)


def _config(system: str) -> str:
    pace = ["lockstep = true"] if system == "lockstep" else []
    return "\n".join(["[optim]", "lr = 0.01", "compression_topk = 128", "[task]", "batch_size = 16", "[net]",
                      *pace, "round_timeout_s = 60.0", "heartbeat_timeout_s = 60.0"]) + "\n"


def run(system: str, mbits: list[float], sleep_s: float, steps: int, tmp: Path, dht: bool = False
        ) -> dict[str, list[dict[str, Any]]]:
    """One swarm in a fresh lab: the coordinator (`dht`: none) and a peer per link speed; returns each peer's
    metrics rows."""
    from demonet.lab import netlab

    (tmp / "run.toml").write_text(_config(system))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'bench'}", "DEMONET_TOKEN": TOKEN,
           "OMP_NUM_THREADS": "1", "DEMONET_BENCH_SLEEP_S": str(sleep_s)}
    out = tmp / "out"
    procs: list[subprocess.Popen[bytes]] = []
    with netlab.Lab() as lab:
        try:
            if dht:
                reach = ["--dht", "--run", "mixed-links", "--config", str(tmp / "run.toml"), "--task",
                         "mixed_links:task", "--steps", str(steps), "--start-peers", str(len(mbits))]
            else:
                coord = lab.add_host("coord")
                procs.append(coord.popen(
                    [sys.executable, "-m", "demonet", "coordinator", "--listen", f"{coord.addr}:{PORT}", "--config",
                     str(tmp / "run.toml"), "--task", "mixed_links:task", "--steps", str(steps), "--start-peers",
                     str(len(mbits))], stdout=subprocess.PIPE, stderr=open(tmp / "coordinator.log", "wb"), env=env,
                    cwd=ROOT, start_new_session=True))
                assert procs[0].stdout is not None
                line = procs[0].stdout.readline().decode()
                if not line.startswith("listening on"):
                    raise SystemExit(f"the coordinator did not start: {line!r}\n"
                                     f"{(tmp / 'coordinator.log').read_text()}")
                reach = ["--coordinator", f"{coord.addr}:{PORT}"]
            peers = []
            for i, mbit in enumerate(mbits):
                host = lab.add_host(f"peer{i}", mbit=mbit)
                where = ["--host-maddr", f"/ip4/{host.addr}/tcp/0"] if dht else []
                log = open(tmp / f"peer-{i}.log", "wb")
                peers.append(host.popen(
                    [sys.executable, "-m", "demonet", "peer", *reach, *where, "--peer-id", f"peer-{i}", "--out",
                     str(out), "--threads", "1", "--checkpoint-every", "0"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, cwd=ROOT, start_new_session=True))
                procs.append(peers[-1])
                if dht and i == 0:  # the others find the DHT through the first one
                    reach = [*reach, "--initial-peers", _first_maddr(tmp / "peer-0.log", peers[0])]
            for i, proc in enumerate(peers):
                if proc.wait(timeout=900) != 0:
                    raise SystemExit(f"peer-{i} failed:\n{(tmp / f'peer-{i}.log').read_text()[-3000:]}")
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    return {f"peer-{i}": [json.loads(x) for x in (out / f"metrics-peer-{i}.jsonl").read_text().splitlines() if x]
            for i in range(len(mbits))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fast-mbit", type=float, default=100.0)
    parser.add_argument("--slow-mbit", type=float, default=1.0)
    parser.add_argument("--sleep-s", type=float, default=0.25, help="seconds every peer's micro-batch sleeps")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--skip", type=int, default=3, help="rounds left out at the start")
    parser.add_argument("--smoke", action="store_true", help="4 rounds, short sleeps: a check that it runs")
    parser.add_argument("--keep", type=Path, help="keep each system's logs and metrics rows under this folder")
    parser.add_argument("--dht", action="store_true", help="DHT mode: peers on a hivemind DHT, no coordinator")
    parser.add_argument("--systems", default="lockstep,automatic,fast-only",
                        help="which systems to run, comma-separated (the ratios need fast-only)")
    args = parser.parse_args()
    from demonet.lab import netlab

    ok, why = netlab.available()
    if not ok:
        print(f"smoke: skipped, {why}" if args.smoke else f"needs network namespaces: {why}")
        return 0 if args.smoke else 1
    if args.smoke:
        args.sleep_s, args.steps, args.skip = 0.02, 4, 1
    mbits = [args.fast_mbit] * 3 + [args.slow_mbit]
    every = {"lockstep": mbits, "automatic": mbits, "fast-only": mbits[:3]}
    chosen = args.systems.split(",")
    if not set(chosen) <= set(every):
        parser.error(f"--systems: choose among {', '.join(every)}")
    systems = {name: every[name] for name in chosen}
    results, slow = {}, {}
    for name, peer_mbits in systems.items():
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) if args.keep is None else args.keep / name
            folder.mkdir(parents=True, exist_ok=True)
            rows = run(name, peer_mbits, args.sleep_s, args.steps, folder, dht=args.dht)
        results[name] = summarize(rows, args.skip)
        if "peer-3" in rows:
            later = [r for r in rows["peer-3"] if r["round"] >= args.skip]
            slow[name] = (statistics.median(r["topk"] for r in later), statistics.median(r["bytes_up"] for r in later))
    print(f"mixed-link swarm, {'DHT' if args.dht else 'coordinator'} mode: three peers at {args.fast_mbit:g} "
          f"Mbit/s, one at {args.slow_mbit:g} Mbit/s, every "
          f"micro-batch {args.sleep_s} s; rounds {args.skip}-{args.steps - 1}")
    print(f"{'system':10} {'rounds/s':>9} {'samples/s':>10} {'loss':>7} {'digests':>8} {'slow k':>7} {'slow B':>8}  "
          "micro-batches a round (median, per peer)")
    for name, r in results.items():
        k, size = slow.get(name, (0, 0))
        print(f"{name:10} {r['rounds_per_s']:9.2f} {r['samples_per_s']:10.1f} {r['loss']:7.3f} "
              f"{'agree' if r['digests_agree'] else 'DIFFER':>8} {k:7g} {size:8g}  "
              f"{' '.join(f'{m:g}' for m in r['micro'].values())}")
    fast_alone = results["fast-only"]["samples_per_s"] if "fast-only" in results else None
    for name in [n for n in ("lockstep", "automatic") if n in results and fast_alone]:
        ratio = results[name]["samples_per_s"] / fast_alone
        print(f"{name} / fast-only samples/s: {ratio:.2f}x (goal for automatic >= {GOAL:.2f}x: "
              f"{'met' if ratio >= GOAL else 'not met'})")
    return 0 if all(r["digests_agree"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
