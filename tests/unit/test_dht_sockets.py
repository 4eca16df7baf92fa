"""The p2pd socket folders of DHT processes that were killed are swept; those of live processes are not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hivemind")

from demonet.dht.process import sweep_sockets  # noqa: E402


def test_only_the_folders_of_processes_that_are_gone_are_swept(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_folder = tmp_path / f"demonet-p2p-{gone.pid}-abc"
        live_folder = tmp_path / f"demonet-p2p-{live.pid}-def"
        others = [tmp_path / "demonet-p2p-notapid-x", tmp_path / f"hivemind-p2pd-{gone.pid}.sock",
                  tmp_path / f"somebody-else-{gone.pid}-x"]
        for folder in (dead_folder, live_folder):
            folder.mkdir()
            (folder / "hivemind-p2pd-x.sock").write_bytes(b"")
        for other in others:
            other.mkdir()
        assert sweep_sockets(str(tmp_path)) == [str(dead_folder)]
        assert not dead_folder.exists()
        assert live_folder.exists() and (live_folder / "hivemind-p2pd-x.sock").exists()
        assert all(other.exists() for other in others)
        assert sweep_sockets(str(tmp_path)) == []
        assert sweep_sockets(str(tmp_path / "missing")) == []
    finally:
        live.kill()
        live.wait()
