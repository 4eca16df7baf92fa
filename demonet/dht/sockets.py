"""Where hivemind's unix sockets go: a folder of each process's own, removed as it ends or swept once it is gone.

Net layer: imports hivemind and psutil (the optional extra ``dht``).
"""

from __future__ import annotations

import contextlib
import os
import shutil

import psutil

__all__ = ["SOCKETS_ROOT", "remove_sockets", "sweep_sockets", "use_own_sockets"]


SOCKETS_ROOT = "/tmp"
"""Where a peer (and any other process that runs hivemind's P2P) keeps the unix sockets of its p2pd
connections, in a folder of its own named ``demonet-p2p-<pid>-*``. hivemind puts them straight into /tmp
and removes them only when its P2P shuts down in order: a peer killed would leave them behind every time.
A short fixed root, not ``$TMPDIR``: a unix socket's path is limited to about 100 bytes."""
_SOCKETS_PREFIX = "demonet-p2p-"
_sockets: tuple[int, str] | None = None
"""(the process id, its socket folder), set by `use_own_sockets` in each process that uses hivemind's P2P."""


def sweep_sockets(root: str = SOCKETS_ROOT) -> list[str]:
    """Remove the socket folders of processes that are gone (killed, so that nothing of theirs could
    remove them); returns the folders removed. A folder whose process id is alive is left alone, whoever
    holds that id now, and so is one where a socket still answers (its process lives in another pid
    namespace that shares this /tmp, as a container's may)."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            pid = entry.name[len(_SOCKETS_PREFIX):].split("-", 1)[0]
            if (not entry.name.startswith(_SOCKETS_PREFIX) or not pid.isdigit() or psutil.pid_exists(int(pid))
                    or _answers(entry.path)):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _answers(folder: str) -> bool:
    """Whether a unix socket in `folder` accepts a connection (somebody listens on it)."""
    import socket

    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock, contextlib.suppress(OSError):
                sock.settimeout(1.0)
                sock.connect(entry.path)
                return True
    return False


def use_own_sockets() -> None:
    """Put the p2pd sockets that this process makes from now on (hivemind's P2P: a peer's daemon
    and its client), and multiprocessing's if it has made none yet, into a folder of this
    process's own, made once; sweep those of processes that are gone first. `remove_sockets` removes it,
    and so does this process's normal exit."""
    global _sockets
    import multiprocessing.util
    import tempfile

    from hivemind.p2p import P2P

    if _sockets is None or _sockets[0] != os.getpid():  # a forked process makes its own
        sweep_sockets()
        _sockets = (os.getpid(), tempfile.mkdtemp(prefix=f"{_SOCKETS_PREFIX}{os.getpid()}-", dir=SOCKETS_ROOT))
        P2P._UNIX_SOCKET_PREFIX = f"/unix{_sockets[1]}/hivemind-"  # read by P2P.create and P2P.replicate
        # At exit, after multiprocessing's finalizers that unlink its sockets (as it removes its own folder).
        multiprocessing.util.Finalize(None, remove_sockets, exitpriority=-100)
        config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
        if config.get("tempdir") is None:  # multiprocessing's own sockets (its listeners) go there too
            config["tempdir"] = _sockets[1]


def remove_sockets() -> None:
    """Remove this process's socket folder, if it made one (its sockets are no longer needed: at its end)."""
    if _sockets is not None and _sockets[0] == os.getpid():
        shutil.rmtree(_sockets[1], ignore_errors=True)
