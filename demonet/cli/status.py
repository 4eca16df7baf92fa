"""`demonet status`: the dashboard's document as readable tables, or as JSON with `--json`.

From a coordinator over gRPC (the Status RPC with `detail`: the run token, TLS, the address peers
already use; it works with the dashboard off), or from any dashboard's `/status.json` over HTTP
(`--dashboard URL`: a DHT peer's, which has no gRPC service).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from demonet.errors import DemonetError

__all__ = ["add_arguments", "format_status", "run"]

HTTP_TIMEOUT_S = 10.0
"""How long `--dashboard URL` waits for /status.json: connecting, request and answer."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `demonet status` flags."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--coordinator", help="HOST:PORT of the coordinator (gRPC, with the run token)")
    where.add_argument("--dashboard", metavar="URL",
                       help="a dashboard's address, e.g. http://HOST:PORT/ (a coordinator's or a DHT peer's; no token)")
    parser.add_argument("--token-file", help="file holding the run token (default: the DEMONET_TOKEN env var)")
    parser.add_argument("--tls-root-cert", help="PEM file to verify a TLS coordinator (default: plaintext)")
    parser.add_argument("--json", action="store_true", help="print the document as JSON (docs/dashboard.md)")
    parser.add_argument("--rounds", type=int, default=5, help="recent rounds to list (5)")


def _fetch(url: str) -> dict[str, Any]:
    base = url if url.endswith("/") else url + "/"
    with urllib.request.urlopen(base + "status.json", timeout=HTTP_TIMEOUT_S) as reply:
        document: dict[str, Any] = json.loads(reply.read())
    return document


def run(args: argparse.Namespace) -> int:
    """Run `demonet status`; returns the exit code (2: bad flags or files, 1: no answer)."""
    from demonet.config import load_token  # with the optimizer's settings, torch: not for --help or --dashboard

    try:
        if args.coordinator:
            token = load_token(args.token_file, os.environ)
            root_cert = Path(args.tls_root_cert).read_bytes() if args.tls_root_cert else None
    except (ValueError, OSError) as e:
        print(f"demonet status: {e}", file=sys.stderr)
        return 2
    try:
        document = _fetch(args.dashboard) if args.dashboard else asyncio.run(_ask(args.coordinator, token, root_cert))
    except (DemonetError, PermissionError, OSError, ValueError) as e:  # unreachable, refused, not the document
        print(f"demonet status: {e}", file=sys.stderr)
        return 1
    print(json.dumps(document, indent=2) if args.json else format_status(document, rounds=args.rounds))
    return 0


async def _ask(address: str, token: str, root_cert: bytes | None) -> dict[str, Any]:
    from demonet.transport.grpc import GrpcClient

    client = GrpcClient(address, token=token, root_cert=root_cert, reconnect_timeout_s=10.0)
    try:
        return await client.status_document()
    finally:
        await client.close()


# -- the tables ----------------------------------------------------------------------------------------

_PACE_ROUNDS = 20
"""The pace is taken over the last this many rounds closed (the dashboard's too)."""


def _pace(doc: dict[str, Any]) -> str:
    """", N rounds/s, about T left" from the rounds' close times; "" before two rounds closed."""
    recent = doc["rounds"][-(_PACE_ROUNDS + 1):]
    if len(recent) < 2 or not recent[-1]["time"] > recent[0]["time"]:
        return ""
    per_s = (len(recent) - 1) / (recent[-1]["time"] - recent[0]["time"])
    total, round = doc["run"]["total_rounds"], doc["run"]["round"]
    if not total:
        return f", {per_s:.2f} rounds/s"
    left_s = max(0, total - round) / per_s
    left = f"{left_s:.0f} s" if left_s < 90 else f"{left_s / 60:.1f} min" if left_s < 5400 else f"{left_s / 3600:.1f} h"
    return f", {per_s:.2f} rounds/s, about {left} left"


def _v(x: Any, digits: int = 0) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _bytes(x: float | None) -> str:
    if x is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(x) < 1000 or unit == "GB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    return ""  # unreachable


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return lines


def format_status(doc: dict[str, Any], *, rounds: int = 5, refusals: int = 10) -> str:
    """The document as text: the run, its last `rounds` rounds, the members, the last `refusals` refusals."""
    run = doc["run"]
    who = "coordinator" if doc["mode"] == "coordinator" else f"DHT peer {doc['source']}"
    total = f" of {run['total_rounds']}" if run["total_rounds"] else ""
    left = f", round deadline in {run['seconds_left']:.1f} s" if run["seconds_left"] is not None else ""
    lines = [f"{who}: round {run['round']}{total}, {run['phase']}{left}{_pace(doc)}; "
             f"{run['rounds_closed']} rounds closed, {run['rounds_aborted']} aborted; {run['members']} members"
             + (f" ({run['idle']} idle)" if run.get("idle") else ""),
             f"last loss {_v(run['last_loss'], 4)}; {_bytes(run['bytes_up'])} in, {_bytes(run['bytes_down'])} out; "
             f"{run['resyncs']} resyncs, {_v(run['rejected'])} rejected; digest {run['param_digest'][:12] or '-'}"]
    recent = doc["rounds"][-rounds:] if rounds > 0 else []
    if recent:
        lines += ["", "recent rounds"] + _table(
            ["round", "loss", "round s", "close s", "members", "in", "out", ""],
            [[str(r["round"]), _v(r["loss"], 4), _v(r["round_s"], 3), _v(r["close_s"], 3),
              f"{r['contributors']}/{r['members']}", _bytes(r["bytes_up"]), _bytes(r["bytes_down"]),
              "aborted" if r["aborted"] else ""] for r in recent])
    dht = any(m["slices"] is not None for m in doc["members"])
    lines += ["", "members" if doc["members"] else "members: none"]
    if doc["members"]:
        lines += _table(
            ["id", "key", "state", "last seen", "contributed", "missed", "resyncs", "last loss", "in", "out", "link",
             "samples", "micro-batches", "compute s", "weight", "k", "upload s", *(["slices"] if dht else [])],
            [[m["id"], m["key"] or "-", m["state"], f"{m['last_seen_s']:.1f} s ago", str(m["contributed"]),
              str(m["missed"]), str(m["resyncs"]), _v(m["last_loss"], 4), _bytes(m["bytes_up"]),
              _bytes(m["bytes_down"]),
              "-" if m["link_bps"] is None else _bytes(m["link_bps"] * 8).replace("B", "bit") + "/s",
              _v(m.get("samples")), _v(m.get("micro_batches")), _v(m.get("compute_s"), 2),
              "-" if m.get("weight") is None else f"{100 * m['weight']:.0f}%",
              _v(m.get("topk")), _v(m.get("upload_s"), 2), *([_v(m["slices"])] if dht else [])]
             for m in doc["members"]])
    omitted = doc.get("members_omitted") or {}
    if omitted:
        lines.append(f"... and {sum(omitted.values())} more not listed: "
                     + ", ".join(f"{count} {state}" for state, count in omitted.items()))
    shown = doc["refusals"][-refusals:]
    lines += ["", "recent refusals" if shown else "recent refusals: none"]
    if shown:
        lines += _table(["time", "peer", "round", "kind", "reason"],
                        [[time.strftime("%H:%M:%S", time.localtime(r["time"])), r["peer"] or "?", _v(r["round"]),
                          r["kind"], r["reason"]] for r in shown])
    return "\n".join(lines)
