"""Shared pieces of the integration tests: the tiny run config every process test trains."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import queue
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def tiny_config(*, round_timeout_s: float, steps: int | None = None, optim: Mapping[str, float | str] | None = None,
                **net: float) -> str:
    """A TOML run config with a 1-layer, 32-wide model (rounds take milliseconds), the given [optim]
    fields (e.g. {"base": "sgd", "lr": 0.05}) and the given [net] fields."""
    lines = ["[model]", "d_model = 32", "n_layers = 1", "n_heads = 2", "seq_len = 32",
             "[train]", "seq_len = 32", "batch_size = 2"]
    if steps is not None:
        lines.append(f"steps = {steps}")
    if optim:
        lines += ["[optim]", *(f"{k} = {json.dumps(v)}" for k, v in optim.items())]
    lines += ["[net]", f"round_timeout_s = {round_timeout_s}", *(f"{k} = {v}" for k, v in net.items())]
    return "\n".join(lines) + "\n"


@contextlib.asynccontextmanager
async def coordinator_in_process(tmp: Path, *, token: str, steps: int, state_dir: Path | None = None
                                 ) -> AsyncIterator[tuple[str, asyncio.Task[None]]]:
    """A real `demonet.coordinator.serve` (grpc.aio on loopback) in this event loop, on `tiny_config` with
    rounds of at most 30 s and `steps` rounds: yields its address and its task, which ends after the run's
    last round; cancelled at the end."""
    from demonet.config import load_config
    from demonet.coordinator import CoordinatorOptions, serve

    (tmp / "run.toml").write_text(tiny_config(round_timeout_s=30.0, steps=steps))
    cfg = load_config(str(tmp / "run.toml"), {}, {})
    listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(cfg, CoordinatorOptions(token=token, state_dir=state_dir, total_rounds=steps),
                                       on_listening=listening.set_result, linger_s=0.2))
    try:
        yield await asyncio.wait_for(listening, 30), server
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


# A `demonet` process held at a gate: it imports torch and warms up, says "gate: ready" on stderr, and
# enters the run (its argv) once a line arrives on its stdin, so a test can start or restart a peer at once.
GATE = """
import sys
from demonet.cli import main
from demonet.loop.lifecycle import warm_up as _warm_up
_warm_up()
print("gate: ready", file=sys.stderr, flush=True)
sys.stdin.readline()
raise SystemExit(main(sys.argv[1:]))
"""
DHT_GATE = GATE.replace("_warm_up()\n", "import demonet.dht.gatherer\n_warm_up()\n")
"""The same gate, with the DHT transport (and hivemind) imported before the peer is let in."""


def self_signed_cert(tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate for "localhost" and its key, made by the openssl command in `tmp`."""
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def listening_line(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The first stdout line of a starting coordinator ("listening on HOST:PORT"), or "" if none came
    within ``timeout_s`` (a hung process fails the test instead of blocking it)."""
    lines: queue.Queue[bytes] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout_s).decode()
    except queue.Empty:
        return ""


def metrics_rows(out: Path, peer: str) -> list[dict[str, Any]]:
    """A peer's `metrics-<peer>.jsonl` rows in run folder ``out`` (one per round it completed; [] before any)."""
    path = out / f"metrics-{peer}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rows_by_round(rows: Callable[[str], list[dict[str, Any]]], peers: Sequence[str]
                  ) -> dict[int, dict[str, dict[str, Any]]]:
    """round -> peer -> metrics row, checking what holds in every process test: one row per peer and
    round, finite losses, no resync. Each caller then checks the digests against its own reference."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for p in peers:
        for row in rows(p):
            assert math.isfinite(row["loss"]), row
            assert not row.get("resynced"), row
            assert p not in by_round.setdefault(row["round"], {}), f"two rows of {p} for round {row['round']}"
            by_round[row["round"]][p] = row
    return by_round


def run_coroutine(module: str, name: str, reap_children: Any, timeout_s: float) -> None:
    """Run the coroutine function `name` of `module` in a fresh interpreter (its own event loop and p2pd
    daemons), and fail with its output unless it ends well within `timeout_s`."""
    code = f"import asyncio; from {module} import {name}; asyncio.run({name}()); print('ok')"
    proc = reap_children.add(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2]))
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0 and out.strip().endswith("ok"), out[-2000:] + err[-3000:]
