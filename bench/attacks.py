"""Benchmark: what a participant holding the run token can cost the coordinator, with its limits on.

Per scenario it starts a real coordinator process and 2 honest `demonet peer` processes (p0, p1) on
loopback with a tiny model, and an attacker process that joins as a member in its own name, with a key of
its own (the run token admits it; it cannot speak for p0 or p1: tests/integration/test_identity.py), and
heartbeats. Scenarios, one after the other in one run:
- none: no attack (the baseline);
- params: GetParameters back to back, ignoring the advertised wait;
- streams: 3 concurrent Submit streams declaring 1 GiB each, sending 2 MiB parts as fast as it can;
- drip: one Submit stream for the open round declaring 8 KiB, 1 KiB every 3 s, reopened when it ends;
- impersonate: p1's id on Submit streams (the attacker's own key and session) as soon as each round opens;
- joins: a flood of challenges with a new key each, under `admission = "allowlist"` (p0's and p1's keys
  listed; the attacker does not join).
It prints p0's median round time (p0's round_time_s, round 0 left out), the coordinator's CPU% (utime +
stime over the wall time, /proc/PID/stat) and peak RSS (VmHWM), the attacker's counts, and the ratios to
the baseline. Goals: p0's rounds within 1.2x and peak RSS within 1.5x of the baseline in every attack.
The attacker never completes a payload, so the first `max_idle_rounds` rounds after it joins wait for
their deadline, as for any member that does not submit; then it is idle and the rounds no longer wait for
it (docs/coordinator.md); its streams end with each round.
Run from the repo root: `python bench/attacks.py` (about 4 minutes). Prints a table; not a test.
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
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demonet.lab.tiny import TINY_MODEL  # noqa: E402

TOKEN = "bench-attacks"
SCENARIOS = ("none", "params", "streams", "drip", "impersonate", "joins")
GOAL_ROUND, GOAL_RSS = 1.2, 1.5
CONFIG = TINY_MODEL + """[net]
round_timeout_s = {round_timeout_s}
start_peers = 2
heartbeat_interval_s = 0.5
{admission}
"""


def _proc_stats(pid: int) -> tuple[float, int]:
    """(CPU seconds so far, peak RSS in bytes) of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    hwm = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmHWM"))
    return cpu_s, int(hwm.split()[1]) * 1024


