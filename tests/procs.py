"""What a test needs to run real processes: a free loopback port, and a `Reaper` that ends every
process it was given (and its process group, for a peer whose p2pd daemon lives in it) and
closes the log files it opened. tests/conftest.py wraps a Reaper in the `reap_children` fixture."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

Proc = subprocess.Popen[Any] | BaseProcess
"""A child started with subprocess, or with multiprocessing (torch.multiprocessing's spawn included)."""
P = TypeVar("P", bound=Proc)

__all__ = ["Proc", "Reaper", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(proc: Proc) -> bool:
    return proc.poll() is None if isinstance(proc, subprocess.Popen) else proc.is_alive()


def _wait(proc: Proc, timeout_s: float) -> None:
    """Reap `proc`, waiting at most timeout_s; a Popen still running raises subprocess.TimeoutExpired."""
    if isinstance(proc, subprocess.Popen):
        proc.wait(timeout=timeout_s)
    else:
        proc.join(timeout_s)


class Reaper:
    """The processes and log files of one test. `close()` (the fixture's teardown) SIGKILLs every
    process still running, then closes the files; `stop` and `kill` end some of them before that.

    A process added with ``group=True`` was started in a session of its own (``start_new_session``)
    and is killed with its whole process group: the children it left behind die with it, also after
    it has exited itself. Any other process is signalled by its pid alone, and only while it runs.
    """

    def __init__(self, wait_s: float = 10.0) -> None:
        self.wait_s = wait_s
        """How long a killed process is waited for (it cannot ignore SIGKILL: this bounds a stuck reap)."""
        self.procs: list[Proc] = []
        self.files: list[IO[Any]] = []
        self._groups: set[int] = set()  # ids of the processes killed with their group

    def add(self, proc: P, *, group: bool = False) -> P:
        """Register a started process; returns it."""
        self.procs.append(proc)
        if group:
            self._groups.add(id(proc))
        return proc

    def open(self, path: Path, mode: str = "ab") -> IO[Any]:
        """Open a log file for a child's stdout or stderr; it is closed at `close()`."""
        f = open(path, mode)
        self.files.append(f)
        return f

    def _signal(self, proc: Proc, sig: int) -> None:
        pid = proc.pid
        assert pid is not None, "a process is added once started"
        if id(proc) in self._groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)
        elif _alive(proc):
            os.kill(pid, sig)

    def kill(self, proc: Proc) -> None:
        """SIGKILL (nothing is flushed on the way out), its group too if so added, and reap it."""
        self._signal(proc, signal.SIGKILL)
        _wait(proc, self.wait_s)

    def stop(self, procs: Iterable[Proc], grace_s: float) -> None:
        """SIGTERM (a graceful stop) to each process still running, then `kill` whatever is left after
        grace_s (one deadline for them all). Only the process itself gets SIGTERM: it stops its children."""
        procs = list(procs)
        for proc in procs:
            if _alive(proc):
                assert proc.pid is not None
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                _wait(proc, max(0.1, deadline - time.monotonic()))
            if _alive(proc):
                self.kill(proc)

    def close(self) -> None:
        """SIGKILL every process still running (and every group), reap them, close the log files."""
        for proc in self.procs:
            self._signal(proc, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                _wait(proc, self.wait_s)
        for f in self.files:
            f.close()

    def __enter__(self) -> Reaper:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
