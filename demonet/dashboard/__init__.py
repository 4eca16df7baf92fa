"""The operator's dashboard: a page and its `/status.json`, served by a coordinator or a DHT peer.

Standard library only: `record` keeps what the page shows (bounded, pure), `server` serves it over
HTTP on the caller's event loop. Imports no grpc, no hivemind, no torch and no other demonet module;
the coordinator and DHT mode each feed a `RunRecord` and describe their run (docs/dashboard.md).
"""

from .record import SCHEMA, RunRecord
from .server import page_routes, start_http

__all__ = ["SCHEMA", "RunRecord", "page_routes", "start_http"]
