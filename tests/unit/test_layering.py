"""The math layer imports no network code (DESIGN.md, Layers; STYLE.md rule 1)."""

import ast
import subprocess
import sys
from pathlib import Path

import demonet.optim

ALLOWED = {"torch", "math", "dataclasses", "typing", "collections", "__future__", "functools", "decimal"}


def test_optim_imports_no_network_code() -> None:
    code = ("import sys, demonet.optim, demonet.train.model, demonet.train.data; "
            "print(','.join(m for m in ('grpc', 'hivemind', 'google.protobuf', 'demonet.wire') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"demonet.optim pulled in {out.stdout.strip()}"


def test_optim_sources_import_only_torch_and_stdlib_math() -> None:
    # torch itself imports asyncio, so that one can only be checked in the sources.
    for path in Path(demonet.optim.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in ALLOWED, f"{path.name} imports {name}"


def test_the_merge_is_wire_layer_code() -> None:
    """The one merge (coordinator and DHT slice owners alike) knows the math and the wire, no transport or service."""
    code = ("import sys, demonet.wire.merge; "
            "print(','.join(m for m in ('grpc', 'hivemind', 'demonet.transport', 'demonet.coordinator', "
            "'demonet.peer', 'demonet.coordinator.rounds') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"demonet.wire.merge pulled in {out.stdout.strip()}"
