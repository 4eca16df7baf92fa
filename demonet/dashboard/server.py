"""A small HTTP/1.1 server for the dashboard, on the caller's asyncio event loop (GET and HEAD only).

Standard library only. The page, its script and its style are files of this package, served from
memory; nothing loads from elsewhere (the Content-Security-Policy forbids it). The JSON document is
built when asked, on the loop that owns the data, so it needs no lock.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

__all__ = ["Route", "page_routes", "start_http"]

logger = logging.getLogger(__name__)

Route = Callable[[Mapping[str, str]], tuple[str, bytes]]
"""A page: the query's parameters -> (content type, body)."""

READ_TIMEOUT_S = 10.0
"""How long a client may take to send its request line and headers."""
WRITE_TIMEOUT_S = 10.0
"""How long a client may take to read the answer."""
_HEAD_LIMIT = 16 * 1024  # request line and headers; the dashboard's requests are a few hundred bytes
_HEADERS = ("Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\nReferrer-Policy: no-referrer\r\n"
            "Content-Security-Policy: default-src 'none'; script-src 'self'; style-src 'self'; "
            "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'\r\n"
            "Connection: close\r\n")
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


def _asset(name: str) -> bytes:
    return resources.files("demonet.dashboard").joinpath(name).read_bytes()


def page_routes(document: Callable[[int | None], dict[str, Any]]) -> dict[str, Route]:
    """The dashboard's paths: the page, its script and style, and `/status.json` built by `document(since)`.

    `/status.json?since=R` holds only the rounds after R (the page asks for what it does not have).
    """
    page, script, style = _asset("page.html"), _asset("dashboard.js"), _asset("dashboard.css")

    def status(query: Mapping[str, str]) -> tuple[str, bytes]:
        since = query.get("since", "")
        doc = document(int(since) if since.lstrip("-").isdigit() else None)
        return "application/json", json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()

    html = "text/html; charset=utf-8"
    return {"/": lambda q: (html, page), "/index.html": lambda q: (html, page),
            "/dashboard.js": lambda q: ("text/javascript; charset=utf-8", script),
            "/dashboard.css": lambda q: ("text/css; charset=utf-8", style), "/status.json": status}


def _answer(code: int, content_type: str, body: bytes, *, head: bool = False) -> bytes:
    start = (f"HTTP/1.1 {code} {_REASONS[code]}\r\nContent-Type: {content_type}\r\n"
             f"Content-Length: {len(body)}\r\n{_HEADERS}\r\n").encode()
    return start if head else start + body


def _respond(routes: Mapping[str, Route], request_line: str) -> bytes:
    parts = request_line.split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return _answer(400, "text/plain", b"bad request\n")
    method, target, _ = parts
    if method not in ("GET", "HEAD"):
        return _answer(405, "text/plain", b"only GET and HEAD\n")
    path, _, query = target.partition("?")
    route = routes.get(path)
    if route is None:
        return _answer(404, "text/plain", b"not found\n", head=method == "HEAD")
    content_type, body = route({k: v[-1] for k, v in parse_qs(query).items()})
    return _answer(200, content_type, body, head=method == "HEAD")


async def start_http(routes: Mapping[str, Route], host: str, port: int) -> asyncio.Server:
    """Serve `routes` on HOST:PORT (port 0: any free one; the server's sockets say which).

    Each connection carries one request; a client slower than `READ_TIMEOUT_S` / `WRITE_TIMEOUT_S`
    is dropped. Close the returned server to stop.
    """
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            writer.write(_respond(routes, head.split(b"\r\n", 1)[0].decode("latin-1")))
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as e:
            logger.debug("dashboard: dropped a connection: %s", type(e).__name__)
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port, limit=_HEAD_LIMIT)
