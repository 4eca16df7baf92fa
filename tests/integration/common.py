"""Shared pieces of the integration tests: the tiny run config every process test trains."""

from __future__ import annotations


def tiny_config(*, round_timeout_s: float, steps: int | None = None, **net: float) -> str:
    """A TOML run config with a 1-layer, 32-wide model (rounds take milliseconds) and the given [net] fields."""
    lines = ["[model]", "d_model = 32", "n_layers = 1", "n_heads = 2", "seq_len = 32",
             "[train]", "seq_len = 32", "batch_size = 2"]
    if steps is not None:
        lines.append(f"steps = {steps}")
    lines += ["[net]", f"round_timeout_s = {round_timeout_s}", *(f"{k} = {v}" for k, v in net.items())]
    return "\n".join(lines) + "\n"


# A `demonet` process held at a gate: it imports torch and warms up, says "gate: ready" on stderr, and
# enters the run (its argv) once a line arrives on its stdin, so a test can start or restart a peer at once.
GATE = """
import sys
from demonet.cli import main
from demonet.peer import _warm_up
_warm_up()
print("gate: ready", file=sys.stderr, flush=True)
sys.stdin.readline()
raise SystemExit(main(sys.argv[1:]))
"""
