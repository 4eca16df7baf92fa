"""The p2pd socket folders of peers that were killed are swept; those of live processes are not, nor
those where a socket still answers."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("hivemind")

from demonet.dht.sockets import sweep_sockets  # noqa: E402


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


def test_a_folder_whose_socket_answers_is_kept_whatever_its_process_id() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    root = Path(tempfile.mkdtemp(prefix="dn-sweep-", dir="/tmp"))  # short: a socket's path is at most ~100 bytes
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        answering, silent = root / f"demonet-p2p-{gone.pid}-a", root / f"demonet-p2p-{gone.pid}-b"
        answering.mkdir()
        silent.mkdir()
        listener.bind(str(answering / "p.sock"))
        listener.listen()
        closed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        closed.bind(str(silent / "p.sock"))  # bound, never listening: as a killed daemon's socket file
        closed.close()
        assert sweep_sockets(str(root)) == [str(silent)]
        assert (answering / "p.sock").exists()
    finally:
        listener.close()
        shutil.rmtree(root)
