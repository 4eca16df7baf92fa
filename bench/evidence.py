"""demonet vs AdamW-DDP and hivemind.Optimizer, 4 peers in network namespaces over tbf-shaped links.

The same as `demonet bench` (needs root): `python bench/evidence.py --out runs/bench --plots docs`.
Prints the table of docs/evidence.md; see demonet/lab/evidence/ for what is measured and how.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demonet.lab.evidence.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
