"""Counts a DHT peer's hivemind calls: put this folder first on PYTHONPATH and set DHT_CALLS_OUT.

Every Python process then wraps hivemind's `DHTProtocol` (a peer runs its DHT node in its own process):
the calls it makes (`call_find`, `call_store`) and serves (`rpc_find`, `rpc_store`, with
the request's and the answer's protobuf bytes). Each process appends its running totals to
``$DHT_CALLS_OUT/calls-<pid>.jsonl`` every 10 calls served; `report.py` turns them into calls per round.

    mkdir -p /tmp/calls && DHT_CALLS_OUT=/tmp/calls PYTHONPATH=bench/dht_calls \
        demonet bench --systems demonet-dht-bf16 --mbit 100 --steps 60 --out /tmp/run
    python bench/dht_calls/report.py /tmp/run /tmp/calls
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

if os.environ.get("DHT_CALLS_OUT"):
    from hivemind.dht import protocol as _protocol

    _totals: dict[str, list[int]] = {}

    def _dump() -> None:
        path = os.path.join(os.environ["DHT_CALLS_OUT"], f"calls-{os.getpid()}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps({"t": time.time(), **_totals}) + "\n")

    def _served(name: str) -> None:
        handler = getattr(_protocol.DHTProtocol, name)

        @functools.wraps(handler)  # hivemind reads the handler's annotations
        async def counted(self: Any, request: Any, context: Any) -> Any:
            answer = await handler(self, request, context)
            total = _totals.setdefault(name, [0, 0, 0])
            total[0] += 1
            total[1] += request.ByteSize()
            total[2] += answer.ByteSize()
            if total[0] % 10 == 0:
                _dump()
            return answer

        setattr(_protocol.DHTProtocol, name, counted)

    def _made(name: str) -> None:
        call = getattr(_protocol.DHTProtocol, name)

        async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            _totals.setdefault(name, [0])[0] += 1
            return await call(self, *args, **kwargs)

        setattr(_protocol.DHTProtocol, name, counted)

    for _name in ("rpc_find", "rpc_store"):
        _served(_name)
    for _name in ("call_find", "call_store"):
        _made(_name)
