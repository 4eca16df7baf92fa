"""Getting back in step, bounded by time (`demonet.transport.catch_up`), and a joiner alive while
it downloads (`keep_alive` runs from before the first download), over a real coordinator process."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from demonet.errors import InvalidPayload, PeerUnavailable
from demonet.peer import run_peer
from demonet.transport import JoinInfo, NotMember, Resync, StaleRound, catch_up
from demonet.transport.grpc import GrpcClient
from tests.integration.common import metrics_rows, tiny_config


def _info(round: int) -> JoinInfo:
    return JoinInfo(peer_id="p", round=round, run_config={}, data_seed=1, round_timeout_s=1.0,
                    heartbeat_interval_s=1.0, total_rounds=0)


class _Run:
    """A run that moves on `moves` times while the member catches up: each download of a round that
    is no longer open answers StaleRound with the next one."""

    def __init__(self, moves: int) -> None:
        self.moves, self.downloads, self.joins = moves, [], 0

    async def join(self) -> JoinInfo:
        self.joins += 1
        return _info(40)

    async def download(self, round: int) -> int:
        self.downloads.append(round)
        if len(self.downloads) <= self.moves:
            raise StaleRound(f"round {round} closed", open_round=round + 1)
        return round


@pytest.mark.parametrize(("reason", "first"), [
    (NotMember("dropped"), 40), (StaleRound("late", open_round=12), 12), (Resync("other digest"), 7),
    (InvalidPayload("bad aggregate"), 8)])
async def test_each_reason_downloads_the_round_to_continue_at(reason: Exception, first: int) -> None:
    run = _Run(moves=0)
    assert await catch_up(reason, join=run.join, download=run.download, round=7, timeout_s=5.0) == first
    assert run.downloads == [first] and run.joins == (1 if isinstance(reason, NotMember) else 0)


async def test_a_fast_run_is_caught_up_with_after_more_than_five_tries() -> None:
    run = _Run(moves=12)  # rounds of milliseconds: the run moves on 12 times in a row
    got = await catch_up(StaleRound("late", open_round=3), join=run.join, download=run.download, round=2,
                         timeout_s=5.0)
    assert got == 15 and run.downloads == list(range(3, 16))


async def test_giving_up_is_bounded_by_time() -> None:
    run = _Run(moves=10**9)

    async def slow_download(round: int) -> int:
        await asyncio.sleep(0.02)
        return await run.download(round)

    t0 = time.monotonic()
    with pytest.raises(PeerUnavailable, match="could not get back in step with the coordinator in 0 s"):
        await catch_up(StaleRound("late", open_round=1), join=run.join, download=slow_download, round=0,
                       timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 3.0 and len(run.downloads) > 5


@pytest.mark.slow
async def test_a_joiner_is_alive_while_its_first_download_takes_longer_than_the_heartbeat_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The first GetParameters takes 4 s against a heartbeat timeout of 2 s: the coordinator must not
    drop the joiner meanwhile (its heartbeats run from before the download)."""
    (tmp_path / "run.toml").write_text(tiny_config(round_timeout_s=3.0, steps=3, heartbeat_interval_s=0.3,
                                                   heartbeat_timeout_s=2.0))
    log = open(tmp_path / "coordinator.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "demonet.coordinator", "--listen", "127.0.0.1:0", "--config",
                             str(tmp_path / "run.toml")], stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "DEMONET_TOKEN": "t"})
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().split()[-1]
        real = GrpcClient.get_parameters
        slow = {"first": True}

        async def get_parameters(self: GrpcClient, *args: object, **kwargs: object) -> object:
            if slow.pop("first", False):
                await asyncio.sleep(4.0)  # a slow link
            return await real(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(GrpcClient, "get_parameters", get_parameters)
        with caplog.at_level(logging.INFO):
            code = await run_peer(coordinator=address, token="t", peer_id="slow", out=tmp_path / "out", threads=1)
        assert code == 0
        coordinator_log = (tmp_path / "coordinator.log").read_text()
        assert "dropped slow" not in coordinator_log, coordinator_log
        assert "NotMember" not in caplog.text and "joining again" not in caplog.text
        rows = metrics_rows(tmp_path / "out", "slow")  # round 0 timed out while it downloaded
        assert rows and rows[-1]["round"] == 2 and all(r["contributors"] == 1 for r in rows), rows
    finally:
        proc.kill()
        proc.wait()
        log.close()
