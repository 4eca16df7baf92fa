"""Where a token file's bytes come from, by byte range: a local file, an ``http(s)://`` server (the standard
library's `http.client`, one kept-alive connection, `Range` requests) or any other fsspec URL such as ``s3://``
(fsspec, imported only then; ``pip install 'demonet[remote]'`` for S3).

Imports the standard library (fsspec lazily): no torch, no demonet service. Failures keep their kinds:
`FileNotFoundError` (no such file or object: not tried again), `ValueError` (a server that cannot serve ranges)
and any other `OSError` (a connection refused, lost or timed out: worth another try).
"""

from __future__ import annotations

import http.client
import os
import re
import threading
import urllib.parse
from pathlib import Path
from typing import Any, Protocol

__all__ = ["FileSource", "FsspecSource", "HttpSource", "Source", "is_url", "open_source"]

TIMEOUT_S = 30.0
"""How long an HTTP connect, or a wait for the next bytes of a response, may take before it counts as failed."""
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class Source(Protocol):
    """One file's bytes, read by range."""

    location: str
    """The path or URL, for messages."""

    def read(self, offset: int, length: int) -> bytes:
        """`length` bytes from `offset`, or fewer where the file or the connection ends first."""

    def read_all(self) -> bytes:
        """The whole file (a small one: a sidecar)."""

    def close(self) -> None: ...


def is_url(location: str | Path) -> bool:
    """Whether `location` is a URL (``scheme://...``) rather than a local path; ``file://`` counts as a path."""
    return isinstance(location, str) and "://" in location and not location.startswith("file://")


def open_source(location: str | Path, *, timeout_s: float = TIMEOUT_S) -> Source:
    """The source of `location`: a path (or ``file://``), an ``http(s)://`` URL, or another fsspec URL.

    Raises:
        ImportError: an fsspec URL without fsspec, or without the package of its scheme (s3fs for ``s3://``).
    """
    if not is_url(location):
        return FileSource(Path(str(location).removeprefix("file://")))
    assert isinstance(location, str)
    if location.startswith(("http://", "https://")):
        return HttpSource(location, timeout_s=timeout_s)
    return FsspecSource(location)


class FileSource:
    """A local file, read with `os.pread` (no seek shared between threads)."""

    def __init__(self, path: Path) -> None:
        self.location = str(path)
        self._path = path
        self._fd: int | None = None

    def read(self, offset: int, length: int) -> bytes:
        if self._fd is None:
            self._fd = os.open(self._path, os.O_RDONLY)
        return os.pread(self._fd, length, offset)

    def read_all(self) -> bytes:
        return self._path.read_bytes()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class HttpSource:
    """An HTTP(S) URL, read with ``Range: bytes=A-B`` over one kept-alive connection (reopened after a failure).

    A server that answers a range with the whole file (200, no ranges) is refused rather than downloaded.
    """

    def __init__(self, url: str, *, timeout_s: float = TIMEOUT_S) -> None:
        parts = urllib.parse.urlsplit(url)
        if not parts.hostname:
            raise ValueError(f"{url} names no host")
        self.location = url
        self._parts, self._timeout_s = parts, timeout_s
        self._target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()  # one request at a time on the connection (the prefetch thread shares it)

    def read(self, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        with self._lock:
            status, headers, body = self._request({"Range": f"bytes={offset}-{offset + length - 1}"})
        if status == 416:
            return b""  # the range starts past the end: a file shorter than its header says
        if status != 206:
            raise ValueError(f"{self.location}: the server answered a byte range with HTTP {status}, not 206 "
                             "Partial Content; serve the file from a server that supports Range requests")
        match = _CONTENT_RANGE.fullmatch(headers.get("content-range", ""))
        if match is None or int(match[1]) != offset:
            raise ConnectionError(f"{self.location}: a range response for bytes {offset}- came with Content-Range "
                                  f"{headers.get('content-range')!r}")
        return body[:length]

    def read_all(self) -> bytes:
        with self._lock:
            status, _, body = self._request({})
        if status != 200:
            raise ValueError(f"{self.location}: HTTP {status}, not 200")
        return body

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _request(self, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        """One GET on the kept-alive connection: (status, lowercased headers, body). A body cut short comes back
        short (the caller sees the missing bytes); a 404 is FileNotFoundError; a 5xx or a failed connection an
        OSError to try again."""
        try:
            conn = self._conn or self._connect()
            conn.request("GET", self._target, headers=headers)
            response = conn.getresponse()
            try:
                body = response.read()
            except http.client.IncompleteRead as e:
                self._drop()
                body = e.partial
            if response.will_close:
                self._drop()
        except (OSError, http.client.HTTPException) as e:
            self._drop()
            if isinstance(e, OSError):
                raise
            raise ConnectionError(f"{self.location}: {type(e).__name__}: {e}") from e
        if response.status == 404:
            raise FileNotFoundError(f"{self.location} not found (HTTP 404)")
        if response.status >= 500:
            raise ConnectionError(f"{self.location}: HTTP {response.status} {response.reason}")
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body

    def _connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self._parts.scheme == "https" else http.client.HTTPConnection
        self._conn = kind(self._parts.hostname or "", self._parts.port, timeout=self._timeout_s)
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class FsspecSource:
    """Any fsspec URL (``s3://bucket/key``, ``gcs://...``); credentials and endpoints come from the scheme's usual
    settings (for S3: the AWS environment variables or config files, ``AWS_ENDPOINT_URL`` included)."""

    def __init__(self, url: str) -> None:
        try:
            import fsspec.core
        except ImportError as e:
            raise ImportError(f"{url}: reading this URL needs fsspec: pip install 'demonet[remote]'") from e
        try:
            fs, path = fsspec.core.url_to_fs(url)
        except ImportError as e:
            raise ImportError(f"{url}: {e} (for s3://: pip install 'demonet[remote]')") from e
        self.location = url
        self._fs: Any = fs
        self._path: str = path

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self._fs.cat_file(self._path, start=offset, end=offset + length))

    def read_all(self) -> bytes:
        return bytes(self._fs.cat_file(self._path))

    def close(self) -> None:
        pass
