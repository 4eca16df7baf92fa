"""Benchmark: what per-peer keys cost, per request and per round (coordinator mode).

Times, in one process, signing and verifying the statements a peer sends each round (a Submit's first
part and a heartbeat), with the statement built as the client and the coordinator build it, and prints
the coordinator's share per round for N clients (N verifies of a Submit; heartbeats every
`heartbeat_interval_s` come on top and cost the same each). Verification runs when a Submit's first part
arrives, while the round is open, not in the round's close. Run from the repo root:
`python bench/signatures.py [--clients 64]`. Prints a table; not a test. `--smoke`: 100 repeats.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demonet.wire.identity import Identity, heartbeat_statement, submit_statement, verify  # noqa: E402


def _median_us(fn: object, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3000)
    parser.add_argument("--smoke", action="store_true", help="100 repeats: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.repeat = 100
    key = Identity.generate()
    session, digest = b"s" * 16, hashlib.sha256(b"payload").digest()
    message = submit_statement(session, "peer-0", 1234, digest, "0" * 32, 2.5)
    signature = key.sign(message)
    rows = [
        ("build a Submit statement", _median_us(lambda: submit_statement(session, "peer-0", 1234, digest, "0" * 32,
                                                                          2.5), args.repeat)),
        ("sign it (peer)", _median_us(lambda: key.sign(message), args.repeat)),
        ("verify it (coordinator)", _median_us(lambda: verify(key.public, signature, message), args.repeat)),
        ("heartbeat: build + sign (peer)", _median_us(lambda: key.sign(heartbeat_statement(session, "peer-0", 1234, 1)),
                                                      args.repeat)),
    ]
    print("| step | median us |")
    print("|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")
    verify_us = rows[2][1] + rows[0][1]
    print(f"\ncoordinator, {args.clients} clients: {args.clients * verify_us / 1e3:.2f} ms of CPU per round for "
          f"their Submits (spread over the round, before its close); per peer: {rows[1][1] + rows[0][1]:.0f} us")


if __name__ == "__main__":
    main()
