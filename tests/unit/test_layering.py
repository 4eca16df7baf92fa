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
GRPC_TRANSPORT = ("demonet.transport.grpc", "demonet.transport.grpc_connection", "demonet.transport.grpc_retry",
                  "demonet.transport.grpc_replies")
"""The gRPC client's modules: the only transport modules that import grpc."""
SERVICES = ("demonet.peer", "demonet.coordinator", "demonet.dht", "demonet.flex", "demonet.cli", "demonet.lab",
            "demonet.loop", "demonet.joined", "demonet.joining")


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
                if _within(name, forbidden) and not _within(name, (module, *modules))]
    return bad


def test_the_layer_table_covers_every_module() -> None:
    assert {"demonet.optim.demo", "demonet.wire", "demonet.loop.round_loop", "demonet.transport.grpc",
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
    (("demonet.train",), NETWORK + ("demonet.transport",) + SERVICES, ()),
    # The round loop drives transports through their protocols; only the local cluster knows the coordinator.
    (("demonet.loop",), NETWORK + GRPC_TRANSPORT + ("demonet.coordinator", "demonet.dht", "demonet.flex",
                                                    "demonet.peer", "demonet.cli", "demonet.joined"),
     ("demonet.loop.local",)),
    # Built-in tasks are training code too: a peer that builds one pulls in no service.
    (("demonet.tasks",), NETWORK + ("demonet.transport",) + SERVICES, ()),
    # Transports import no service, and the protocols no network library.
    (("demonet.transport",), SERVICES + ("demonet.train", "hivemind"), ()),
    (("demonet.transport",), NETWORK, GRPC_TRANSPORT),
    # DHT mode does not go through the gRPC transport; the coordinator knows nothing of the DHT.
    (("demonet.dht",), ("grpc", *GRPC_TRANSPORT, "demonet.coordinator", "demonet.peer"), ()),
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
    (("demonet.coordinator.rounds", "demonet.dht.rules", "demonet.dht.freeze_rules", "demonet.dht.keys"),
     NETWORK + ("asyncio", "torch.distributed") + SERVICES, ()),
])
def test_imports_go_one_way(layer: tuple[str, ...], forbidden: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    assert not _violations(layer, forbidden, allowed)


TRAINING_MAY_IMPORT = ("demonet.optim", "demonet.errors", "demonet.config", "demonet.train", "demonet.wire.digest")
"""The training side's demonet imports: the math layer, the errors, the run's config and the parameter digest (a
leaf of the wire layer); nothing that moves bytes or runs rounds."""


def test_training_and_config_import_only_the_layers_below() -> None:
    bad = [f"{m} imports {n}" for m, p in SOURCES.items() if _within(m, ("demonet.train", "demonet.tasks"))
           for n in _imports(p) if n.startswith("demonet.") and not _within(n, TRAINING_MAY_IMPORT)]
    bad += [f"{m} imports {n}" for m in ("demonet.config", "demonet.config_net") for n in _imports(SOURCES[m])
            if n.startswith("demonet.") and not _within(n, ("demonet.optim", "demonet.errors", "demonet.config_net"))]
    assert not bad


def test_the_checker_sees_a_lazy_relative_import(tmp_path: Path) -> None:
    """The table above can fail: an import inside a function, written relative, is found."""
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from ..coordinator import local\n")
    assert "demonet.coordinator.local" in _imports(path, module="demonet.train.x")


def test_math_and_training_pull_in_no_network_code_at_run_time() -> None:
    code = ("import sys, demonet.optim, demonet.train.model, demonet.train.data, demonet.loop.round_loop; "
            "print(','.join(m for m in ('grpc', 'hivemind', 'demonet.coordinator', 'demonet.dht') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"pulled in {out.stdout.strip()}"



def _demonet_imports(path: Path, module: str) -> set[str]:
    """The demonet modules `module` imports by name, lazy and type-checking imports too: `from P import x` is P.x
    where that is a module, else P (the parent packages Python imports first are not edges of their own)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in SOURCES)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - (node.level - 1)]
                                + ([node.module] if node.module else []))
            for a in node.names:
                if f"{base}.{a.name}" in SOURCES:
                    found.add(f"{base}.{a.name}")
                elif base in SOURCES:
                    found.add(base)
    found.discard(module)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_package_has_an_import_cycle() -> None:
    graph = {module: _demonet_imports(path, module) for module, path in SOURCES.items()}
    assert not _cycles(graph)


def test_the_cycle_check_sees_a_type_checking_import_and_finds_cycles(tmp_path: Path) -> None:
    """The check above can fail: an import made only for type checking is an edge, and a cycle is found."""
    path = tmp_path / "submit.py"
    path.write_text("from typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    from .server import CoordinatorServicer\n")
    assert _demonet_imports(path, "demonet.coordinator.submit") == {"demonet.coordinator.server"}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"c"}}) == []
