"""Benchmark: one coordinator against 8 to 64 payload-only clients of the 10.8M-parameter model.

Each client submits a real DeMo payload every round (no model compute) over gRPC on loopback. Per
client count it prints the time from the last submission to the aggregate (merge + apply +
persist), the whole round, bytes up/down per client, and the coordinator's resident memory.
Run from the repo root: `python bench/coordinator_scale.py`. Prints a table; not a test.
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
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demonet import wire  # noqa: E402
from demonet._proto import demonet_pb2 as pb  # noqa: E402
from demonet._proto import demonet_pb2_grpc as pbg  # noqa: E402
from demonet.optim import DeMo, Payload  # noqa: E402
from demonet.train.model import BENCH_MODEL, GPT  # noqa: E402

TOKEN = "bench"
MD = (("authorization", f"Bearer {TOKEN}"),)
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


async def _client(stub: pbg.CoordinatorStub, name: str, payload: Payload, rounds: int, first: int,
                  start: asyncio.Barrier, log: dict[int, list[float]]) -> tuple[int, int]:
    up = down = 0
    digest = (await stub.Status(pb.StatusRequest(), metadata=MD)).param_digest
    for r in range(first, first + rounds):
        data = wire.encode(payload, step=r)

        async def parts(data: bytes = data, r: int = r, digest: str = digest) -> AsyncIterator[pb.SubmitPart]:
            for part in wire.split(data):
                yield pb.SubmitPart(peer_id=name, round=r, param_digest=digest, loss=1.0, part=part)

        await start.wait()
        reply = await stub.Submit(parts(), metadata=MD, timeout=300)
        assert reply.accepted, reply.reason
        log.setdefault(r, []).append(time.perf_counter())
        up += len(data)
        async for chunk in stub.GetAggregate(pb.AggregateRequest(peer_id=name, round=r), metadata=MD, timeout=300):
            if chunk.HasField("header"):
                digest = chunk.header.param_digest
                log.setdefault(-r - 1, []).append(time.perf_counter())
            else:
                down += len(chunk.part.data)
    return up, down


async def _run(clients: int, rounds: int, payloads: list[Payload], workdir: Path) -> dict[str, float]:
    (workdir / "run.toml").write_text(CONFIG.format(clients=clients))
    proc = subprocess.Popen(
        [sys.executable, "-m", "demonet.coordinator", "--listen", "127.0.0.1:0", "--config",
         str(workdir / "run.toml"), "--state-dir", str(workdir / f"state{clients}")],
        stdout=subprocess.PIPE, stderr=open(workdir / f"coordinator{clients}.log", "w"), text=True,
        env={**os.environ, "DEMONET_TOKEN": TOKEN})
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().split()[-1]
        async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 2**25)]) as ch:
            stub = pbg.CoordinatorStub(ch)  # type: ignore[no-untyped-call]
            firsts = [int((await stub.Join(pb.JoinRequest(peer_id=f"c{i}"), metadata=MD)).round)
                      for i in range(clients)]
            assert len(set(firsts[1:])) <= 1
            first = max(firsts)
            if first > 0:  # the first client opened round 0 alone: let it close that round by itself
                await _client(stub, "c0", payloads[0], 1, 0, asyncio.Barrier(1), {})
            log: dict[int, list[float]] = {}
            barrier = asyncio.Barrier(clients)
            rss_before = _rss_mb(proc.pid)
            t0 = time.perf_counter()
            sizes = await asyncio.gather(*(
                _client(stub, f"c{i}", payloads[i % len(payloads)], rounds, first, barrier, log)
                for i in range(clients)))
            wall = time.perf_counter() - t0
            close_s = [min(log[-r - 1]) - max(log[r]) for r in range(first, first + rounds)]
            return {
                "close_s": statistics.median(close_s), "round_s": wall / rounds,
                "up_kb": sum(s[0] for s in sizes) / clients / rounds / 1e3,
                "down_kb": sum(s[1] for s in sizes) / clients / rounds / 1e3,
                "rss_mb": _rss_mb(proc.pid), "rss_before_mb": rss_before,
            }
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", default="8,16,32,64", help="client counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per client count")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    payloads = _payloads(8)
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
    if len(rows) > 1:
        (n0, r0), (n1, r1) = rows[0], rows[-1]
        growth = (r1["close_s"] / r0["close_s"]) / (n1 / n0)
        print(f"close time grows {r1['close_s'] / r0['close_s']:.1f}x for {n1 / n0:.0f}x clients "
              f"({'no worse than linear' if growth <= 1.1 else 'worse than linear'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
