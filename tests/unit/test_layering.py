"""Imports go one way (DESIGN.md, Layers; STYLE.md rule 1), checked on every import statement of the sources.

Every module's imports are read from its source, lazy ones inside functions included, relative ones
resolved: math <- wire <- train and transports <- services. The rule modules are pure: no asyncio, no
network. A subprocess check covers what a source check cannot see (what an import pulls in at run time).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import demonet

ROOT = Path(demonet.__file__).parent
MATH = {"torch", "math", "dataclasses", "typing", "collections", "__future__", "functools", "decimal"}
NETWORK = ("grpc", "grpc_health", "hivemind", "demonet._proto.demonet_pb2_grpc")
SERVICES = ("demonet.peer", "demonet.coordinator", "demonet.dht", "demonet.flex", "demonet.cli", "demonet.lab",
            "demonet.train.local", "demonet.joined")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str | None = None) -> set[str]:
    """Every module `path` (the module `module`) imports: absolute names; `from X import y` counts X and X.y."""
    module = module or _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{a.name}" for a in node.names)
    return found


SOURCES = {_module(p): p for p in ROOT.rglob("*.py") if "_proto" not in p.parts}


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(modules: tuple[str, ...], forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for module, path in sorted(SOURCES.items()):
        if not _within(module, modules) or _within(module, allowed):
            continue
        bad += [f"{module} imports {name}" for name in sorted(_imports(path))
                if _within(name, forbidden) and not _within(name, (module,))]
    return bad


def test_the_layer_table_covers_every_module() -> None:
    assert {"demonet.optim.demo", "demonet.wire", "demonet.train.loop", "demonet.transport.grpc",
            "demonet.coordinator.rounds", "demonet.dht.rules", "demonet.flex.link", "demonet.dashboard.record",
            "demonet.dashboard.server"} <= set(SOURCES)


def test_optim_sources_import_only_torch_and_stdlib_math() -> None:
    bad = [f"{m} imports {n}" for m, p in SOURCES.items() if _within(m, ("demonet.optim",))
           for n in _imports(p) if not (n.split(".")[0] in MATH or _within(n, ("demonet.optim",)))]
    assert not bad


@pytest.mark.parametrize(("layer", "forbidden", "allowed"), [
    # The wire layer knows the math, the errors and its own messages: no network, no training, no service.
    (("demonet.wire",), NETWORK + ("asyncio", "demonet.transport", "demonet.train") + SERVICES, ()),
    # The training side (replica, loop, data, model) drives transports only through their protocols.
    (("demonet.train",), NETWORK + ("demonet.transport.grpc", "demonet.transport.grpc_retry") + SERVICES,
     ("demonet.train.local",)),
    # Built-in tasks are training code too: a peer that builds one pulls in no service.
    (("demonet.tasks",), NETWORK + ("demonet.transport",) + SERVICES, ()),
    # Transports import no service, and the protocols no network library.
    (("demonet.transport",), SERVICES + ("demonet.train", "hivemind"), ()),
    (("demonet.transport",), NETWORK, ("demonet.transport.grpc", "demonet.transport.grpc_retry")),
    # DHT mode does not go through the gRPC transport; the coordinator knows nothing of the DHT.
    (("demonet.dht",), ("grpc", "demonet.transport.grpc", "demonet.transport.grpc_retry", "demonet.coordinator",
                        "demonet.peer"), ()),
    (("demonet.coordinator",), ("hivemind", "demonet.dht", "demonet.peer", "demonet.flex"), ()),
    # Services do not import each other sideways.
    (("demonet.peer",), ("demonet.dht", "demonet.flex", "demonet.coordinator"), ()),
    (("demonet.flex",), ("demonet.peer", "demonet.dht", "demonet.coordinator"), ()),
    # The dashboard is standard library only: the coordinator and DHT mode both use it, it uses neither.
    (("demonet.dashboard",), NETWORK + SERVICES + ("torch", "prometheus_client", "demonet.transport", "demonet.train",
                                                  "demonet.wire", "demonet.optim"), ()),
    # What it and a DHT peer record is pure bookkeeping: no I/O loop, no network.
    (("demonet.dashboard.record", "demonet.dht.view"), NETWORK + ("asyncio",), ()),
    # The pure rules: no asyncio, no network, no torch.distributed.
    (("demonet.coordinator.rounds", "demonet.dht.rules", "demonet.dht.keys"),
     NETWORK + ("asyncio", "torch.distributed") + SERVICES, ()),
])
def test_imports_go_one_way(layer: tuple[str, ...], forbidden: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    assert not _violations(layer, forbidden, allowed)


def test_the_checker_sees_a_lazy_relative_import(tmp_path: Path) -> None:
    """The table above can fail: an import inside a function, written relative, is found."""
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from ..coordinator import local\n")
    assert "demonet.coordinator.local" in _imports(path, module="demonet.train.x")


def test_math_and_training_pull_in_no_network_code_at_run_time() -> None:
    code = ("import sys, demonet.optim, demonet.train.model, demonet.train.data, demonet.train.loop; "
            "print(','.join(m for m in ('grpc', 'hivemind', 'demonet.coordinator', 'demonet.dht') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"pulled in {out.stdout.strip()}"
