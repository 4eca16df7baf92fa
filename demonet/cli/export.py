"""`demonet export`: a coordinator's saved canonical parameters as a safetensors file.

Reads the state folder only (never a running coordinator); the work is in demonet.coordinator.weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `demonet export` flags."""
    parser.add_argument("--state-dir", required=True, help="a coordinator's --state-dir (coordinator-state.pt)")
    parser.add_argument("--out", required=True, help="the safetensors file to write")
    parser.add_argument("--force", action="store_true", help="overwrite --out if it exists")


def run(args: argparse.Namespace) -> int:
    """Run `demonet export`; returns the exit code (2 on a bad state folder or --out, nothing written)."""
    from demonet.coordinator.weights import WeightsFileError, export

    out = Path(args.out)
    print(f"exporting {Path(args.state_dir)} to {out} ...", file=sys.stderr, flush=True)
    try:
        saved = export(Path(args.state_dir), out, force=args.force)
    except WeightsFileError as e:
        print(f"demonet export: {e}", file=sys.stderr)
        return 2
    num_bytes = sum(t.numel() * t.element_size() for t in saved.params.values())
    print(f"wrote {out}: {len(saved.params)} tensors, {num_bytes / 2**20:.1f} MiB; the parameters at the start "
          f"of round {saved.round}, digest {saved.digest}")
    return 0
