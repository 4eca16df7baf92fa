"""Benchmark: one coordinator against 8 to 64 payload-only clients of the 10.8M-parameter model.

Each client submits a real DeMo payload every round (no model compute) over gRPC on loopback, as a peer does
(`demonet.transport.grpc.GrpcClient`: its own key, the GetAggregate call beside the Submit, the aggregate
downloaded and decoded). Per client count it prints the time from the last Submit's reply to the first
aggregate header a client reads (the close: the merge), the whole round, bytes up/down per client, and the
coordinator's resident memory. Run from the repo root: `python bench/coordinator_scale.py`. Prints a table;
not a test. `--smoke`: 2 and 4 clients, 2 rounds, a check that the script runs.

`--dashboard`: the dashboard's cost, side by side in one run. The coordinator serves its dashboard;
a viewer (another process, as a browser is) loads the page, then polls the whole /status.json every
`--poll-s` seconds during odd rounds and not at all during even ones; it prints the close times of
both kinds of rounds (`--repeat` runs). `--pairs` adds runs with the dashboard off against runs
with it polled throughout, alternating, and what the record costs in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demonet.coordinator.metrics import Metrics  # noqa: E402
from demonet.coordinator.rounds import RoundConfig, Rounds  # noqa: E402
from demonet.coordinator.status import status_document  # noqa: E402
from demonet.optim import DeMo, Payload  # noqa: E402
from demonet.train.model import BENCH_MODEL, GPT  # noqa: E402
from demonet.transport import Digest  # noqa: E402
from demonet.transport.grpc import GrpcClient  # noqa: E402
from demonet.wire.identity import Identity, submit_statement, verify  # noqa: E402

TOKEN = "bench"
CONFIG = f"""
[model]
vocab_size = {BENCH_MODEL.vocab_size}
seq_len = {BENCH_MODEL.seq_len}
d_model = {BENCH_MODEL.d_model}
n_layers = {BENCH_MODEL.n_layers}
n_heads = {BENCH_MODEL.n_heads}
[train]
steps = 1000
[net]
round_timeout_s = 120.0
heartbeat_timeout_s = 300.0
min_peers = {{clients}}
"""


def _payloads(n: int) -> list[Payload]:
    torch.manual_seed(0)
    model = GPT(BENCH_MODEL)
    opt = DeMo(model.named_parameters(), lr=1e-3)
    out = []
    for _ in range(n):
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        out.append(opt.compress())
    return out


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _join(address: str, name: str) -> tuple[GrpcClient, int]:
    """A client joined as `name` with a key of its own; its first round."""
    client = GrpcClient(address, token=TOKEN, peer_id=name, call_timeout_s=60.0)
    return client, (await client.join()).round


async def _client(client: GrpcClient, payload: Payload, rounds: int, first: int, start: asyncio.Barrier,
                  log: dict[int, list[float]], flag: Path | None = None, timed: bool = True) -> tuple[int, int]:
    """One client's rounds; with `flag`, the file exists during odd rounds (the viewer polls then). Logs, per
    round r, when its Submit's reply came (under r) and when the aggregate's header did (under -r - 1).
    `timed`: a round that the coordinator aborted is an error (not for a round before the timed ones)."""
    up = down = 0
    digest = (await client.status()).param_digest
    for r in range(first, first + rounds):
        if flag is not None and r % 2:
            flag.touch()
        elif flag is not None:
            flag.unlink(missing_ok=True)
        await start.wait()
        t0 = time.perf_counter()
        got = await client.gather(r, payload, loss=1.0, param_digest=Digest(digest))
        assert not (timed and got.aborted), f"round {r} aborted"
        replied = t0 + got.phases["encode"] + got.phases["submit"]
        log.setdefault(r, []).append(replied)
        log.setdefault(-r - 1, []).append(replied + got.phases["wait"])
        up, down = up + got.bytes_up, down + got.bytes_down
        digest = await got.canonical_digest()  # once the coordinator has applied the round
    return up, down


VIEWER = """
import os, sys, time, urllib.request
url, poll_s, flag = sys.argv[1], float(sys.argv[2]), sys.argv[3]
for path in ("", "dashboard.js", "dashboard.css"):
    urllib.request.urlopen(url + path, timeout=30).read()
while True:
    if flag and not os.path.exists(flag):
        time.sleep(0.01)
        continue
    size = len(urllib.request.urlopen(url + "status.json", timeout=30).read())
    print(size, flush=True)
    time.sleep(poll_s)
