"""Benchmark: honest round times with members that heartbeat and never submit, side by side in one run.

Per setting, one `demonet coordinator` process and 2 real `demonet peer` processes train the tiny model
on loopback; once the run is in its third round, a process of fakes joins `--fakes` ids with the run
token and heartbeats each every second, never submitting. Settings: no fakes; the fakes with
`net.max_idle_rounds = 0` (every member is waited on until the deadline, the behaviour before idle
members existed); the fakes with the default `max_idle_rounds`. It prints the median of the
coordinator's round times (from a round's opening to its aggregate) over `--rounds` rounds that start
`max_idle_rounds` rounds after the fakes became members. Run from the repo root:
`python bench/idle_members.py`. Prints a table; not a test.

`--fakes-only HOST:PORT`: only the fakes, against a running coordinator (DEMONET_TOKEN holds the
token); it prints "joined N, member from round R" once all are in, then "not member: K" whenever K of
them were refused in a heartbeat sweep (tests/integration/test_idle_members.py runs it so).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demonet._proto import demonet_pb2 as pb  # noqa: E402
from demonet._proto import demonet_pb2_grpc as pbg  # noqa: E402
from demonet.config import NetConfig  # noqa: E402
from demonet.lab.tiny import TINY_MODEL  # noqa: E402
from demonet.wire.identity import Identity  # noqa: E402
from demonet.wire.signed import heartbeat_request, join_request  # noqa: E402

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
    md = (("authorization", f"Bearer {token}"),)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pbg.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        ids = [f"fake-{i:03d}" for i in range(count)]
        keys = {p: Identity.generate() for p in ids}  # each fake a key of its own, as the token admits

        async def join(p: str) -> pb.JoinReply:
            challenge = await stub.Challenge(pb.ChallengeRequest(peer_id=p, public_key=keys[p].public), metadata=md,
                                             timeout=30)
            return await stub.Join(join_request(keys[p], p, challenge.nonce), metadata=md, timeout=30)

        firsts, sessions = [], {}
        for start in range(0, count, 50):
            replies = await asyncio.gather(*(join(p) for p in ids[start:start + 50]))
            firsts += [int(r.round) for r in replies]
            sessions.update({p: r.session for p, r in zip(ids[start:start + 50], replies, strict=True)})
        print(f"joined {count}, member from round {max(firsts)}", flush=True)
        while True:
            t0 = time.monotonic()
            replies = await asyncio.gather(*(stub.Heartbeat(heartbeat_request(keys[p], sessions[p], p, max(firsts)),
                                                            metadata=md, timeout=30) for p in ids))
            refused = sum(not r.member for r in replies)
            if refused:
                print(f"not member: {refused}", flush=True)
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - t0)))


async def _document(stub: pbg.CoordinatorStub) -> dict[str, Any]:
    md = (("authorization", f"Bearer {TOKEN}"),)
    reply = await stub.Status(pb.StatusRequest(detail=True), metadata=md, timeout=30)
    doc: dict[str, Any] = json.loads(reply.detail_json)
    return doc


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
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pbg.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
            while (await _document(stub))["run"]["round"] < 2:
                await asyncio.sleep(0.05)
            first = (await _document(stub))["run"]["round"] + 1  # without fakes: the same rounds
            if count:
                out = start([__file__, "--fakes-only", address, "--fakes", str(count)], "fakes").stdout
                assert out is not None
                first = int((await asyncio.to_thread(out.readline)).split()[-1])
            begin = first + NetConfig().max_idle_rounds
            while True:
                doc = await _document(stub)
                timed = [r for r in doc["rounds"] if begin <= r["round"] < begin + rounds]
                if len(timed) == rounds:
                    break
                await asyncio.sleep(0.2)
            return {"round_s": statistics.median(r["round_s"] for r in timed), "members": doc["run"]["members"],
                    "idle": doc["run"]["idle"], "contributors": max(r["contributors"] for r in timed)}
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
    args = parser.parse_args(argv)
    if args.fakes_only:
        asyncio.run(fakes(args.fakes_only, os.environ["DEMONET_TOKEN"], args.fakes))
        return 0
    default = NetConfig().max_idle_rounds
    settings = [("no fakes", 0, default), (f"{args.fakes} fakes, max_idle_rounds=0", args.fakes, 0),
                (f"{args.fakes} fakes, max_idle_rounds={default}", args.fakes, default)]
    print(f"2 demonet peers (tiny model, 1 thread each), coordinator and fakes on one machine "
          f"({os.cpu_count()} CPUs); round_timeout_s={args.round_timeout_s:g}; median of the coordinator's round "
          f"times over {args.rounds} rounds from {default} rounds after the fakes became members")
    print(f"{'setting':<34}{'median round s':>16}{'ratio':>8}{'members':>9}{'idle':>6}{'contributors':>14}")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for name, count, max_idle in settings:
            row = asyncio.run(_setting(Path(tmp), count=count, max_idle=max_idle, timeout_s=args.round_timeout_s,
                                       rounds=args.rounds))
            base = base or row["round_s"]
            print(f"{name:<34}{row['round_s']:>16.3f}{row['round_s'] / base:>8.2f}{row['members']:>9}"
                  f"{row['idle']:>6}{row['contributors']:>14}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
