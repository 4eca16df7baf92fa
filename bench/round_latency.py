"""Benchmark: coordinator-mode rounds over a link with latency, against another commit.

Each run starts the real processes on this machine: `demonet coordinator`, a user-space delay proxy in
front of it (`python -m demonet.lab.netlab proxy`, every chunk held `--delay-ms` in each direction, so a
round trip gains twice that), and N `demonet peer` processes that reach the coordinator through the
proxy. For each one-way delay in --delays-ms, the baseline's code (`--baseline DIR`, a checkout of
another commit, e.g. `git worktree add /tmp/base REV`) and this tree's run back to back, in alternating
order (`--pairs`), and it prints per run the median round time (a peer's round_time_s), the median
compute (compute_s), their difference, and the pairs' medians side by side. The proxy, the launcher and
the measure are this tree's for both; only the coordinator and the peers run the compared code.

Without --baseline only this tree runs. Run from the repo root: `python bench/round_latency.py --baseline
/tmp/base`. Prints a table; not a test. `--smoke`: this tree, 2 peers, 3 rounds behind a 25 ms delay, a check
that the script runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run(code: Path, peers: int, steps: int, delay_ms: float, out: Path) -> list[dict[str, Any]]:
    """One run of `code`'s coordinator and peers behind a proxy of `delay_ms`; returns the metrics rows."""
    env = {**os.environ, "DEMONET_TOKEN": secrets.token_urlsafe(16), "PYTHONPATH": str(code)}
    out.mkdir(parents=True)
    procs: list[subprocess.Popen[str]] = []

    def spawn(argv: list[str], log: str, cwd: Path, **kw: Any) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, *argv], stderr=open(out / log, "w"), text=True, cwd=cwd,  # noqa: SIM115
                                env={**env, "PYTHONPATH": str(cwd)}, **kw)
        procs.append(proc)
        return proc

    try:
        def listening(argv: list[str], log: str, cwd: Path, prefix: str) -> str:
            """Start a server on port 0; its first line says where it listens."""
            proc = spawn(argv, log, cwd, stdout=subprocess.PIPE)
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.startswith(prefix):
                raise SystemExit(f"{argv[1]} did not start: {(out / log).read_text()[-2000:]}")
            return line

        target = listening(["-m", "demonet", "coordinator", "--listen", "127.0.0.1:0", "--steps", str(steps),
                            "--state-dir", str(out / "coordinator"), "--start-peers", str(peers)],
                           "coordinator.log", code, "listening on ").split()[-1]
        line = listening(["-m", "demonet.lab.netlab", "proxy", "--listen", "127.0.0.1:0", "--target", target,
                          "--delay-ms", str(delay_ms)], "proxy.log", ROOT, "proxy listening on ")
        port = line.split()[3].rsplit(":", 1)[1]  # "proxy listening on H:P -> H:P"
        workers = [spawn(["-m", "demonet", "peer", "--coordinator", f"127.0.0.1:{port}", "--peer-id", f"peer-{i}",
                          "--out", str(out), "--threads", "1", "--device", "cpu"], f"peer-{i}.log", code)
                   for i in range(peers)]
        for w in workers:
            if w.wait(timeout=600) != 0:
                raise SystemExit(f"a peer exited with {w.returncode}: {(out / 'peer-0.log').read_text()[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
            if p.poll() is None:
                p.kill()
    return [json.loads(line) for path in sorted(out.glob("metrics-*.jsonl")) for line in path.read_text().splitlines()]


def measure(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Median round time and median compute over the rows after round 0 (first-call costs)."""
    timed = [r for r in rows if r["round"] > 0]
    return (statistics.median(float(r["round_time_s"]) for r in timed),
            statistics.median(float(r["compute_s"]) for r in timed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit (none: this tree only)")
    parser.add_argument("--delays-ms", default="0,25,50", help="one-way delays to add, comma-separated (0,25,50)")
    parser.add_argument("--peers", type=int, default=4, help="peer processes (4)")
    parser.add_argument("--steps", type=int, default=30, help="rounds per run (30)")
    parser.add_argument("--pairs", type=int, default=1, help="pairs of runs per delay, in alternating order (1)")
    parser.add_argument("--smoke", action="store_true", help="this tree, 2 peers, 3 rounds, 25 ms: checks that it "
                        "runs")
    args = parser.parse_args()
    if args.smoke:
        args.baseline, args.delays_ms, args.peers, args.steps, args.pairs = None, "25", 2, 3, 1
    delays = [float(d) for d in args.delays_ms.split(",") if d.strip()]
    if args.pairs < 1 or args.peers < 1 or args.steps < 2 or any(d < 0 for d in delays):
        parser.error("--pairs and --peers should be >= 1, --steps >= 2 and the delays >= 0")
    trees = {"baseline": args.baseline.resolve(), "this tree": ROOT} if args.baseline else {"this tree": ROOT}
    print(f"# coordinator-mode rounds behind a user-space delay proxy: {args.peers} peers, {args.steps} rounds, "
          f"the embedded default model, one torch thread per peer; baseline {trees.get('baseline', 'none')}")
    print()
    print("| one-way delay ms | pair | code | round s (median) | compute s (median) | round - compute s |")
    print("|---|---|---|---|---|---|")
    got: dict[tuple[float, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="round_latency-") as tmp:
        for delay in delays:
            for k in range(args.pairs):
                for name in (trees if k % 2 == 0 else list(trees)[::-1]):
                    rows = run(trees[name], args.peers, args.steps, delay, Path(tmp) / f"{delay}-{k}-{name[:4]}")
                    round_s, compute_s = measure(rows)
                    got.setdefault((delay, name), []).append(round_s)
                    print(f"| {delay:g} | {k + 1} | {name} | {round_s:.3f} | {compute_s:.3f} | "
                          f"{round_s - compute_s:.3f} |", flush=True)
    if args.baseline is None:
        return
    print()
    print("| one-way delay ms | round s, baseline (median of pairs) | this tree | this / baseline |")
    print("|---|---|---|---|")
    for delay in delays:
        b, m = statistics.median(got[(delay, "baseline")]), statistics.median(got[(delay, "this tree")])
        print(f"| {delay:g} | {b:.3f} | {m:.3f} | {m / b:.3f} |")


if __name__ == "__main__":
    main()