"""
"""An open dashboard, as a process of its own (as a browser is): the page once, then the whole document
every `poll_s` (the page itself asks only for the rounds it lacks: the whole one is the worst case),
only while the file `flag` exists if one is named. It prints each document's size."""


async def _run(clients: int, rounds: int, payloads: list[Payload], workdir: Path,
               poll_s: float | None = None, interleave: bool = False) -> dict[str, Any]:
    """One coordinator and its clients; with `poll_s`, its dashboard is polled (during odd rounds only if
    `interleave`)."""
    (workdir / "run.toml").write_text(CONFIG.format(clients=clients))
    state = workdir / f"state{clients}-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "demonet.coordinator", "--listen", "127.0.0.1:0", "--config",
         str(workdir / "run.toml"), "--state-dir", str(state),
         *(["--dashboard-port", "0"] if poll_s is not None else [])],
        stdout=subprocess.PIPE, stderr=open(workdir / f"coordinator{clients}.log", "w"), text=True,
        env={**os.environ, "DEMONET_TOKEN": TOKEN})
    viewer: subprocess.Popen[str] | None = None
    flag = workdir / f"poll-{time.monotonic_ns()}" if interleave else None
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().split()[-1]
        if poll_s is not None:
            url = proc.stdout.readline().split()[-1]  # "dashboard on URL"
            viewer = subprocess.Popen([sys.executable, "-c", VIEWER, url, str(poll_s), str(flag or "")],
                                      stdout=subprocess.PIPE, text=True)
        joined = [await _join(address, f"c{i}") for i in range(clients)]
        cs = [c for c, _ in joined]
        try:
            firsts = [f for _, f in joined]
            assert len(set(firsts[1:])) <= 1
            first = max(firsts)
            if first > 0:  # the first client opened round 0 alone: let it close that round by itself
                await _client(cs[0], payloads[0], 1, 0, asyncio.Barrier(1), {}, timed=False)
            log: dict[int, list[float]] = {}
            barrier = asyncio.Barrier(clients)
            rss_before = _rss_mb(proc.pid)
            t0 = time.perf_counter()
            sizes = await asyncio.gather(*(
                _client(c, payloads[i % len(payloads)], rounds, first, barrier, log, flag if i == 0 else None)
                for i, c in enumerate(cs)))
            wall = time.perf_counter() - t0
            close_s = [min(log[-r - 1]) - max(log[r]) for r in range(first, first + rounds)]
            # The coordinator's own close times (merge, apply, persist), from its status document.
            timed = [r for r in (await cs[0].status_document())["rounds"] if first <= r["round"] < first + rounds]
            inside = [r["close_s"] for r in timed]
            polls: list[int] = []
            if viewer is not None:
                viewer.kill()
                assert viewer.stdout is not None
                polls = [int(line) for line in viewer.stdout.read().split()]
            return {
                "close_s": statistics.median(close_s), "closes": close_s, "inside": inside, "polls": len(polls),
                "inside_by_round": {r["round"]: r["close_s"] for r in timed},
                "poll_bytes": statistics.mean(polls) if polls else 0.0, "round_s": wall / rounds,
                "up_kb": sum(s[0] for s in sizes) / clients / rounds / 1e3,
                "down_kb": sum(s[1] for s in sizes) / clients / rounds / 1e3,
                "rss_mb": _rss_mb(proc.pid), "rss_before_mb": rss_before,
            }
        finally:
            for c in cs:
                await c.close()
    finally:
        if viewer is not None:
            viewer.kill()
            viewer.wait()
        proc.kill()
        proc.wait()


def _record_cost_us(clients: int, repeat: int = 200) -> tuple[float, float]:
    """In-process: microseconds the dashboard's record adds per round of `clients` payloads (their uploads
    and downloads, then the close), and to build and serialize the whole /status.json document of 512
    rounds and `clients` members."""
    metrics, peers = Metrics(), [f"c{i}" for i in range(clients)]
    record = metrics.record
    t0 = time.perf_counter()
    for r in range(repeat):
        for p in peers:
            record.uploaded(p, 541_300, 0.05, 1.0)
            record.count("bytes_down", p, 301_800)
        record.round_closed(r, members=peers, contributors=peers, aborted=False, loss=1.0, round_s=2.0, close_s=0.8,
                            bytes_up=1, bytes_down=1)
    record_us = (time.perf_counter() - t0) / repeat * 1e6
    for r in range(repeat, 512):
        metrics.closed(False, 0.8, 1.0, round=r, members=peers, contributors=peers, round_s=2.0)
    rounds = Rounds(cfg=RoundConfig(), now=0.0)
    for p in peers:
        rounds.join(p, 0.0)
    t0 = time.perf_counter()
    for _ in range(20):
        json.dumps(status_document(rounds, metrics, now=1.0, param_digest="0" * 32, total_rounds=0))
    return record_us, (time.perf_counter() - t0) / 20 * 1e6


