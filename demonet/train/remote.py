"""Verified shards of a token file from any source (demonet.train.sources): each shard fetched by byte range,
checked against its SHA-256 in the sidecar, tried again with backoff when the bytes are bad or the server is
down, kept in a bounded on-disk cache (least recently used first out) and a few in memory, and the next ones
fetched in a background thread while the current batch trains.

Imports numpy, tenacity, the standard library and the shard and source modules: no torch, no demonet service.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import tenacity

from .shards import ShardMismatch, ShardTable, TokenDataError
from .sources import Source

__all__ = ["DEFAULT_CACHE_BYTES", "DEFAULT_RETRY", "RetryPolicy", "ShardCache", "ShardReader", "default_cache_dir",
           "fetch"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

DEFAULT_CACHE_BYTES = 4 * 2**30
"""The on-disk cache's default size cap (all pins under one cache folder together)."""
_NUMPY: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/demonet/tokens``, else ``~/.cache/demonet/tokens``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "demonet" / "tokens"


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How a read that failed (bad bytes, a server down) is tried again before the peer stops."""

    attempts: int = 8
    """Tries in all, the first included."""
    first_wait_s: float = 0.2
    """The wait before the second try; each next one doubles, up to `max_wait_s`."""
    max_wait_s: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.first_wait_s < 0 or self.max_wait_s < self.first_wait_s:
            raise ValueError(f"retry should have attempts >= 1 and 0 <= first_wait_s <= max_wait_s, got {self}")


DEFAULT_RETRY = RetryPolicy()


def _transient(e: BaseException) -> bool:
    """Worth another try: bad bytes (a range cut short, a byte flipped in transit) or a server unreachable for now.
    A missing file and a server that cannot serve ranges are not."""
    return isinstance(e, ShardMismatch) or (isinstance(e, OSError) and not isinstance(
        e, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError))


def fetch(what: str, read: Callable[[], _T], retry: RetryPolicy) -> _T:
    """`read()`, tried again with exponential backoff while it fails with a transient error; after the last try,
    TokenDataError naming `what`, the tries and the last failure."""
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(retry.attempts), reraise=True,
        wait=tenacity.wait_exponential(multiplier=retry.first_wait_s, max=retry.max_wait_s),
        retry=tenacity.retry_if_exception(_transient),
        before_sleep=lambda state: logger.warning("%s: try %d failed (%s); trying again", what, state.attempt_number,
                                                  state.outcome.exception() if state.outcome else None))
    try:
        return retrying(read)
    except Exception as e:
        if not _transient(e):
            raise
        raise TokenDataError(f"{what}: still failing after {retry.attempts} tries: {e}") from e


class ShardCache:
    """Verified shards on disk, one folder per pin under `root`, at most `cap_bytes` in all: the least recently
    used shard files go first. Files are written whole (a temp file, then a rename), so a peer killed mid-write
    leaves none half-written; a shard read back is checked again by its caller."""

    def __init__(self, root: Path, pin: str, cap_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if cap_bytes < 0:
            raise ValueError(f"cache_bytes should be >= 0, got {cap_bytes}")
        self.folder, self.cap_bytes = root / pin, cap_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._sizes: dict[Path, int] = {}  # every shard file under root, oldest use first
        found = [(e.stat().st_mtime, Path(e.path), e.stat().st_size)
                 for d in os.scandir(root) if d.is_dir() for e in os.scandir(d.path) if e.name.endswith(".shard")]
        for _, path, size in sorted(found):
            self._sizes[path] = size

    def get(self, index: int) -> bytes | None:
        path = self._path(index)
        try:
            data = path.read_bytes()
            os.utime(path)
        except FileNotFoundError:
            return None
        with self._lock:
            self._sizes.pop(path, None)
            self._sizes[path] = len(data)
        return data

    def put(self, index: int, data: bytes) -> None:
        if len(data) > self.cap_bytes:
            return
        path = self._path(index)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        with self._lock:
            self._sizes.pop(path, None)
            self._sizes[path] = len(data)
            while sum(self._sizes.values()) > self.cap_bytes:
                oldest = next(iter(self._sizes))
                del self._sizes[oldest]
                oldest.unlink(missing_ok=True)

    def drop(self, index: int) -> None:
        with self._lock:
            self._sizes.pop(self._path(index), None)
        self._path(index).unlink(missing_ok=True)

    def get_meta(self) -> tuple[bytes, bytes] | None:
        """The header and sidecar this folder's pin names, if saved."""
        try:
            return (self.folder / "header").read_bytes(), (self.folder / "sidecar").read_bytes()
        except FileNotFoundError:
            return None

    def put_meta(self, header: bytes, sidecar: bytes) -> None:
        for name, data in (("header", header), ("sidecar", sidecar)):
            tmp = self.folder / f"{name}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, self.folder / name)

    def _path(self, index: int) -> Path:
        return self.folder / f"{index:010d}.shard"


