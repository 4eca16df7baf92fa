"""Benchmark: round overhead and bytes of coordinator mode, with `demonet up` on loopback.

For N in --peers-list (2, 4, 8) it runs `demonet up --peers N --steps S --out <tmp> --no-progress`
(a coordinator with --state-dir and N peer processes over gRPC; the default embedded model unless
--config), reads `<tmp>/metrics.jsonl` and prints per N:
- the median round time (a peer's round_time_s: train, submit, wait for the aggregate, apply) and the
  median compute time (compute_s: the blocking torch work of the round, train_step + finish_round),
  and their ratio, the round overhead;
- bytes up and down per peer per round (means) and their ratio;
- whether every round's parameter digests agreed across the peers.
Round 0 is left out of the medians (first-call costs). Then the goals, met or not:
- round time <= 1.05x compute at 4 peers;
- bytes down <= 1.5x bytes up at 2, 4 and 8 peers.
With `--baseline DIR` (a checkout of another commit, e.g. `git worktree add /tmp/base REV`) every
run is made twice, back to back, once on DIR's code and once on this tree's, and a last table
compares the two side by side (same machine, same minute). The second of two runs back to back tends to
come out a little ahead on a shared machine, so `--pairs K` makes K such pairs for each N, the baseline
first in the odd ones and this tree first in the even ones, and prints each pair and the medians of
the K ratios, with each run's round and slowest compute seconds: a ratio can fall because the compute
grew while the rounds stayed as long (the first pair's rows fill the tables above). With `--own-cores`
each process runs on a CPU of its own (peer-i on the i-th CPU it may use, the coordinator on the next;
it needs N + 1), as on a machine each, so that the overhead is not the CPU that the processes take from
each other.
Run from the repo root: `python bench/round_overhead.py`. Prints a table; not a test. `--smoke`: one peer, 3
rounds, a check that the script runs (it exits 1 when a run fails).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

GOAL_OVERHEAD = 1.05
GOAL_OVERHEAD_PEERS = 4
GOAL_BYTES = 1.5


def run_up(peers: int, steps: int, config: str | None, out: Path, dht: bool = False,
           code: Path | None = None, env: dict[str, str] | None = None,
           coordinator_cpu: int | None = None, coordinator_share: float | None = None,
           up_args: tuple[str, ...] = (), own_cores: bool = False) -> tuple[int, float, str]:
    """`demonet up [--dht]` with N peers (on the demonet in `code`, default this tree; `env`: more
    variables, e.g. DEMONET_NET_* settings); returns (exit code, wall seconds, the tail of its stderr).
    `coordinator_cpu`: the coordinator alone on that CPU and every other process on the others, as if it
    ran on a machine of its own (Linux affinity). `coordinator_share`: the coordinator held to this
    fraction of one CPU (a cgroup's CPU quota; root), a coordinator slower than its peers. `up_args`: more
    `demonet up` flags. `own_cores`: each process a CPU of its own (`_own_cores`), as on a machine each."""
    if own_cores and not fits_own_cores(peers, dht):
        raise SystemExit(f"--own-cores: {peers} peers{'' if dht else ' and the coordinator'} need "
                         f"{peers + (0 if dht else 1)} CPUs; this process may run on {len(_cpus())}")
    cmd = [sys.executable, "-m", "demonet", "up", "--peers", str(peers), "--steps", str(steps), "--out",
           str(out), "--no-progress", *(["--dht"] if dht else []), *up_args]
    if config:
        cmd += ["--config", config]
    root = (code or Path(__file__).resolve().parent.parent).resolve()
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)  # this tree first
    env = {**os.environ, **(env or {}), "PYTHONPATH": path}
    others = None if coordinator_cpu is None else os.sched_getaffinity(0) - {coordinator_cpu}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root,
                            preexec_fn=None if others is None else lambda: os.sched_setaffinity(0, others))
    with contextlib.ExitStack() as stack:
        if coordinator_cpu is not None:
            _pin_coordinator(proc.pid, coordinator_cpu)
        if own_cores:
            _own_cores(proc.pid, peers)
        if coordinator_share is not None:
            stack.enter_context(_limited_coordinator(proc.pid, coordinator_share))
        _, stderr = proc.communicate()
    return proc.returncode, time.perf_counter() - start, stderr[-2000:]


def _coordinator_pid(up_pid: int) -> int | None:
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{up_pid}/task/{up_pid}/children").read_text().split():
            if b"demonet coordinator" in Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" "):
                return int(child)
    return None


@contextlib.contextmanager
def _limited_coordinator(up_pid: int, share: float) -> Iterator[None]:
    """Hold `demonet up`'s coordinator child to `share` of one CPU: a cgroup with a CPU quota (v2's
    cpu.max, else v1's cpu controller), its threads moved in while the run starts; removed at the end."""
    name, period = f"demonet-bench-{os.getpid()}", 10_000  # a short period: an even pace, not bursts
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    group = Path("/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/cpu") / name
    group.mkdir()
    try:
        if v2:
            (group / "cpu.max").write_text(f"{int(share * period)} {period}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(int(share * period)))
        _each_coordinator_thread(up_pid, (group / ("cgroup.threads" if v2 else "tasks")).write_text)
        yield
    finally:
        pid = _coordinator_pid(up_pid)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task") if pid is not None else ():
                with contextlib.suppress(OSError):  # back to the root group, so that this one can go
                    (group.parent / ("cgroup.threads" if v2 else "tasks")).write_text(task)
        deadline = time.monotonic() + 30
        while group.exists():
            try:
                group.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def _pin_coordinator(up_pid: int, cpu: int) -> None:
    """Move every thread of `demonet up`'s coordinator child to `cpu`, while the run starts (threads it
    makes later inherit the mask of the thread that makes them)."""
    _each_coordinator_thread(up_pid, lambda task: os.sched_setaffinity(int(task), {cpu}))


def _each_coordinator_thread(up_pid: int, move: Any, for_s: float = 15.0) -> None:
    """Call `move(thread id)` on every thread of `demonet up`'s coordinator child, again and again for
    `for_s` while the run starts (a thread that has gone in between is skipped)."""
    deadline = time.monotonic() + for_s
    while time.monotonic() < deadline:
        pid = _coordinator_pid(up_pid)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task") if pid is not None else ():
                with contextlib.suppress(OSError):
                    move(task)
        time.sleep(0.05)


def _cpus() -> list[int]:
    """The CPUs this process may run on, in order (a container's or a cpuset's, not always 0..N-1)."""
    return sorted(os.sched_getaffinity(0))


def fits_own_cores(peers: int, dht: bool) -> bool:
    """Whether there is a CPU for each process of the run: every peer, and the coordinator."""
    return len(_cpus()) >= peers + (0 if dht else 1)


def _own_cores(up_pid: int, peers: int, for_s: float = 15.0) -> None:
    """Each process of `demonet up` on a CPU of its own, again and again for `for_s` while the run starts:
    peer-i and its children (a DHT peer's p2pd) on the i-th CPU this process may run on, the coordinator on
    the next. The launcher itself, which only waits, stays where it is. Threads made later inherit the CPU
    of their maker."""
    import psutil

    cpus, deadline = _cpus(), time.monotonic() + for_s
    while time.monotonic() < deadline:
        for child in psutil.Process(up_pid).children():
            try:
                cmdline = child.cmdline()
                if "coordinator" in cmdline[:4]:
                    cpu = cpus[peers]
                elif "--peer-id" in cmdline:
                    cpu = cpus[int(cmdline[cmdline.index("--peer-id") + 1].rsplit("-", 1)[1])]
                else:
                    continue
                for proc in (child, *child.children(recursive=True)):
                    for thread in proc.threads():
                        with contextlib.suppress(OSError):
                            os.sched_setaffinity(thread.id, {cpu})
            except (psutil.Error, ValueError, IndexError):  # gone meanwhile, or not yet named
                continue
        time.sleep(0.05)


COORDINATOR_PHASES = ("encode", "submit", "wait", "download", "decode", "digest", "check")
"""A coordinator-mode round's exchange, as its peers' rows break it down (`GrpcClient.gather`)."""


def phase_means(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The mean of each phase over the rows that have phases (round 0 left out; a phase a row lacks is 0 there)."""
    phased = [r["phases"] for r in rows if r["round"] > 0 and r.get("phases")]
    names = dict.fromkeys(k for p in phased for k in p)
    return {k: statistics.fmean(p.get(k, 0.0) for p in phased) for k in names}


def print_phases(title: str, names: tuple[str, ...], results: dict[Any, dict[str, Any]]) -> None:
    """A table of the phases' means (seconds per peer and round) by result key."""
    print()
    print(f"## {title} (mean seconds per peer and round, from the rows' phases)")
    print("| run | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for key, m in results.items():
        if m.get("phases"):
            label = " ".join(map(str, key)) if isinstance(key, tuple) else f"{key} peers"
            print(f"| {label} | " + " | ".join(f"{m['phases'].get(k, 0.0):.4f}" for k in names) + " |")


def measure(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of round and compute time (round 0 left out), bytes per peer per round, digests."""
    timed = [r for r in rows if r["round"] > 0] or rows
    by_round: dict[int, set[str]] = {}
    for r in rows:
        by_round.setdefault(int(r["round"]), set()).add(str(r["param_digest"]))
    round_s = statistics.median(float(r["round_time_s"]) for r in timed)
    compute_s = statistics.median(float(r["compute_s"]) for r in timed)
    # A synchronous round cannot end before its slowest peer has computed: that is the round's
    # compute-only time. The ratio to the median peer's compute also counts waiting for the slowest.
    slowest: dict[int, float] = {}
    for r in timed:
        slowest[int(r["round"])] = max(slowest.get(int(r["round"]), 0.0), float(r["compute_s"]))
    slowest_s = statistics.median(slowest.values())
    up = statistics.fmean(float(r["bytes_up"]) for r in rows)
    down = statistics.fmean(float(r["bytes_down"]) for r in rows)
    return {"rounds": len(by_round), "round_s": round_s, "compute_s": compute_s, "overhead": round_s / compute_s,
            "slowest_s": slowest_s, "overhead_slowest": round_s / slowest_s,
            "up": up, "down": down, "down_up": down / up, "agree": all(len(d) == 1 for d in by_round.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers-list", default="2,4,8", help="peer counts, comma-separated (2,4,8)")
    parser.add_argument("--steps", type=int, default=30, help="rounds per run (30)")
    parser.add_argument("--config", help="TOML run config (default: the embedded default model)")
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit: run it too, side by side")
    parser.add_argument("--pairs", type=int, default=1, help="with --baseline: pairs of runs for each N, in "
                        "alternating order (1)")
    parser.add_argument("--coordinator-cpu", type=int, help="the coordinator alone on this CPU, the peers on the "
                        "others: as on a machine of its own (Linux)")
    parser.add_argument("--coordinator-share", type=float, help="the coordinator held to this fraction of one "
                        "CPU (a cgroup's CPU quota; Linux, root): a coordinator slower than its peers, as a CPU "
                        "coordinator of GPU peers is")
    parser.add_argument("--own-cores", action="store_true", help="each process on a CPU of its own (peer-i on CPU "
                        "i, the coordinator on the next; Linux): as on a machine each; needs N + 1 CPUs")
    parser.add_argument("--state-every-s", type=float, help="this tree's coordinator writes its state at most "
                        "this often (`demonet up --state-every-s`; not passed to --baseline, whose code may lack it)")
    parser.add_argument("--smoke", action="store_true", help="one peer, 3 rounds: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.peers_list, args.steps = "1", 3
    mine = () if args.state_every_s is None else ("--state-every-s", str(args.state_every_s))
    counts = [int(n) for n in args.peers_list.split(",") if n.strip()]
    if args.own_cores and not all(fits_own_cores(n, dht=False) for n in counts):
        parser.error(f"--own-cores: {max(counts)} peers and the coordinator need {max(counts) + 1} CPUs; this "
                     f"process may run on {len(_cpus())}")
    if args.pairs < 1 or (args.pairs > 1 and args.baseline is None):
        parser.error("--pairs should be >= 1, and more than 1 only with --baseline")
    if args.own_cores and args.coordinator_cpu is not None:
        parser.error("--own-cores places the coordinator itself; leave out --coordinator-cpu")

    import torch

    cores = os.cpu_count()
    print(f"# demonet round overhead: `demonet up`, {args.steps} rounds, "
          f"{'config ' + args.config if args.config else 'the embedded default model'} (torch {torch.__version__})")
    if args.own_cores:
        print("# Each peer and the coordinator on a CPU of its own, one torch thread per peer,")
    elif args.coordinator_cpu is None:
        print(f"# All N peers and the coordinator share this machine's {cores} cores, one torch thread per peer,")
    else:
        print(f"# The coordinator alone on CPU {args.coordinator_cpu}, the N peers on the other {cores - 1}, one torch "
              "thread per peer,")
    if args.state_every_s is not None:
        print(f"# This tree's coordinator writes its state at most every {args.state_every_s:g} s.")
    if args.coordinator_share is not None:
        print(f"# The coordinator held to {args.coordinator_share:g} of one CPU (a cgroup's CPU quota).")
    print("# so compute_s itself grows with N once N exceeds the cores; round 0 is left out of the medians.")
    print()
    print("| peers | rounds | round s (median) | compute s (median) | round / compute | slowest peer's compute s "
          "| round / slowest compute | up B/peer/round "
          "| down B/peer/round | down / up | digests agree | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    results: dict[int, dict[str, Any]] = {}
    baseline: dict[int, dict[str, Any]] = {}
    pairs: dict[int, list[tuple[dict[str, Any], dict[str, Any]]]] = {}  # N -> (baseline, this tree) of each pair
    failed = False
    with tempfile.TemporaryDirectory(prefix="round_overhead-") as tmp:
        for n in counts:
            for k in range(args.pairs):
                got: dict[bool, dict[str, Any]] = {}
                for ours in ((False, True) if k % 2 == 0 else (True, False)) if args.baseline is not None else (True,):
                    out = Path(tmp) / f"{'peers' if ours else 'baseline'}-{n}-{k}"
                    code, wall, err = run_up(n, args.steps, args.config, out, code=None if ours else args.baseline,
                                             coordinator_cpu=args.coordinator_cpu,
                                             coordinator_share=args.coordinator_share,
                                             up_args=mine if ours else (), own_cores=args.own_cores)
                    metrics = out / "metrics.jsonl"
                    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
                    if code != 0 or not rows:
                        failed = True
                        if ours:
                            print(f"| {n} | demonet up exited with {code}, {len(rows)} metrics rows | | | | | | | "
                                  f"| {wall:.0f} |")
                        print(err, file=sys.stderr)
                        continue
                    m = got[ours] = measure(rows)
                    m["phases"], m["wall"] = phase_means(rows), wall
                if len(got) == 2:
                    pairs.setdefault(n, []).append((got[False], got[True]))
                if k == 0 and True in got:
                    m = results[n] = got[True]
                    if False in got:
                        baseline[n] = got[False]
                    print(f"| {n} | {m['rounds']} | {m['round_s']:.3f} | {m['compute_s']:.3f} | {m['overhead']:.2f}x "
                          f"| {m['slowest_s']:.3f} | {m['overhead_slowest']:.2f}x "
                          f"| {m['up']:,.0f} | {m['down']:,.0f} | {m['down_up']:.2f}x "
                          f"| {'yes' if m['agree'] else 'NO'} | {m['wall']:.0f} |")

    print_phases("where a round's exchange goes: encode, submit, wait for the aggregate's header (the other "
                 "peers, then the close), download, decode, the wait for the canonical digest: right after the "
                 "peer's own apply where it had come by then (digest), else after the next round's backward (check)",
                 COORDINATOR_PHASES, results)

    if args.baseline is not None:
        print()
        print(f"## against {args.baseline} (run just before each row above)")
        print()
        print("| peers | round / slowest compute, baseline | this tree | round s, baseline | this tree "
              "| round s ratio (this / baseline) |")
        print("|---|---|---|---|---|---|")
        for n in counts:
            if n in baseline and n in results:
                b, m = baseline[n], results[n]
                print(f"| {n} | {b['overhead_slowest']:.2f}x | {m['overhead_slowest']:.2f}x | {b['round_s']:.3f} "
                      f"| {m['round_s']:.3f} | {m['round_s'] / b['round_s']:.2f} |")
    if args.pairs > 1:
        print()
        print(f"## {args.pairs} pairs for each N: the baseline first in pairs 1, 3, ..., this tree first in 2, 4, ...")
        print()
        print("| peers | pair | round / slowest compute, baseline | this tree | difference | round s, baseline "
              "| this tree | slowest compute s, baseline | this tree |")
        print("|---|---|---|---|---|---|---|---|---|")
        for n, each in pairs.items():
            for k, (b, m) in enumerate(each, 1):
                print(f"| {n} | {k} | {b['overhead_slowest']:.3f}x | {m['overhead_slowest']:.3f}x "
                      f"| {m['overhead_slowest'] - b['overhead_slowest']:+.3f} | {b['round_s']:.3f} "
                      f"| {m['round_s']:.3f} | {b['slowest_s']:.3f} | {m['slowest_s']:.3f} |")
            med = {(key, side): statistics.median(pair[side][key] for pair in each)
                   for key in ("overhead_slowest", "round_s", "slowest_s") for side in (0, 1)}
            print(f"| {n} | median of {len(each)} | {med['overhead_slowest', 0]:.3f}x "
                  f"| {med['overhead_slowest', 1]:.3f}x "
                  f"| {statistics.median(m['overhead_slowest'] - b['overhead_slowest'] for b, m in each):+.3f} "
                  f"| {med['round_s', 0]:.3f} | {med['round_s', 1]:.3f} | {med['slowest_s', 0]:.3f} "
                  f"| {med['slowest_s', 1]:.3f} |")
    print()
    print("## goals")
    if GOAL_OVERHEAD_PEERS in results:
        for key, what in (("overhead_slowest", "the slowest peer's compute (the round's compute-only time)"),
                          ("overhead", "the median peer's compute")):
            ratio = results[GOAL_OVERHEAD_PEERS][key]
            verdict = "met" if ratio <= GOAL_OVERHEAD else "NOT met"
            print(f"round time <= {GOAL_OVERHEAD}x {what} at {GOAL_OVERHEAD_PEERS} peers: {verdict} ({ratio:.2f}x)")
    else:
        print(f"round time <= {GOAL_OVERHEAD}x compute at {GOAL_OVERHEAD_PEERS} peers: NOT met (not measured)")
    want = [2, 4, 8]
    ratios = {n: results[n]["down_up"] for n in want if n in results}
    missing = [n for n in want if n not in results]
    met = not missing and all(r <= GOAL_BYTES for r in ratios.values())
    detail = ", ".join(f"{n}: {r:.2f}x" for n, r in ratios.items())
    if missing:
        detail += f"{'; ' if detail else ''}not measured at {', '.join(map(str, missing))}"
    print(f"bytes down <= {GOAL_BYTES}x bytes up at 2, 4, 8 peers: {'met' if met else 'NOT met'} ({detail})")
    if not all(m["agree"] for m in results.values()):
        print("digests: some round's peers disagreed (see the table)")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