def _interleaved(counts: list[int], rounds: int, runs: int, poll_s: float, payloads: list[Payload]) -> None:
    """Side by side in one run: the dashboard polled during odd rounds, not during even ones."""
    print(f"dashboard cost, interleaved: {runs} runs per row, {rounds} rounds each, one coordinator with its "
          f"dashboard each; /status.json polled every {poll_s:g} s by another process during odd rounds only")
    print("close: the coordinator's own (merge, apply, persist), median over the rounds; neighbours: each polled "
          "round over the mean of the unpolled rounds before and after it, median")
    print(f"{'clients':>8}{'close unpolled':>16}{'close polled':>14}{'ratio':>7}{'neighbours':>12}{'polls':>7}"
          f"{'doc kB':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            by_round: list[dict[int, float]] = []
            polls = 0
            doc_kb = []
            for _ in range(runs):
                row = asyncio.run(_run(n, rounds, payloads, Path(tmp), poll_s, interleave=True))
                by_round.append(row["inside_by_round"])
                polls += row["polls"]
                doc_kb.append(row["poll_bytes"] / 1e3)
            polled = [c for rs in by_round for r, c in rs.items() if r % 2]
            unpolled = [c for rs in by_round for r, c in rs.items() if not r % 2]
            neighbours = [rs[r] / ((rs[r - 1] + rs[r + 1]) / 2) for rs in by_round for r in rs
                          if r % 2 and r - 1 in rs and r + 1 in rs]
            print(f"{n:>8}{statistics.median(unpolled):>16.3f}{statistics.median(polled):>14.3f}"
                  f"{statistics.median(polled) / statistics.median(unpolled):>7.3f}"
                  f"{statistics.median(neighbours):>12.3f}{polls:>7}{statistics.mean(doc_kb):>8.1f}")


def _dashboard_cost(counts: list[int], rounds: int, repeat: int, poll_s: float, payloads: list[Payload]) -> None:
    """Without and with the dashboard, alternately, per client count; the close times side by side."""
    print(f"dashboard cost: {repeat} pairs of runs per row (alternating), {rounds} rounds each; with: the page "
          f"open and /status.json polled every {poll_s:g} s by another process")
    print("close: from the last submission to the aggregate at the clients; inside: the coordinator's own "
          "close (merge, apply, persist); medians over all rounds of the runs")
    print(f"{'clients':>8}{'close w/o':>11}{'close with':>12}{'ratio':>7}{'inside w/o':>12}{'inside with':>13}"
          f"{'ratio':>7}{'round w/o':>11}{'round with':>12}{'polls':>7}{'doc kB':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
            pair_ratios = []
            for k in range(repeat):
                # Pairs in the order w/o-with, then with-w/o, ...: a load that drifts during the run cancels out.
                for on in ((False, True) if k % 2 == 0 else (True, False)):
                    row = asyncio.run(_run(n, rounds, payloads, Path(tmp), poll_s if on else None))
                    runs[on].append(row)
                    print(f"{'':>8}pair {k + 1} {'with' if on else 'w/o'}: close {row['close_s']:.3f} s, inside "
                          f"{statistics.median(row['inside']):.3f} s, round {row['round_s']:.3f} s", flush=True)
                pair_ratios.append(statistics.median(runs[True][-1]["inside"])
                                   / statistics.median(runs[False][-1]["inside"]))
            close = {on: statistics.median([c for r in rs for c in r["closes"]]) for on, rs in runs.items()}
            inside = {on: statistics.median([c for r in rs for c in r["inside"]]) for on, rs in runs.items()}
            rnd = {on: statistics.mean([r["round_s"] for r in rs]) for on, rs in runs.items()}
            polls = sum(r["polls"] for r in runs[True])
            doc_kb = statistics.mean([r["poll_bytes"] for r in runs[True]]) / 1e3
            print(f"{n:>8}{close[False]:>11.3f}{close[True]:>12.3f}{close[True] / close[False]:>7.3f}"
                  f"{inside[False]:>12.3f}{inside[True]:>13.3f}{inside[True] / inside[False]:>7.3f}"
                  f"{rnd[False]:>11.3f}{rnd[True]:>12.3f}{polls:>7}{doc_kb:>8.1f}")
            print(f"{'':>8}inside with / w/o, pair by pair: {', '.join(f'{r:.3f}' for r in pair_ratios)} "
                  f"(median {statistics.median(pair_ratios):.3f})")
            record_us, document_us = _record_cost_us(n)
            print(f"{'':>8}in-process: the record's work for one round of {n} payloads {record_us:.0f} us (of "
                  f"which the close's part is one call); the whole document of 512 rounds and {n} members "
                  f"{document_us / 1e3:.2f} ms")


def _signing_cost(clients: int, row: dict[str, float], repeat: int = 2000) -> None:
    """What the keys cost in the run just measured: the coordinator verifies one signed Submit statement
    per client and round (at the Submit's first part, while the round is open; none in the close), each
    client signs one. Timed here, in this process, and set against that run's close and round times."""
    key = Identity.generate()
    digest = hashlib.sha256(b"payload").digest()
    message = submit_statement(b"s" * 16, "c0", 1, digest, "0" * 32, 1.0)
    signature = key.sign(message)

    def median_s(fn: Any) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    verify_s = median_s(lambda: verify(key.public, signature, submit_statement(b"s" * 16, "c0", 1, digest,
                                                                                "0" * 32, 1.0)))
    sign_s = median_s(lambda: key.sign(message))
    per_round = clients * verify_s
    print(f"keys: verify {1e6 * verify_s:.0f} us, sign {1e6 * sign_s:.0f} us; the coordinator's {clients} verifies "
          f"per round: {1e3 * per_round:.2f} ms = {100 * per_round / row['close_s']:.2f}% of the close time "
          f"({row['close_s']:.3f} s; they are not in it) and {100 * per_round / row['round_s']:.2f}% of the round "
          f"({row['round_s']:.3f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", default="8,16,32,64", help="client counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per client count")
    parser.add_argument("--dashboard", action="store_true", help="measure the dashboard's cost instead (see above)")
    parser.add_argument("--repeat", type=int, default=2, help="with --dashboard: runs per client count (of each)")
    parser.add_argument("--pairs", action="store_true",
                        help="with --dashboard: also pairs of runs with the dashboard off and polled, alternating")
    parser.add_argument("--poll-s", type=float, default=1.0, help="with --dashboard: seconds between polls")
    parser.add_argument("--smoke", action="store_true", help="2 and 4 clients, 2 rounds: checks that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.clients, args.rounds, args.repeat = "2,4", 4 if args.dashboard else 2, 1  # a polled round between two
    counts = [int(c) for c in args.clients.split(",")]
    payloads = _payloads(8)
    if args.dashboard:
        _interleaved(counts, args.rounds, args.repeat, args.poll_s, payloads)
        if args.pairs:
            _dashboard_cost(counts, args.rounds, args.repeat, args.poll_s, payloads)
        return 0
    print(f"model: BENCH_MODEL ({sum(t.idx.numel() for t in payloads[0].tensors.values()):,} entries per payload), "
          f"{args.rounds} rounds per row, gRPC on loopback, 2 CPU cores shared by clients and coordinator")
    print(f"{'clients':>8}{'close s':>10}{'round s':>10}{'up kB':>10}{'down kB':>10}{'RSS MB':>10}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            row = asyncio.run(_run(n, args.rounds, payloads, Path(tmp)))
            rows.append((n, row))
            print(f"{n:>8}{row['close_s']:>10.3f}{row['round_s']:>10.3f}{row['up_kb']:>10.1f}{row['down_kb']:>10.1f}"
                  f"{row['rss_mb']:>10.0f}")
    worst = max(rows, key=lambda r: r[0])
    print(f"goal: 64 clients' round closes in under 1 s: {worst[1]['close_s']:.3f} s at {worst[0]} clients "
          f"({'met' if worst[1]['close_s'] < 1 else 'NOT met'})")
    _signing_cost(worst[0], worst[1])
    if len(rows) > 1:
        (n0, r0), (n1, r1) = rows[0], rows[-1]
        growth = (r1["close_s"] / r0["close_s"]) / (n1 / n0)
        print(f"close time grows {r1['close_s'] / r0['close_s']:.1f}x for {n1 / n0:.0f}x clients "
              f"({'no worse than linear' if growth <= 1.1 else 'worse than linear'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
