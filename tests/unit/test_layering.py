"""Layer boundaries (DESIGN.md, Layers; STYLE.md rule 1): the math imports no network code, DHT mode no gRPC."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

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


def _imports(path: Path) -> set[str]:
    """The absolute module names a source file imports (its relative imports resolved within demonet.dht)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_dht_transport_sources_import_no_grpc_and_its_rules_stay_pure() -> None:
    """DHT mode talks libp2p only: no grpc, no gRPC transport; its rules import no network code at all."""
    import demonet.dht

    folder = Path(demonet.dht.__file__).parent
    for path in folder.glob("*.py"):
        if path.name == "peer.py":  # still takes JoinInfo from demonet.transport.grpc (the round loop's, not ours)
            continue
        bad = {n for n in _imports(path) if n.split(".")[0] == "grpc" or n.startswith("demonet.transport.grpc")}
        assert not bad, f"{path.name} imports {sorted(bad)}"
    network = {n.split(".")[0] for n in _imports(folder / "rules.py")} & {"asyncio", "grpc", "hivemind"}
    assert not network, f"rules.py imports {sorted(network)}"


def test_the_dht_gatherer_pulls_in_no_grpc() -> None:
    pytest.importorskip("hivemind")
    code = ("import sys, demonet.dht.gatherer; "
            "print(','.join(m for m in ('grpc', 'demonet.transport.grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"demonet.dht.gatherer pulled in {out.stdout.strip()}"
