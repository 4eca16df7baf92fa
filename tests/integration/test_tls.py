"""TLS between a coordinator and a peer, with a self-signed certificate made by openssl for the test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from demonet._proto import demonet_pb2 as pb
from demonet._proto import demonet_pb2_grpc as pbg
from tests.integration.common import self_signed_cert, tiny_config
from tests.procs import Reaper

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")]


def test_a_run_over_tls(tmp_path: Path, reap_children: Reaper) -> None:
    cert, key = self_signed_cert(tmp_path)
    (tmp_path / "run.toml").write_text(tiny_config(round_timeout_s=5.0, steps=3))
    env = {**os.environ, "DEMONET_TOKEN": "tls-token"}
    coordinator = reap_children.add(subprocess.Popen(
        [sys.executable, "-m", "demonet.coordinator", "--listen", "localhost:0", "--config", str(tmp_path / "run.toml"),
         "--tls-cert", str(cert), "--tls-key", str(key)],
        stdout=subprocess.PIPE, stderr=reap_children.open(tmp_path / "coordinator.log", "w"), text=True, env=env))
    assert coordinator.stdout is not None
    address = coordinator.stdout.readline().split()[-1]
    port = address.rsplit(":", 1)[1]
    # A plaintext client cannot talk to it.
    with grpc.insecure_channel(f"localhost:{port}") as channel:
        with pytest.raises(grpc.RpcError):
            pbg.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=5)  # type: ignore[no-untyped-call]
    peer = subprocess.run(
        [sys.executable, "-m", "demonet", "peer", "--coordinator", f"localhost:{port}", "--peer-id", "p",
         "--out", str(tmp_path / "peer"), "--threads", "1", "--tls-root-cert", str(cert)],
        capture_output=True, text=True, env=env, timeout=120)
    assert peer.returncode == 0, peer.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "peer" / "metrics-p.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [0, 1, 2]
