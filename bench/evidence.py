"""demonet vs AdamW-DDP and hivemind.Optimizer, 4 peers in network namespaces over tbf-shaped links.

The same as `demonet bench` (needs root): `python bench/evidence.py --out runs/bench --plots docs`.
Prints the table of docs/evidence.md; see demonet/lab/evidence/ for what is measured and how.
`--smoke`: AdamW-DDP and demonet, 2 peers, 2 steps over 100 Mbit/s, into a temporary folder: a check that it
runs. Where network namespaces cannot be made here (not root, no iproute2), it says why and exits 0.
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demonet.lab import netlab  # noqa: E402
from demonet.lab.evidence.cli import main  # noqa: E402


def smoke(argv: list[str]) -> int:
    ok, why = netlab.available()
    if not ok:
        print(f"smoke: skipped, {why}")
        return 0
    with tempfile.TemporaryDirectory(prefix="evidence-smoke-") as out:
        return main(["--systems", "adamw-ddp,demonet", "--mbit", "100", "--peers", "2", "--steps", "2",
                     "--max-time-s", "120", "--no-progress", "--out", out, *argv])


if __name__ == "__main__":
    args = sys.argv[1:]
    raise SystemExit(smoke([a for a in args if a != "--smoke"]) if "--smoke" in args else main(args))
