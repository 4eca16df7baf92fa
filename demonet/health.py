"""`demonet health` / `demonet-health`: ask a coordinator's standard gRPC health service whether it serves.

Exits 0 when the service answers SERVING, 1 when it answers anything else or cannot be reached within
the timeout, 2 on bad arguments. Needs no run token (the health service answers without one) and
imports neither torch nor the rest of demonet, so a container health check costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DEFAULT_ADDRESS", "add_arguments", "check", "main", "run"]

DEFAULT_ADDRESS = "127.0.0.1:7450"
"""The coordinator's default --listen port, on this machine (a coordinator container checking itself)."""


def check(address: str, *, timeout_s: float = 5.0, service: str = "", root_cert: bytes | None = None,
          server_name: str | None = None) -> str:
    """The health status name the coordinator at `address` reports (``SERVING``, ``NOT_SERVING``, ...).

    Raises:
        ConnectionError: no answer within `timeout_s` (not listening, unreachable, TLS mismatch).
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = (grpc.secure_channel(address, grpc.ssl_channel_credentials(root_cert), options=options)
               if root_cert is not None else grpc.insecure_channel(address))
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)  # type: ignore[attr-defined]
    except grpc.RpcError as e:
        code = e.code() if isinstance(e, grpc.Call) else None
        if code == grpc.StatusCode.NOT_FOUND:
            return "SERVICE_UNKNOWN"
        detail = e.details() if isinstance(e, grpc.Call) else str(e)
        raise ConnectionError(f"{address}: {code.name if code else 'error'}: {detail}") from None
    finally:
        channel.close()
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `demonet health` flags."""
    parser.add_argument("--coordinator", default=DEFAULT_ADDRESS,
                        help=f"HOST:PORT of the coordinator (default {DEFAULT_ADDRESS})")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="give up after this long (5)")
    parser.add_argument("--service", default="",
                        help="service name to ask about (default: the server as a whole; "
                             "demonet.v1.Coordinator for the coordinator's service)")
    parser.add_argument("--tls-root-cert", help="PEM file to verify a TLS coordinator (default: plaintext)")
    parser.add_argument("--tls-server-name",
                        help="the name in the coordinator's certificate, when HOST is not it (e.g. 127.0.0.1)")


def run(args: argparse.Namespace) -> int:
    """Run `demonet health` with parsed flags; returns the exit code."""
    if args.timeout_s <= 0:
        print("demonet health: --timeout-s should be > 0", file=sys.stderr)
        return 2
    try:
        root_cert = Path(args.tls_root_cert).read_bytes() if args.tls_root_cert else None
    except OSError as e:
        print(f"demonet health: cannot read {args.tls_root_cert!r}: {e.strerror}", file=sys.stderr)
        return 2
    try:
        status = check(args.coordinator, timeout_s=args.timeout_s, service=args.service, root_cert=root_cert,
                       server_name=args.tls_server_name)
    except ConnectionError as e:
        print(f"demonet health: {e}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def parser() -> argparse.ArgumentParser:
    """The standalone `demonet-health` parser (the same flags as `demonet health`)."""
    p = argparse.ArgumentParser(prog="demonet-health",
                                description="Exit 0 if a coordinator's gRPC health service answers SERVING.")
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`demonet-health` / `python -m demonet.health`: the same as `demonet health`."""
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
