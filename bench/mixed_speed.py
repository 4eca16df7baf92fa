"""Benchmark: a swarm whose peers differ in speed, on loopback (docs/coordinator.md#mixed-speed-peers), in coordinator
mode or, with --dht, in DHT mode (docs/dht.md#mixed-speed-peers).

Four peers train the example CNN (`examples/custom_task.py`); each micro-batch's loss sleeps a peer's time, as
a slower or faster accelerator would (--sleeps-s, default 0.25,0.25,0.25,1.0: one peer 4x slower). The systems
run one after the other, each a real coordinator and peer processes (with --dht: `demonet peer --dht` processes on
a hivemind DHT, no coordinator):

- `lockstep`: `[net] lockstep = true`, every peer trains one micro-batch a round; rounds wait for the slowest;
- `automatic`: nothing set (the default): the round length follows the peers' reports; here the slow peer is
  slow by its compute, so its micro-batch spans rounds and the rounds keep the fast peers' pace: in coordinator
  mode its payloads enter later rounds; in DHT mode (no late payloads) it is in every round, its micro-batch
  running across them on a copy of the parameters (with `--overlap 1` the rounds cover its micro-batch
  instead); the merge weights each payload by its samples;
- `fixed`: `[net] round_s = --round-s`, otherwise as `automatic`;
- `fast-only`: the three fast peers alone, nothing set (alike: lockstep).

It prints, for each, the rounds per second, the samples computed and applied per second (the samples of the
payloads in the rounds' aggregates over the wall-clock time of those rounds), the time to the target loss (the
fast peers' alone at their end, each averaged over 8 rounds), the oldest gradient sent (rounds), each peer's
median micro-batches a round and its rounds in, and the final loss; then the ratios the goals are stated in:
- automatic and fixed samples/s against the goal's rate: the three fast peers' own rate (fast-only's, measured
  in the same run) plus the slow peer's own (one micro-batch per its sleep) (goal >= 0.95x); and, stricter,
  against the ideal of every peer busy with no exchange at all (one micro-batch per its sleep each); lockstep
  against the three fast alone (what adding the slow peer costs in lockstep);
- automatic and fixed samples/s against the three fast alone.
Rounds before --skip are left out (first-call costs). Run from the repo root: `python bench/mixed_speed.py`
(`--dht` for DHT mode; `--overlap 1`: every system overlapped; `--systems`: some of them). `--smoke`: short
sleeps and 4 rounds, a check that the script runs.
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

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "mixed-speed-bench"
GOAL_IDEAL = 0.95
WINDOW = 8
"""Rounds the loss is averaged over for the time to the target loss (one round's training loss is noisy)."""


def task(**table: Any) -> Any:
    """The example CNN, whose loss sleeps DEMONET_BENCH_SLEEP_S per micro-batch in the process that sets it."""
    import demonet
    from examples.custom_task import task as cnn

    t = cnn(**table)
    sleep_s = float(os.environ.get("DEMONET_BENCH_SLEEP_S", "0"))

    def loss(model: Any, batch: Any) -> Any:
        time.sleep(sleep_s)
        return t.loss(model, batch)

    return demonet.Task(model=t.model, batches=t.batches, loss=loss)


def _config(round_s: float | None, max_micro: int, overlap: int = 0) -> str:
    """The run's config: `round_s` None is lockstep, 0 the automatic length."""
    pace = "lockstep = true" if round_s is None else f"round_s = {round_s}"
    return "\n".join(["[optim]", "lr = 0.03", "[task]", "batch_size = 16", "[net]", "round_timeout_s = 60.0",
                      pace, f"max_micro_batches = {max_micro}", "heartbeat_timeout_s = 60.0",
                      f"overlap = {overlap}"]) + "\n"


def _coordinator(tmp: Path, steps: int, peers: int, env: dict[str, str], procs: list[subprocess.Popen[bytes]]
                 ) -> list[str]:
    """Start the run's coordinator; returns the `demonet peer` flags that reach it."""
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "demonet", "coordinator", "--listen", "127.0.0.1:0", "--config",
         str(tmp / "run.toml"), "--task", "mixed_speed:task", "--steps", str(steps), "--start-peers",
         str(peers)], stdout=subprocess.PIPE, stderr=open(tmp / "coordinator.log", "wb"), env=env, cwd=ROOT,
        start_new_session=True)
    procs.append(coordinator)
    assert coordinator.stdout is not None
    line = coordinator.stdout.readline().decode()
    if not line.startswith("listening on"):
        raise SystemExit(f"the coordinator did not start: {line!r}\n{(tmp / 'coordinator.log').read_text()}")
    return ["--coordinator", line.split()[-1]]


