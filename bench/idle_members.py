"""Benchmark: honest round times with members that heartbeat and never submit, side by side in one run.

Per setting, one `demonet coordinator` process and 2 real `demonet peer` processes train the tiny model
on loopback; once the run is in its third round, a process of fakes joins `--fakes` ids with the run
token and heartbeats each every second, never submitting. Settings: no fakes; the fakes with
`net.max_idle_rounds = 0`; the fakes with the default `max_idle_rounds`. A member none of whose payloads was
accepted is not waited on in either (docs/coordinator.md#who-a-round-waits-for): the idle rule is for members
that stop submitting. It prints the median and the longest of the coordinator's round times (from a round's
opening to its aggregate) over `--rounds` rounds from the first the fakes are members of. Run from the repo root:
`python bench/idle_members.py`. Prints a table; not a test. `--smoke`: 20 fakes, a round deadline of 1 s, 2
timed rounds, a check that the script runs.

`--fakes-only HOST:PORT`: only the fakes, against a running coordinator (DEMONET_TOKEN holds the
token); it prints "joined N, member from round R" once all are in, then "not member: K" whenever K of
them were refused in a heartbeat sweep (tests/integration/test_idle_members.py runs it so).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demonet.config import NetConfig  # noqa: E402
from demonet.lab.tiny import TINY_MODEL  # noqa: E402
from demonet.transport.grpc import GrpcClient  # noqa: E402

TOKEN = "bench"
CONFIG = TINY_MODEL + """[net]
round_timeout_s = {timeout_s}
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 10.0
start_peers = 2
max_idle_rounds = {max_idle}
"""


async def fakes(address: str, token: str, count: int, interval_s: float = 1.0) -> None:
    """Join `count` ids and heartbeat each every `interval_s`, forever; never submit."""
    # Each fake a client and a key of its own, as the token admits.
    clients = [GrpcClient(address, token=token, peer_id=f"fake-{i:03d}", call_timeout_s=30.0) for i in range(count)]
    firsts = []
    for start in range(0, count, 50):
        firsts += [info.round for info in await asyncio.gather(*(c.join() for c in clients[start:start + 50]))]
    print(f"joined {count}, member from round {max(firsts)}", flush=True)
    while True:
        t0 = time.monotonic()
        replies = await asyncio.gather(*(c.heartbeat(max(firsts)) for c in clients))
        refused = sum(not member for _, member in replies)
        if refused:
            print(f"not member: {refused}", flush=True)
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - t0)))


async def _setting(workdir: Path, *, count: int, max_idle: int, timeout_s: float, rounds: int) -> dict[str, Any]:
    """One run: coordinator, 2 peers, then (with `count`) the fakes; the round times measured."""
    run = workdir / f"idle{max_idle}-fakes{count}"
    run.mkdir()
    (run / "run.toml").write_text(CONFIG.format(timeout_s=timeout_s, max_idle=max_idle))
    env = {**os.environ, "DEMONET_TOKEN": TOKEN}
    procs: list[subprocess.Popen[str]] = []

    def start(args: list[str], name: str) -> subprocess.Popen[str]:
        procs.append(subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True, env=env,
                                      stderr=open(run / f"{name}.log", "w")))
        return procs[-1]

    try:
        coordinator = start(["-m", "demonet.coordinator", "--listen", "127.0.0.1:0", "--config",
                             str(run / "run.toml"), "--steps", "0"], "coordinator")
        assert coordinator.stdout is not None
        address = coordinator.stdout.readline().split()[-1]
        for name in ("h0", "h1"):
            start(["-m", "demonet", "peer", "--coordinator", address, "--peer-id", name, "--out",
                   str(run / "out"), "--threads", "1"], name)
        status = GrpcClient(address, token=TOKEN, call_timeout_s=30.0)
        try:
            while (await status.status_document())["run"]["round"] < 2:
                await asyncio.sleep(0.05)
            first = (await status.status_document())["run"]["round"] + 1  # without fakes: the same rounds
            if count:
                out = start([__file__, "--fakes-only", address, "--fakes", str(count)], "fakes").stdout
                assert out is not None
                first = int((await asyncio.to_thread(out.readline)).split()[-1])
            begin = first
            while True:
                doc = await status.status_document()
                timed = [r for r in doc["rounds"] if begin <= r["round"] < begin + rounds]
                if len(timed) == rounds:
                    break
                await asyncio.sleep(0.2)
            return {"round_s": statistics.median(r["round_s"] for r in timed),
                    "longest_s": max(r["round_s"] for r in timed), "members": doc["run"]["members"],
                    "idle": doc["run"]["idle"], "contributors": max(r["contributors"] for r in timed)}
        finally:
            await status.close()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fakes", type=int, default=200, help="fake members (200)")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds per setting (8)")
    parser.add_argument("--round-timeout-s", type=float, default=3.0, help="the rounds' deadline (3.0)")
    parser.add_argument("--fakes-only", metavar="HOST:PORT", help="only run the fakes against this coordinator")
    parser.add_argument("--smoke", action="store_true", help="20 fakes, a deadline of 1 s, 2 timed rounds: checks "
                        "that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.fakes, args.round_timeout_s, args.rounds = 20, 1.0, 2
    if args.fakes_only:
        asyncio.run(fakes(args.fakes_only, os.environ["DEMONET_TOKEN"], args.fakes))
        return 0
    default = NetConfig().max_idle_rounds
    settings = [("no fakes", 0, default), (f"{args.fakes} fakes, max_idle_rounds=0", args.fakes, 0),
                (f"{args.fakes} fakes, max_idle_rounds={default}", args.fakes, default)]
    print(f"2 demonet peers (tiny model, 1 thread each), coordinator and fakes on one machine "
          f"({os.cpu_count()} CPUs); round_timeout_s={args.round_timeout_s:g}; median of the coordinator's round "
          f"times over {args.rounds} rounds from the first the fakes are members of")
    print(f"{'setting':<34}{'median round s':>16}{'ratio':>8}{'longest s':>11}{'members':>9}{'idle':>6}"
          f"{'contributors':>14}")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for name, count, max_idle in settings:
            row = asyncio.run(_setting(Path(tmp), count=count, max_idle=max_idle, timeout_s=args.round_timeout_s,
                                       rounds=args.rounds))
            base = base or row["round_s"]
            print(f"{name:<34}{row['round_s']:>16.3f}{row['round_s'] / base:>8.2f}{row['longest_s']:>11.3f}"
                  f"{row['members']:>9}"
                  f"{row['idle']:>6}{row['contributors']:>14}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
