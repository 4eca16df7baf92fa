"""The committed demonet/_proto/ matches proto/demonet.proto and loads on protobuf >= 5.29.

Regenerates into a temp dir with scripts/gen_proto.sh, without touching the network.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "demonet" / "_proto"
SCRIPT = ROOT / "scripts" / "gen_proto.sh"
FILES = ("demonet_pb2.py", "demonet_pb2.pyi", "demonet_pb2_grpc.py")
MIN_PROTOBUF = (5, 29)  # pyproject's floor: gencode must not be newer


def _pinned() -> str:
    match = re.search(r"GRPC_TOOLS_VERSION:-([0-9.]+)", SCRIPT.read_text())
    assert match, "scripts/gen_proto.sh should pin GRPC_TOOLS_VERSION"
    return match.group(1)


def _installed() -> str | None:
    try:
        return importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError:
        return None


def _regenerate(out: Path, version: str) -> None:
    """Run the script; it installs nothing when `version` is installed or already cached."""
    env = {**os.environ, "GRPC_TOOLS_VERSION": version, "PYTHON": sys.executable}
    subprocess.run(["bash", str(SCRIPT), str(out)], check=True, env=env, capture_output=True, timeout=60)


def _descriptor(path: Path) -> str:
    match = re.search(r"AddSerializedFile\((b'.*?')\)\n", path.read_text(), re.S)
    assert match, f"no serialized descriptor in {path}"
    return match.group(1)


def test_committed_gencode_loads_on_the_oldest_supported_protobuf() -> None:
    stamp = re.search(r"# Protobuf Python Version: (\d+)\.(\d+)", (COMMITTED / "demonet_pb2.py").read_text())
    assert stamp, "demonet_pb2.py lost its gencode version stamp"
    assert (int(stamp.group(1)), int(stamp.group(2))) <= MIN_PROTOBUF, (
        "gencode newer than protobuf 5.29: regenerate with scripts/gen_proto.sh (pinned grpcio-tools)"
    )
    assert "\nimport demonet_pb2" not in (COMMITTED / "demonet_pb2_grpc.py").read_text(), "absolute import"


def test_schema_matches_proto(tmp_path: Path) -> None:
    """Whatever grpcio-tools is installed, the serialized descriptor must equal the committed one."""
    installed = _installed()
    if installed is None:
        pytest.skip("grpcio-tools is not installed (pip install -e '.[dev]')")
    _regenerate(tmp_path, installed)
    assert _descriptor(tmp_path / "demonet_pb2.py") == _descriptor(COMMITTED / "demonet_pb2.py"), (
        "proto/demonet.proto changed: run scripts/gen_proto.sh and commit demonet/_proto/"
    )


def test_committed_files_are_identical(tmp_path: Path) -> None:
    """With the pinned grpcio-tools (installed, or cached by gen_proto.sh) the files match byte for byte."""
    pinned, installed = _pinned(), _installed()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "demonet" / f"grpcio-tools-{pinned}"
    if installed != pinned and not (cache / "grpc_tools").is_dir():
        pytest.skip(
            f"grpcio-tools {installed} is installed, the committed code is from the pinned {pinned}: "
            "run scripts/gen_proto.sh once to cache it (test_schema_matches_proto still checks the schema)"
        )
    _regenerate(tmp_path, pinned)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (COMMITTED / name).read_bytes(), f"{name} is stale"