def _dht_flags(tmp: Path, steps: int, peers: int) -> list[str]:
    """The `demonet peer` flags of a DHT peer of the run (the first one's multiaddr added for the others)."""
    return ["--dht", "--run", "mixed-speed", "--host-maddr", "/ip4/127.0.0.1/tcp/0", "--config", str(tmp / "run.toml"),
            "--task", "mixed_speed:task", "--steps", str(steps), "--start-peers", str(peers)]


def _first_maddr(log: Path, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> str:
    """The multiaddr the first DHT peer prints once its node runs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("dht listening on "):
                return line.removeprefix("dht listening on ").strip()
        time.sleep(0.2)
    raise SystemExit(f"the first DHT peer did not start:\n{log.read_text(errors='replace')[-3000:]}")


def run(sleeps: list[float], round_s: float | None, steps: int, max_micro: int, tmp: Path, dht: bool = False,
        overlap: int = 0) -> dict[str, list[dict[str, Any]]]:
    """One swarm: a coordinator and a peer per sleep (`dht`: a DHT peer per sleep); returns each peer's metrics rows."""
    (tmp / "run.toml").write_text(_config(round_s, max_micro, overlap))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'bench'}", "DEMONET_TOKEN": TOKEN,
           "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    out = tmp / "out"
    try:
        reach = _dht_flags(tmp, steps, len(sleeps)) if dht else _coordinator(tmp, steps, len(sleeps), env, procs)
        peers = []
        for i, sleep_s in enumerate(sleeps):
            log = open(tmp / f"peer-{i}.log", "wb")
            peers.append(subprocess.Popen(
                [sys.executable, "-m", "demonet", "peer", *reach, "--peer-id", f"peer-{i}",
                 "--out", str(out), "--threads", "1", "--checkpoint-every", "0"], stdin=subprocess.DEVNULL,
                stdout=log, stderr=log, env={**env, "DEMONET_BENCH_SLEEP_S": str(sleep_s)}, cwd=ROOT,
                start_new_session=True))
            procs.append(peers[-1])
            if dht and i == 0:  # the others find the DHT through the first one
                reach = [*reach, "--initial-peers", _first_maddr(tmp / "peer-0.log", peers[0])]
        for i, proc in enumerate(peers):
            if proc.wait(timeout=600) != 0:
                raise SystemExit(f"peer-{i} failed:\n{(tmp / f'peer-{i}.log').read_text()[-3000:]}")
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return {f"peer-{i}": [json.loads(x) for x in (out / f"metrics-peer-{i}.jsonl").read_text().splitlines() if x]
            for i in range(len(sleeps))}


def summarize(rows: dict[str, list[dict[str, Any]]], skip: int) -> dict[str, Any]:
    """Rounds/s and samples/s over the rounds from `skip` on (wall-clock between the rows of round skip - 1
    and the last round, the latest peer's), the median micro-batches per peer, the final loss, and the loss
    against the time since round skip - 1 (`curve`: each round's mean training loss over its rows).

    A peer writes a row for each round its payload was in (a spanning peer: the rounds its payloads entered),
    so the samples applied are those of every row of a round that was not aborted."""
    by_round: dict[int, list[dict[str, Any]]] = {}
    for peer_rows in rows.values():
        for r in peer_rows:
            by_round.setdefault(r["round"], []).append(r)
    rounds = sorted(n for n in by_round if n >= skip)
    start = max(r["time"] for r in by_round[skip - 1])
    end = max(r["time"] for r in by_round[rounds[-1]])
    applied = [r for n in rounds for r in by_round[n] if not r["aborted"]]
    incomplete = sum(1 for n in rounds if any(r["contributors"] < len(rows) for r in by_round[n]))
    stale = [r["phases"].get("stale_rounds", 0) for rs in rows.values() for r in rs if r["round"] >= skip]
    return {"rounds_per_s": len(rounds) / (end - start),
            "samples_per_s": sum(r["samples"] for r in applied) / (end - start),
            "micro": {p: statistics.median(r["micro_batches"] for r in rs if r["round"] >= skip)
                      for p, rs in rows.items()},
            "rows": {p: sum(1 for r in rs if r["round"] >= skip) for p, rs in rows.items()},
            "stale_max": max(stale, default=0),
            "loss": statistics.fmean(r["loss"] for r in by_round[rounds[-1]]), "incomplete_rounds": incomplete,
            "curve": [(max(r["time"] for r in by_round[n]) - start, statistics.fmean(r["loss"] for r in by_round[n]))
                      for n in rounds],
            "digests_agree": all(len({r["param_digest"] for r in by_round[n]}) == 1 for n in rounds)}


