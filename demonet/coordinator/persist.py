"""The coordinator's state file, written in the background: a round is published first, persisted after.

A service module: asyncio and the state file's writer (`demonet.coordinator.state.write_state`); no grpc.
The servicer takes a `Snapshot` when a round closes and hands it to a `Persister`, which writes it off
the round's critical path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from demonet.errors import StateNotSaved

from .metrics import Metrics
from .state import STATE_FILE, write_state

__all__ = ["HandOff", "Persister", "Snapshot"]

logger = logging.getLogger(__name__)

_WRITE_ERRORS = (OSError, RuntimeError)
"""What a failed write raises: OSError (no permission, no such folder), RuntimeError (torch.save's zip
writer on a full disk). Anything else is a bug and propagates."""


@dataclass(frozen=True)
class Snapshot:
    """The state of one closed round, as the state file holds it."""

    round: int
    """The round it starts (the one that opened when its round closed); a restart resumes here."""
    body: dict[str, Any]
    """What `write_state` writes: the tensors were cloned when the round closed, so nothing changes them."""


class Persister:
    """Writes the newest snapshot of the coordinator's state, in the background, one write at a time.

    `submit` never blocks the round that closed: it keeps the snapshot as the pending one and starts a
    writer task if none runs. A write in flight is never interrupted. A snapshot submitted while one
    is being written waits as the pending one; a newer one replaces it (coalesced): a slow disk costs
    the rounds a crash would lose, never the time of a round. So at most two snapshots are held (the
    one being written and the pending one), besides the live parameters.

    `due` says whether a round that closes now should be snapshotted at all: only when no write runs or
    waits, and `every_s` has passed since the last write began. A round closed while the writer is busy
    is not cloned, to be thrown away (a clone of the parameters is a copy of the model each round: for a
    large model more memory and time than the write), and `every_s` bounds how often the disk is written.

    A write that fails (a full disk, no permission) is logged as an ERROR with its traceback and
    counted (`demonet_persist_failures_total`); the rounds go on, the file on disk keeps the last
    completed write, and the next round's snapshot tries again. `flush` writes the newest snapshot
    before the process exits (trying a failed one once more) and raises `StateNotSaved` if it could
    not. A bug in the writer (any other exception) is logged at once and raised by the next `submit`
    and by `flush`.

    Args:
        state_dir: where the state file is written.
        metrics: counts failures and coalesced snapshots, times the writes, and shows the round on disk.
        write: writes one body (`write_state`; a test passes one that waits for its cue).
        on_disk: the round the state file in `state_dir` starts (a resume), None if there is none.
        every_s: the least time from one write's start to the next (0: a write whenever the writer is free).
    """

    def __init__(self, state_dir: Path, metrics: Metrics,
                 write: Callable[[Path, dict[str, Any]], None] = write_state, on_disk: int | None = None,
                 every_s: float = 0.0) -> None:
        if not every_s >= 0:
            raise ValueError(f"every_s should be >= 0, got {every_s}")
        self.state_dir, self.metrics, self._write_body, self.every_s = state_dir, metrics, write, every_s
        self._began: float | None = None  # monotonic time the last write began
        self.written_round = on_disk
        """The round the state file on disk starts (None: there is no state file)."""
        if on_disk is not None:
            metrics.persisted_round.set(on_disk)
        self._pending: Snapshot | None = None
        self._newest: Snapshot | None = None
        self._task: asyncio.Task[None] | None = None
        self._bug: BaseException | None = None
        self._failing = False  # the last write failed

    @property
    def busy(self) -> bool:
        """Whether a write is running or waiting."""
        return self._pending is not None or (self._task is not None and not self._task.done())

    def due(self) -> bool:
        """Whether the state of a round that closes now should be snapshotted and submitted: the writer is
        free and `every_s` has passed since its last write began (at once after a failed write)."""
        if self.busy:
            return False
        return self._began is None or self._failing or time.monotonic() - self._began >= self.every_s

    def submit(self, snapshot: Snapshot) -> None:
        """Persist `snapshot` in the background (it replaces a pending older one); returns at once."""
        if self._bug is not None:
            raise self._bug
        if self._pending is not None:
            self.metrics.add("persist_coalesced")
            logger.debug("[coordinator round=%d] the snapshot of round %d is replaced before its write began",
                         snapshot.round, self._pending.round)
        self._pending = self._newest = snapshot
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain(), name="persist")
            self._task.add_done_callback(self._finished)

    async def flush(self) -> None:
        """Wait for the writes under way, then make sure the newest snapshot is on disk.

        Raises:
            StateNotSaved: it could not be written (logged already).
        """
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)  # a cancelled flush leaves the write running to its end
        if self._bug is not None:
            raise self._bug
        newest = self._newest
        if newest is not None and self.written_round != newest.round:  # its write failed: once more
            logger.info("[coordinator round=%d] writing the state once more before exiting", newest.round)
            if not await self._write(newest):
                raise StateNotSaved(f"the state of round {newest.round} could not be written to "
                                    f"{self.state_dir / STATE_FILE}; it holds {self._on_disk()}")

    async def _drain(self) -> None:
        while self._pending is not None:
            snapshot, self._pending = self._pending, None
            await self._write(snapshot)

    async def _write(self, snapshot: Snapshot) -> bool:
        """Write one snapshot in a worker thread; False (logged, counted) if the write failed."""
        started = self._began = time.monotonic()
        try:
            await asyncio.to_thread(self._write_body, self.state_dir, snapshot.body)
        except _WRITE_ERRORS as e:
            self.metrics.add("persist_failures")
            logger.error("[coordinator round=%d] could not write the state to %s (%s: %s); the file still holds "
                         "%s, so a crash now would lose the rounds since; training goes on and the next round's "
                         "state tries again", snapshot.round, self.state_dir / STATE_FILE, type(e).__name__, e,
                         self._on_disk(), exc_info=not self._failing)  # one traceback per streak of failures
            self._failing = True
            return False
        seconds = time.monotonic() - started
        self.written_round = snapshot.round
        self.metrics.persisted(snapshot.round, seconds)
        if self._failing:
            self._failing = False
            logger.warning("[coordinator round=%d] the state is written again (%.3f s)", snapshot.round, seconds)
        return True

    def _on_disk(self) -> str:
        return "no state" if self.written_round is None else f"round {self.written_round}"

    def _finished(self, task: asyncio.Task[None]) -> None:
        """Log a bug in the writer at once (the next `submit` or `flush` raises it)."""
        if task.cancelled() or task.exception() is None:
            return
        self._bug = task.exception()
        logger.critical("[coordinator] the state writer failed; the next round close raises it",
                        exc_info=self._bug)


class HandOff:
    """What a coordinator gives its `Persister` after each applied round: the snapshot taken with the apply, or,
    where none was due, the round to snapshot at the end of the run (`last`).

    Args:
        persister: the writer.
    """

    def __init__(self, persister: Persister) -> None:
        self.persister = persister
        self._unsaved: tuple[int, dict[str, Any]] | None = None
        """The round the state would start after the last closed round, and the state file's extras as of its
        close, where its state was not snapshotted (the writer was busy, or wrote less than `every_s` ago)."""

    def applied(self, round: int, extra: dict[str, Any], body: dict[str, Any] | None) -> None:
        """Round `round` - 1 is applied: `body` is the parameters' snapshot taken with it (None: none was due)."""
        self._unsaved = None if body is not None else (round, extra)
        if body is not None:
            self.persister.submit(Snapshot(round, {**body, **extra}))

    async def last(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        """Hand the writer the state of the last closed round where its apply did not (at the end of the run,
        with no apply in flight: `snapshot()` is still that round's)."""
        if self._unsaved is None:
            return
        (round, extra), self._unsaved = self._unsaved, None
        self.persister.submit(Snapshot(round, {**await asyncio.to_thread(snapshot), **extra}))
