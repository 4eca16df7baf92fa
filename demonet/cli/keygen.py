"""`demonet keygen`: write a peer's Ed25519 key, and print the line that names it in an allowlist."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from demonet.errors import KeyFileError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="the key file to write (mode 0600; never overwritten)")
    parser.add_argument("--peer-id", help="add this peer id to the printed allowlist line (the key may then join "
                                          "only as it)")
    parser.add_argument("--show", action="store_true", help="print the line of an existing key file instead")


def run(args: argparse.Namespace) -> int:
    """Write (or with --show read) the key; print ``ed25519:<hex> [peer_id]`` on stdout, the fingerprint on stderr."""
    from demonet.wire.identity import Identity, public_text  # the wire package loads torch: not for --help

    path = Path(args.out)
    try:
        if args.show:
            identity = Identity.load(path)
        else:
            identity = Identity.generate()
            identity.save(path)
    except FileExistsError:
        print(f"demonet keygen: {path} exists; it is never overwritten (--show prints its public key)", file=sys.stderr)
        return 2
    except (OSError, KeyFileError) as e:
        print(f"demonet keygen: {e}", file=sys.stderr)
        return 2
    print(" ".join([public_text(identity.public), *([args.peer_id] if args.peer_id else [])]))
    print(f"key {identity.fingerprint} in {path}", file=sys.stderr)
    return 0