class ShardReader:
    """A token file's shards as verified arrays of ids, from one source, fetched only when asked for.

    Every shard's bytes are checked against the sidecar before use: fetched, read back from the cache, or read
    from a local file. Bad bytes and failed reads are tried again (`retry`); after the last try the read raises
    TokenDataError (ShardMismatch's message names the shard) and nothing of that shard is returned or cached.
    """

    def __init__(self, source: Source, table: ShardTable, pin: str, *, cache: ShardCache | None = None,
                 retry: RetryPolicy = DEFAULT_RETRY, keep: int = 8, meta_s: float | None = None) -> None:
        """Sets up the reader; nothing is fetched until `shard` or `prefetch`.

        Args:
            source: the token file's bytes.
            table: its sidecar.
            pin: its pin (`demonet.train.shards.pin_of`).
            cache: where verified shards are kept across restarts; None: nowhere (a local file).
            retry: how failed reads are tried again.
            keep: verified shards kept in memory.
            meta_s: the seconds its opener took to read the header and sidecar, for the one line the reader logs
                when its first shard is in (INFO); None: not known.
        """
        self.source, self.table, self.pin, self.cache, self.retry = source, table, pin, cache, retry
        self.bytes_fetched = 0
        """Bytes read from the source for shards (not from the cache)."""
        self._meta_s, self._logged = meta_s, False
        self._dtype = _NUMPY[table.itemsize]
        self._keep = max(2, keep)
        self._memory: OrderedDict[int, npt.NDArray[Any]] = OrderedDict()
        self._pending: dict[int, Future[npt.NDArray[Any]]] = {}
        self._lock = threading.Lock()
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="demonet-prefetch")

    def shard(self, index: int) -> npt.NDArray[Any]:
        """Shard `index`'s ids, (tokens_of(index),), read-only; waits for a prefetch of it that is under way.

        Raises:
            TokenDataError: the shard could not be read and verified after the retries.
            IndexError: no such shard.
        """
        with self._lock:
            if index in self._memory:
                self._memory.move_to_end(index)
                return self._memory[index]
            future, mine = self._claim(index)
        if mine:
            self._run(index, future)
        return future.result()

    def prefetch(self, indices: list[int]) -> None:
        """Starts fetching the shards of `indices` not yet in memory, in the background; a failure there is raised
        by the `shard` call that needs it."""
        with self._lock:
            for index in indices:
                if index not in self._memory:
                    future, mine = self._claim(index)
                    if mine:
                        self._prefetcher.submit(self._run, index, future)

    def close(self) -> None:
        self._prefetcher.shutdown(wait=True, cancel_futures=True)
        self.source.close()

    def _claim(self, index: int) -> tuple[Future[npt.NDArray[Any]], bool]:
        """The load of `index` under way, or a new one that the caller must run (True). Under the lock."""
        if index in self._pending:
            return self._pending[index], False
        self._pending[index] = Future()
        return self._pending[index], True

    def _run(self, index: int, future: Future[npt.NDArray[Any]]) -> None:
        """Loads shard `index` into memory and settles `future` with it, or with the error."""
        start_s = time.monotonic()
        try:
            data, how = self._cached(index), "from the cache"
            if data is None:
                data = fetch(f"shard {index} of {self.source.location}", lambda: self._fetch(index), self.retry)
                how = "fetched" if self.cache is not None else "read"
                if self.cache is not None:
                    self.cache.put(index, data)
            ids = np.frombuffer(data, dtype=self._dtype)
            with self._lock:
                self._memory[index] = ids
                while len(self._memory) > self._keep:
                    self._memory.popitem(last=False)
            self._log_first(index, len(data), how, time.monotonic() - start_s)
            future.set_result(ids)
        except BaseException as e:  # handed to whoever waits on the future, which raises it
            future.set_exception(e)
        finally:
            with self._lock:
                self._pending.pop(index, None)

    def _log_first(self, index: int, num_bytes: int, how: str, seconds: float) -> None:
        """One INFO line per reader, for its first shard in: what a peer waits for before its first batch."""
        with self._lock:
            if self._logged:
                return
            self._logged = True
        meta = "" if self._meta_s is None else f"; the header and sidecar took {self._meta_s:.3f} s"
        logger.info("the first shard of %s in: shard %d, %d bytes, %s and verified in %.3f s%s", self.source.location,
                    index, num_bytes, how, seconds, meta)

    def _cached(self, index: int) -> bytes | None:
        """The shard from the cache if it is there and still matches its hash; a bad copy is deleted."""
        if self.cache is None:
            return None
        data = self.cache.get(index)
        if data is None:
            return None
        try:
            self.table.verify(index, data, f"the cache {self.cache.folder}")
        except ShardMismatch as e:
            logger.warning("%s; fetching it again", e)
            self.cache.drop(index)
            return None
        return data

    def _fetch(self, index: int) -> bytes:
        offset, length = self.table.byte_range(index)
        data = self.source.read(offset, length)
        with self._lock:
            self.bytes_fetched += len(data)
        self.table.verify(index, data, self.source.location)
        return data
