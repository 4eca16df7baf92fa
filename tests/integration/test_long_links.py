"""A peer on a link of a long round trip: a `demonet coordinator` process, a TCP proxy process that holds
every chunk 1.5 s each way (`python -m demonet.lab.netlab proxy`, a round trip of 3 s: a congested uplink
behind a deep buffer), and a `demonet peer` process that reaches the coordinator only through it, with plaintext
and with TLS. The peer must connect (the HTTP/2 and TLS handshakes cross the link: one connection attempt
takes 1.5 s in plaintext, 6 s with TLS) and train its round."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.common import listening_line, metrics_rows, self_signed_cert, tiny_config
from tests.procs import Reaper

pytestmark = pytest.mark.slow

TOKEN = "long-links-token"
DELAY_MS = 1500
STEPS = 1
START_TIMEOUT_S = 90.0
PEER_TIMEOUT_S = 150.0  # its start, then about ten round trips to join and load, and two for its round


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_a_peer_trains_over_a_link_of_a_3_s_round_trip(tmp_path: Path, reap_children: Reaper, tls: bool) -> None:
    if tls and shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    (tmp_path / "run.toml").write_text(tiny_config(round_timeout_s=30.0))
    env = {**os.environ, "DEMONET_TOKEN": TOKEN}
    cert_args: list[str] = []
    peer_args: list[str] = []
    if tls:
        cert, key = self_signed_cert(tmp_path)
        cert_args = ["--tls-cert", str(cert), "--tls-key", str(key)]
        peer_args = ["--tls-root-cert", str(cert)]
    coordinator = reap_children.add(subprocess.Popen(
        [sys.executable, "-m", "demonet", "coordinator", "--listen", "127.0.0.1:0", "--steps", str(STEPS),
         "--config", str(tmp_path / "run.toml"), *cert_args],
        stdout=subprocess.PIPE, stderr=reap_children.open(tmp_path / "coordinator.log"), env=env))
    line = listening_line(coordinator, START_TIMEOUT_S)
    assert line.startswith("listening on "), (tmp_path / "coordinator.log").read_text()
    proxy = reap_children.add(subprocess.Popen(
        [sys.executable, "-m", "demonet.lab.netlab", "proxy", "--listen", "127.0.0.1:0", "--target", line.split()[-1],
         "--delay-ms", str(DELAY_MS)], stdout=subprocess.PIPE, stderr=reap_children.open(tmp_path / "proxy.log")))
    line = listening_line(proxy, START_TIMEOUT_S)  # "proxy listening on H:P -> H:P"
    assert line.startswith("proxy listening on "), (tmp_path / "proxy.log").read_text()
    port = line.split()[3].rsplit(":", 1)[1]
    out = tmp_path / "out"
    peer = subprocess.run(
        [sys.executable, "-m", "demonet", "peer", "--coordinator", f"localhost:{port}", "--peer-id", "far",
         "--out", str(out), "--threads", "1", "--reconnect-timeout-s", "60", *peer_args],
        capture_output=True, text=True, env=env, timeout=PEER_TIMEOUT_S)
    assert peer.returncode == 0, peer.stderr[-3000:]
    rows = metrics_rows(out, "far")
    assert [r["round"] for r in rows] == list(range(STEPS))
    assert all(math.isfinite(r["loss"]) and r["contributors"] == 1 for r in rows), rows
    # The link was in the path: a round (its upload, then the aggregate's stream) takes a round trip at least.
    assert all(r["round_time_s"] >= 2 * DELAY_MS / 1000 for r in rows), rows
    coordinator.wait(timeout=60)  # it ends after its last round
    assert coordinator.returncode == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
