"""A small HTTP/1.1 file server that answers `Range: bytes=A-B` (206 Partial Content) over kept-alive connections,
for the token data tests; the standard library's http.server does not serve ranges.

Run: `python -m tests.range_server --root DIR [--port P]`; it prints `listening on PORT` when ready. It counts the
body bytes it sends (`GET /_served` answers the count as JSON, not counted) and can cut the next N range
responses short, closing the connection (`GET /_fault?truncate=N`).
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class _State:
    def __init__(self, root: Path) -> None:
        self.root, self.served, self.truncate, self.lock = root, 0, 0, threading.Lock()


def _handler(state: _State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # kept-alive connections

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            if url.path == "/_served":
                return self._send(200, json.dumps({"served": state.served}).encode(), count=False)
            if url.path == "/_fault":
                with state.lock:
                    state.truncate = int(urllib.parse.parse_qs(url.query)["truncate"][0])
                return self._send(200, b"{}", count=False)
            path = (state.root / url.path.lstrip("/")).resolve()
            if state.root not in path.parents or not path.is_file():
                return self._send(404, b"not found", count=False)
            data = path.read_bytes()
            match = _RANGE.fullmatch(self.headers.get("Range", ""))
            if match is None:
                return self._send(200, data)
            start = int(match[1])
            end = min(int(match[2]) if match[2] else len(data) - 1, len(data) - 1)
            if start >= len(data):
                return self._send(416, b"", count=False, extra={"Content-Range": f"bytes */{len(data)}"})
            with state.lock:
                cut, state.truncate = state.truncate > 0, max(0, state.truncate - 1)
            self._send(206, data[start : end + 1], extra={"Content-Range": f"bytes {start}-{end}/{len(data)}"}, cut=cut)

        def _send(self, status: int, body: bytes, *, count: bool = True, extra: dict[str, str] | None = None,
                  cut: bool = False) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            for key, value in (extra or {}).items():
                self.send_header(key, value)
            self.end_headers()
            sent = body[: len(body) // 2] if cut else body
            if count:  # before the write: a client that has the bytes finds them counted
                with state.lock:
                    state.served += len(sent)
            self.wfile.write(sent)
            if cut:  # the rest never comes: the client sees a short body and a closed connection
                self.wfile.flush()
                self.close_connection = True

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), _handler(_State(args.root.resolve())))
    server.daemon_threads = True
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