def run_scenario(attack: str, steps: int, round_timeout_s: float, tmp: Path) -> dict[str, Any]:
    """One coordinator, two peers, and the attacker (if any) until the run's last round."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "DEMONET_TOKEN": TOKEN, "PYTHONPATH": str(root)}
    admission = ""
    if attack == "joins":
        from demonet.wire.identity import Identity, public_text

        keys = [Identity.load_or_create(tmp / "out" / f"peer-{p}.key") for p in ("p0", "p1")]
        (tmp / "allow.txt").write_text("".join(public_text(k.public) + "\n" for k in keys))
        admission = f'admission = "allowlist"\nallowlist = "{tmp / "allow.txt"}"'
    (tmp / "run.toml").write_text(CONFIG.format(round_timeout_s=round_timeout_s, admission=admission))
    coord = subprocess.Popen([sys.executable, "-m", "demonet.coordinator", "--listen", "127.0.0.1:0", "--config",
                              str(tmp / "run.toml"), "--steps", str(steps), "--no-dashboard"],
                             stdout=subprocess.PIPE, stderr=open(tmp / "coordinator.log", "w"), text=True, env=env)
    procs: list[subprocess.Popen[Any]] = [coord]
    try:
        assert coord.stdout is not None
        address = coord.stdout.readline().split()[-1]
        cpu0, wall0 = _proc_stats(coord.pid)[0], time.monotonic()
        for p in ("p0", "p1"):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "demonet", "peer", "--coordinator", address, "--peer-id", p, "--out",
                 str(tmp / "out"), "--threads", "1"], stdout=subprocess.DEVNULL,
                stderr=open(tmp / f"{p}.log", "w"), env=env))
        attacker = None
        if attack != "none":
            attacker = subprocess.Popen([sys.executable, __file__, "--attack", attack, "--address", address],
                                        stdout=subprocess.PIPE, stderr=open(tmp / "attacker.log", "w"), text=True,
                                        env=env)
            procs.append(attacker)
        for p in procs[1:3]:
            p.wait(timeout=600)
        cpu1, rss = _proc_stats(coord.pid)
        wall_s = time.monotonic() - wall0
        counts = {}
        if attacker is not None:
            attacker.terminate()
            out, _ = attacker.communicate(timeout=30)
            counts = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    rows = [json.loads(line) for line in (tmp / "out" / "metrics-p0.jsonl").read_text().splitlines()]
    timed = [float(r["round_time_s"]) for r in rows if r["round"] > 0]
    return {"attack": attack, "round_s": statistics.median(timed), "rounds": len(rows),
            "cpu_pct": 100 * (cpu1 - cpu0) / wall_s, "rss": rss, "wall_s": wall_s, "counts": counts}


# -- the attacker -----------------------------------------------------------------------------------------


async def attack(kind: str, address: str, peer_id: str = "mallory") -> dict[str, int]:
    import grpc

    from demonet._proto import demonet_pb2 as pb
    from demonet._proto import demonet_pb2_grpc as pbg
    from demonet.wire.identity import Identity, submit_statement
    from demonet.wire.signed import heartbeat_request, join_request, parameters_request

    counts: dict[str, int] = {}
    md = (("authorization", f"Bearer {TOKEN}"),)
    channel = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
    stub: Any = pbg.CoordinatorStub(channel)  # type: ignore[no-untyped-call]

    def count(key: str) -> None:
        counts[key] = counts.get(key, 0) + 1

    async def open_round() -> int:
        return int((await stub.Status(pb.StatusRequest(), metadata=md, timeout=10)).round)

    async def submit(round_: int, total: int, part_bytes: int, pause_s: float) -> None:
        digest = hashlib.sha256(b"never").digest()
        num = -(-total // part_bytes)

        signature = key.sign(submit_statement(session, peer_id, round_, digest, "", 1.0))

        async def parts() -> AsyncIterator[Any]:
            for i in range(num):
                yield pb.SubmitPart(peer_id=peer_id, round=round_, loss=1.0, part=pb.PayloadPart(
                    payload_digest=digest, index=i, count=num, total_bytes=total, data=bytes(part_bytes)),
                    signature=signature if i == 0 else b"")
                await asyncio.sleep(pause_s)

        try:
            reply = await stub.Submit(parts(), metadata=md, timeout=600)
            count(pb.Refusal.Name(reply.refusal))
        except grpc.aio.AioRpcError as e:
            count(e.code().name)

    async def loop(body: Any) -> None:
        stop = time.monotonic() + 600
        while time.monotonic() < stop:
            await body()
            print(json.dumps(counts), flush=True)

    while len((await stub.Status(pb.StatusRequest(), metadata=md, timeout=10)).members) < 2:
        await asyncio.sleep(0.05)  # the run has started
    if kind == "joins":
        async def challenge() -> None:
            try:
                await stub.Challenge(pb.ChallengeRequest(peer_id=f"sybil-{sum(counts.values())}",
                                                         public_key=Identity.generate().public), metadata=md,
                                     timeout=10)
                count("challenged")
            except grpc.aio.AioRpcError as e:
                count(e.code().name)
        await loop(challenge)
        return counts
    key = Identity.generate()
    nonce = (await stub.Challenge(pb.ChallengeRequest(peer_id=peer_id, public_key=key.public), metadata=md)).nonce
    joined = await stub.Join(join_request(key, peer_id, nonce), metadata=md, timeout=10)
    session = joined.session
    while peer_id not in (await stub.Status(pb.StatusRequest(), metadata=md, timeout=10)).members:
        await asyncio.sleep(0.05)  # attack as a member, once it is one

    async def heartbeats() -> None:
        while True:
            await stub.Heartbeat(heartbeat_request(key, session, peer_id, 0), metadata=md, timeout=10)
            await asyncio.sleep(1.0)

    beating = asyncio.ensure_future(heartbeats())
    if kind == "params":
        async def download() -> None:
            try:
                request = parameters_request(key, session, peer_id, 0)
                async for _ in stub.GetParameters(request, metadata=md, timeout=30):
                    pass
                count("downloads")
            except grpc.aio.AioRpcError as e:
                count(e.code().name)
        await loop(download)
    elif kind == "streams":
        async def one() -> None:
            await submit(await open_round(), 1 << 30, 2 << 20, 0.0)
        await asyncio.gather(*(loop(one) for _ in range(3)))
    elif kind == "impersonate":
        async def as_p1() -> None:
            round_ = await open_round()
            digest = hashlib.sha256(bytes(1024)).digest()
            part = pb.SubmitPart(peer_id="p1", round=round_, loss=1.0, part=pb.PayloadPart(
                payload_digest=digest, index=0, count=1, total_bytes=1024, data=bytes(1024)),
                signature=key.sign(submit_statement(session, "p1", round_, digest, "", 1.0)))
            try:
                reply = await stub.Submit(iter([part]), metadata=md, timeout=30)
                count(pb.Refusal.Name(reply.refusal))
            except grpc.aio.AioRpcError as e:
                count(e.code().name)
            while await open_round() == round_:
                await asyncio.sleep(0.005)
        await loop(as_p1)
    else:
        async def drip() -> None:
            await submit(await open_round(), 8 << 10, 1 << 10, 3.0)  # under the run's bound (about 12 KiB)
        await loop(drip)
    beating.cancel()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="rounds per scenario (300)")
    parser.add_argument("--round-timeout-s", type=float, default=2.0, help="the run's round timeout (2)")
    parser.add_argument("--only", nargs="*", choices=SCENARIOS, help="these scenarios (default: all)")
    parser.add_argument("--attack", choices=SCENARIOS[1:], help=argparse.SUPPRESS)  # the attacker process
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attack:
        asyncio.run(attack(args.attack, args.address))
        return
    results = []
    for name in args.only or SCENARIOS:
        with tempfile.TemporaryDirectory() as tmp:
            results.append(run_scenario(name, args.steps, args.round_timeout_s, Path(tmp)))
        print(f"{name}: done in {results[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    base = results[0]
    print("| attack | p0 median round (s) | x | coordinator CPU % | x | peak RSS (MiB) | x | attacker's calls |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r["counts"].items())) or "-"
        print(f"| {r['attack']} | {r['round_s']:.3f} | {r['round_s'] / base['round_s']:.2f} | {r['cpu_pct']:.1f} | "
              f"{r['cpu_pct'] / base['cpu_pct']:.2f} | {r['rss'] / 2**20:.0f} | {r['rss'] / base['rss']:.2f} | "
              f"{calls} |")
    for r in results[1:]:
        ok_round, ok_rss = r["round_s"] <= GOAL_ROUND * base["round_s"], r["rss"] <= GOAL_RSS * base["rss"]
        print(f"{r['attack']}: rounds within {GOAL_ROUND}x: {'met' if ok_round else 'NOT met'}; "
              f"peak RSS within {GOAL_RSS}x: {'met' if ok_rss else 'NOT met'}")


if __name__ == "__main__":
    main()
