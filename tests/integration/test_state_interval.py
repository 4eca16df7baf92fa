"""`demonet coordinator --state-every-s`: a real coordinator process on loopback, driven by a raw gRPC peer.

The state is written at the first round and then at most every `--state-every-s`; a kill -9 in between
resumes at the round on disk (older, consistent: the peer loads its parameters); SIGTERM writes the
newest round's state before the process exits, though no round's close took its snapshot.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from demonet.coordinator.state import STATE_FILE
from tests.integration.test_coordinator import Coordinator, Peer
from tests.procs import Reaper

pytestmark = pytest.mark.slow


def _on_disk(c: Coordinator) -> tuple[int, str]:
    saved = torch.load(c.tmp / "state" / STATE_FILE, weights_only=False)
    return saved["rounds"]["round"], saved["digest"]


async def test_the_state_is_written_at_most_every_interval_and_in_full_at_the_end(
        tmp_path: Path, reap_children: Reaper) -> None:
    c = Coordinator(tmp_path, reap_children, extra=("--state-every-s", "600"))
    peer = Peer(c.start(), "p")
    assert await peer.join() == 0
    await peer.step(0)
    first = peer.digest()
    c.wait_saved(1)  # the first round is written at once: nothing was written before
    for r in (1, 2, 3):
        _, closed = await peer.step(r)
        assert closed.param_digest == peer.digest()
    time.sleep(0.5)  # time enough for a write the interval did not hold back
    assert _on_disk(c) == (1, first), "a round within the interval was written"

    c.kill()  # SIGKILL: the rounds since the last write are lost, and the run resumes where the file is
    peer = Peer(c.start(), "p", identity=peer.identity)
    assert await peer.join() == 1 and peer.digest() == first  # it loads the parameters of round 1
    status = await peer.status()
    assert (status.round, status.param_digest) == (1, first)
    for r in (1, 2):
        _, closed = await peer.step(r)
        assert closed.param_digest == peer.digest()
    last = peer.digest()

    assert c.proc is not None
    c.proc.send_signal(signal.SIGTERM)  # a clean stop writes the newest round, whatever the interval
    assert c.proc.wait(60) == 0, (tmp_path / "coordinator.log").read_text()[-2000:]
    assert _on_disk(c) == (3, last)


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_bad_interval_is_refused(tmp_path: Path, value: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "demonet.coordinator", "--listen", "127.0.0.1:0",
                           "--state-dir", str(tmp_path / "state"), "--state-every-s", value],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "DEMONET_TOKEN": "t"})
    assert proc.returncode == 2 and "--state-every-s should be >= 0" in proc.stderr, proc.stderr
    assert not (tmp_path / "state").exists()
