"""A peer checks the coordinator's digest of a round before its next compress, not right after its apply.

A real `demonet.coordinator.serve` (grpc.aio on loopback) whose canonical apply takes 0.3 s longer than the
peer's (a coordinator slower than its peers, as a CPU coordinator of GPU peers is), and a real `demonet
peer` process. The peer trains the next round's forward and backward while the coordinator applies, and
waits for the digest only before that round's compress. After round 1 the coordinator's parameters differ
from the peer's (the coordinator adds to one of them): the peer finds it out there, drops that backward,
downloads the run's parameters once, and ends every round on the canonical digest.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from demonet.coordinator.state import CanonicalState
from demonet.wire.digest import param_digest
from tests.integration.common import coordinator_in_process, metrics_rows

pytestmark = pytest.mark.slow

TOKEN = "digest-check-token"
STEPS = 5
APPLY_DELAY_S = 0.3
PEER_TIMEOUT_S = 120.0


async def test_a_peer_checks_the_digest_after_its_next_backward_and_resyncs_from_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_advance = CanonicalState.advance
    diverged: list[str] = []

    def slow(self: CanonicalState, round: int, applied: Any) -> str:
        time.sleep(APPLY_DELAY_S)  # a worker thread: the coordinator's loop goes on serving
        digest = real_advance(self, round, applied)
        if round == 1:  # the run's parameters are no longer the ones its peers computed
            with torch.no_grad():
                next(iter(self.params.values())).view(-1)[0] += 0.5
            self.digest = digest = param_digest(self.params.items())
            diverged.append(digest)
        return digest

    monkeypatch.setattr(CanonicalState, "advance", slow)
    out = tmp_path / "out"
    async with coordinator_in_process(tmp_path, token=TOKEN, steps=STEPS) as (address, server):
        peer = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "demonet", "peer", "--coordinator", address, "--peer-id", "a", "--out", str(out),
            "--threads", "1", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "DEMONET_TOKEN": TOKEN})
        try:
            _, stderr = await asyncio.wait_for(peer.communicate(), PEER_TIMEOUT_S)
        finally:
            if peer.returncode is None:
                peer.kill()
                await peer.wait()
        log = stderr.decode(errors="replace")
        assert peer.returncode == 0, log[-3000:]
        await asyncio.wait_for(server, 30)  # it ends after its last round
    rows = metrics_rows(out, "a")
    assert [r["round"] for r in rows] == list(range(STEPS))
    # Round 1's digest differed: found after round 2's backward, the parameters downloaded once.
    assert rows[1]["resynced"] and rows[1]["canonical_digest"] == rows[1]["param_digest"] == diverged[0]
    assert "[a round=2] digest" in log and "after applying round 1, the run has" in log, log[-3000:]
    assert rows[-1]["resyncs"] == 1 and sum(bool(r.get("resynced")) for r in rows) == 1
    assert all(r["param_digest"] == r["canonical_digest"] for r in rows), rows
    # Rounds 3 and 4 waited for the digest of the round before after their backward, not after an apply.
    for row in rows[3:]:
        assert row["phases"]["check"] >= APPLY_DELAY_S / 3 and "digest" not in row["phases"], row
        assert row["wait_s"] >= row["phases"]["check"]