def time_to(curve: list[tuple[float, float]], target: float, window: int = WINDOW) -> float | None:
    """The first time the mean loss of the last `window` rounds is at or below `target`; None: never."""
    for i in range(window - 1, len(curve)):
        if statistics.fmean(loss for _, loss in curve[i - window + 1 : i + 1]) <= target:
            return curve[i][0]
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sleeps-s", default="0.25,0.25,0.25,1.0", help="seconds each peer's micro-batch sleeps")
    parser.add_argument("--round-s", type=float, default=2.2, help="the fixed system's [net] round_s")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=2, help="rounds left out at the start")
    parser.add_argument("--max-micro-batches", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="short sleeps and 4 rounds: a check that it runs")
    parser.add_argument("--dht", action="store_true", help="DHT mode: peers on a hivemind DHT, no coordinator")
    parser.add_argument("--overlap", type=int, default=0, choices=(0, 1), help="[net] overlap of every system")
    parser.add_argument("--systems", default="fast-only,lockstep,automatic,fixed",
                        help="comma-separated, of fast-only,lockstep,automatic,fixed (fast-only is always run)")
    args = parser.parse_args()
    if args.smoke:
        args.sleeps_s, args.round_s, args.steps, args.skip = "0.02,0.02,0.02,0.08", 0.4, 10, 1
    sleeps = [float(x) for x in args.sleeps_s.split(",")]
    slow = max(sleeps)
    fast = [s for s in sleeps if s < slow] or sleeps[:-1]
    batch = 16
    systems: dict[str, tuple[list[float], float | None]] = {"fast-only": (fast, 0.0), "lockstep": (sleeps, None)}
    systems["automatic"] = (sleeps, 0.0)
    systems["fixed"] = (sleeps, args.round_s)
    wanted = {"fast-only", *args.systems.split(",")}
    if not wanted <= set(systems):
        parser.error(f"--systems should name some of {', '.join(systems)}, got {args.systems}")
    systems = {name: s for name, s in systems.items() if name in wanted}
    results = {}
    for name, (peer_sleeps, round_s) in systems.items():
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            results[name] = summarize(run(peer_sleeps, round_s, args.steps, args.max_micro_batches, Path(tmp),
                                          dht=args.dht, overlap=args.overlap), args.skip)
            results[name]["wall_s"] = time.perf_counter() - t0
    ideal = batch * sum(1.0 / s for s in sleeps)  # every peer busy, one micro-batch per its sleep, no exchange
    fast_alone = results["fast-only"]["samples_per_s"]
    slow_own = ideal - batch * sum(1.0 / s for s in fast)  # the slow peers' own compute rate
    goal_rate = fast_alone + slow_own  # the goal's rate: the fast peers' own plus the slow ones' own
    print(f"mixed-speed swarm, {'DHT' if args.dht else 'coordinator'} mode: sleeps {sleeps} s a micro-batch of "
          f"{batch}; fixed round_s = {args.round_s} s; "
          f"rounds {args.skip}-{args.steps - 1}")
    fast_curve = results["fast-only"]["curve"]
    target = statistics.fmean(loss for _, loss in fast_curve[-WINDOW:])  # where the fast peers alone end
    print(f"{'system':10} {'rounds/s':>9} {'samples/s':>10} {'loss':>7} {'to target':>10} {'incomplete':>10} "
          f"{'stale':>6} {'digests':>8}  micro-batches a round (median) / rows, per peer")
    for name, r in results.items():
        reached = time_to(r["curve"], target)
        per_peer = " ".join(f"{m:g}/{r['rows'][p]}" for p, m in r["micro"].items())
        to_target = "-" if reached is None else f"{reached:.1f} s"
        print(f"{name:10} {r['rounds_per_s']:9.2f} {r['samples_per_s']:10.1f} {r['loss']:7.3f} "
              f"{to_target:>10} {r['incomplete_rounds']:10d} {r['stale_max']:6d} "
              f"{'agree' if r['digests_agree'] else 'DIFFER':>8}  "
              f"{per_peer}")
    print(f"target loss {target:.4f}: the fast peers' alone, mean of their last {WINDOW} rounds; 'to target': the "
          f"first time the mean of {WINDOW} rounds is at or below it, from round {args.skip - 1}'s end")
    if "lockstep" in results:
        print(f"lockstep / fast-only samples/s: {results['lockstep']['samples_per_s'] / fast_alone:.2f}x "
              "(what adding the slow peer costs in lockstep)")
    for name in ("automatic", "fixed"):
        if name not in results:
            continue
        rate = results[name]["samples_per_s"]
        met = rate / goal_rate >= GOAL_IDEAL
        print(f"{name} / fast-only samples/s: {rate / fast_alone:.2f}x; {name} / (fast-only + the slow peer's own "
              f"{slow_own:.1f}: {goal_rate:.1f} samples/s): {rate / goal_rate:.2f}x (goal >= {GOAL_IDEAL}: "
              f"{'met' if met else 'not met'}); {name} / ideal ({ideal:.1f} samples/s: every peer busy, no exchange "
              f"at all): {rate / ideal:.2f}x")
    return 0 if all(r["digests_agree"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
