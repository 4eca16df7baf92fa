"""A small run's records go to every DHT node at once, without hivemind's search, and every node reads them.

Three real hivemind DHT nodes (`DhtNode`, each with its p2pd daemon) on loopback, in a fresh
interpreter. Each stores a record under one key: with fewer nodes in its routing table than
``num_replicas``, the store asks no node for neighbours (`find` calls, counted on each node), and
every node's search finds all three records; two records under two keys go in one call to each node.
With ``num_replicas`` lowered below the table's size, hivemind's own store runs (it searches first),
and the record is found all the same.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.procs import Reaper

pytest.importorskip("hivemind")
pytestmark = pytest.mark.slow

_TOKEN = "store-test-token"


def _finds(node: Any) -> int:
    """The find calls hivemind's `node` made so far (counted by `_count_finds`)."""
    return int(getattr(node.protocol, "finds_made", 0))


def _table(node: Any) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def _count_finds() -> None:
    """Count every find call a DHT protocol of this interpreter makes."""
    from hivemind.dht.protocol import DHTProtocol

    call_find = DHTProtocol.call_find

    async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.finds_made = getattr(self, "finds_made", 0) + 1
        return await call_find(self, *args, **kwargs)

    DHTProtocol.call_find = counted


async def _three_nodes() -> dict[str, Any]:
    from demonet.dht.node import DhtNode
    from demonet.dht.options import DhtOptions

    _count_finds()

    def opts(initial: tuple[str, ...] = ()) -> DhtOptions:
        return DhtOptions(run="store", token=_TOKEN, initial_peers=initial, host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                          exchange_timeout_s=5.0)

    nodes: list[DhtNode] = []
    out: dict[str, Any] = {}
    try:
        nodes.append(await DhtNode.start(opts(), "a"))
        maddr = nodes[0].visible_maddrs()[0]
        nodes += [await DhtNode.start(opts((maddr,)), name) for name in ("b", "c")]
        for _ in range(100):  # each node meets the others (b and c through a)
            tables = [_table(n.hive.node) for n in nodes]
            if min(tables) == 2:
                break
            await asyncio.sleep(0.1)
        out["tables"] = tables

        def finds() -> list[int]:
            return [_finds(n.hive.node) for n in nodes]

        before = finds()
        for n in nodes:
            await n.store(n.key("members", 1), {"from": n.peer_id})
        await nodes[1].store_many({nodes[1].key("state", 1): {"round": 1}, nodes[1].key("head"): {"round": 1}})
        out["finds_direct"] = [x - y for x, y in zip(finds(), before, strict=True)]
        out["read_direct"] = [sorted(await n.get(n.key("members", 1))) for n in nodes]
        out["read_many"] = [[await n.get(n.key(what, 1 if what == "state" else None)) for what in ("state", "head")]
                            for n in nodes]

        for n in nodes:
            n.hive.node.num_replicas = 2
        before = finds()
        await nodes[2].store(nodes[2].key("members", 2), {"from": "c"})
        out["finds_search"] = [x - y for x, y in zip(finds(), before, strict=True)]
        out["read_search"] = [sorted(await n.get(n.key("members", 2))) for n in nodes]
    finally:
        for n in reversed(nodes):
            await asyncio.wait_for(n.close(), 30)
    return out


def _in_a_fresh_interpreter(reap_children: Reaper, coroutine: str, timeout_s: float) -> tuple[dict[str, Any], str]:
    """Run `asyncio.run(<coroutine>())` of this module in a new Python process; (what it returns, its stderr)."""
    import json

    code = (f"import asyncio, json; from tests.integration.test_dht_store import {coroutine}; "
            f"print(json.dumps(asyncio.run({coroutine}())))")
    proc = reap_children.add(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2],
                                              start_new_session=True), group=True)
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def test_a_small_run_stores_without_a_search_and_every_node_reads_it(reap_children: Reaper) -> None:
    found, _ = _in_a_fresh_interpreter(reap_children, "_three_nodes", 240)
    assert found["tables"] == [2, 2, 2], found
    assert found["finds_direct"] == [0, 0, 0], found  # no search: each store went to the table and itself
    assert found["read_direct"] == [["a", "b", "c"]] * 3, found
    assert found["read_many"] == [[{"b": {"round": 1}}, {"b": {"round": 1}}]] * 3, found  # two keys, one call each
    assert found["finds_search"][2] > 0, found  # 2 replicas < 3 nodes: hivemind searches for the nearest
    assert found["read_search"] == [["c"]] * 3, found
