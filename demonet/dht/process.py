"""The hivemind DHT process of one peer: its start, its end with the peer, and the coroutines that run inside it.

hivemind runs the DHT node in a process of its own (`hivemind.DHT`); `DhtNode` (demonet.dht.node) talks to
it. The coroutines here run in that process (`hivemind.DHT.run_coroutine`) and reach into hivemind's node:
its routing table, its protocol and its local storage.

Net layer: imports hivemind and psutil (the optional extra ``dht``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import hivemind
import psutil

from . import keys
from .sockets import remove_sockets, use_own_sockets

__all__ = ["READY_MAX_S", "READY_MIN_S", "REPLICAS", "DhtProcess", "local_records", "ping_and_refresh",
           "start_process", "store_records"]

logger = logging.getLogger(__name__)


async def ping_and_refresh(addresses: list[str], dht: Any, node: Any) -> int:
    """Run inside the DHT's process (`hivemind.DHT.run_coroutine`): ping `addresses` (each ping adds both ends
    to the other's routing table), then look up this node's nearest neighbours. Returns how many nodes the
    routing table gained."""
    from hivemind.p2p import PeerID

    table = node.protocol.routing_table
    before = len(table.uid_to_peer_id)
    pings = [node.protocol.call_ping(PeerID.from_base58(a)) for a in addresses]
    await asyncio.gather(*pings, return_exceptions=True)
    await node.find_nearest_nodes([node.node_id])
    return max(len(table.uid_to_peer_id) - before, 0)


async def store_records(records: list[tuple[str, str, str, float]], also: list[str], dht: Any, node: Any
                         ) -> tuple[bool, bool]:
    """Run inside the DHT process (`hivemind.DHT.run_coroutine`): store records of dictionary values, each
    (key, subkey, value, expiration time). Returns whether a node stored each one (all of them), and
    whether they went to every node of the routing table and of `also` (libp2p addresses) at once.

    hivemind's store first searches for the ``num_replicas`` nodes nearest to each key (a find call to
    every node it meets), then stores at them, one call per node and key. When this node's routing
    table holds fewer nodes than that, the search can only end with all of them and this node: its own
    start searched the DHT for its neighbours, and every node that met it since is in the table (a run
    of up to `REPLICAS` peers). Then the records go to each of them in one call, and to this node,
    without the search, and to the nodes of `also` that the table lacks (after a partition, every call
    that failed across it dropped the other side from the table). A larger table takes hivemind's own store.
    """
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.p2p import PeerID

    protocol = node.protocol
    table = protocol.routing_table
    if len(table.uid_to_peer_id) >= node.num_replicas:
        done = await node.store_many([k for k, _, _, _ in records], [v for _, _, v, _ in records],
                                     [e for _, _, _, e in records], subkeys=[s for _, s, _, _ in records])
        return all(done.values()), False
    key_ids, values = [], []
    stored = []
    for key, subkey, value, expiration_time in records:
        key_id = DHTID.generate(source=key)
        record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                           expiration_time)
        if protocol.record_validator is not None:
            record = DHTRecord(record.key, record.subkey, protocol.record_validator.sign_value(record),
                               expiration_time)
        key_ids.append(key_id)
        values.append(record.value)
        stored.append(bool(protocol.storage.store(key_id, record.value, expiration_time, subkey=subkey)))
    peers = {str(peer): peer for peer in table.uid_to_peer_id.values()}
    for address in also:
        if address not in peers and address != str(node.peer_id):
            peers[address] = PeerID.from_base58(address)
    answers = await asyncio.gather(*(protocol.call_store(peer, keys=key_ids, values=values,
                                                         expiration_time=[e for _, _, _, e in records],
                                                         subkeys=[s for _, s, _, _ in records])
                                     for peer in peers.values()))
    return all(here or any(a and a[i] for a in answers) for i, here in enumerate(stored)), True


_arrivals: set[asyncio.Future[None]] = set()
"""The looks of `local_records` waiting in this DHT process for the next record stored on its node."""


def _wake_on_stores(storage: Any) -> None:
    """Make each record stored on this node (another node's store, or this one's) wake the looks that wait
    for records (`local_records`), once per DHT process: they sleep until then, and use no CPU while the
    peers they wait for still train on the same cores."""
    if getattr(storage, "_wakes_looks", False):
        return

    def waking(store: Callable[..., bool]) -> Callable[..., bool]:
        def store_and_wake(*args: Any, **kwargs: Any) -> bool:
            stored = store(*args, **kwargs)
            for arrival in _arrivals:
                if not arrival.done():
                    arrival.set_result(None)
            _arrivals.clear()
            return stored
        return store_and_wake

    # hivemind's store RPC calls `store_subkey` itself for a dictionary's records, and `store` otherwise.
    storage.store, storage.store_subkey = waking(storage.store), waking(storage.store_subkey)
    storage._wakes_looks = True


async def local_records(key: str, wait_for: frozenset[str], wait_s: float, dht: Any, node: Any) -> Any:
    """Run inside the DHT process: the records under `key` in this node's own storage, as `DHT.get` returns
    them (a `ValueWithExpiration` of subkey -> `ValueWithExpiration`, signatures stripped), or None. No
    call leaves the process: these are the records other nodes stored here (and this node's own).

    It waits up to `wait_s` until a record of each peer id in `wait_for` is there (records arrive here
    as the other nodes store them); `wait_for` empty: at once."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.timed_storage import ValueWithExpiration

    protocol = node.protocol
    _wake_on_stores(protocol.storage)
    key_id = DHTID.generate(source=key)
    until = time.monotonic() + wait_s
    while True:
        found = protocol.storage.get(key_id)
        if not wait_for or time.monotonic() >= until:
            break
        items = found.value.items() if found is not None and isinstance(found.value, DictionaryDHTValue) else ()
        here = {c[0] for c in (keys.parse_subkey(k) if isinstance(k, str) else None for k, _ in items) if c}
        if wait_for <= here:
            break
        arrival = asyncio.get_running_loop().create_future()
        _arrivals.add(arrival)
        try:  # until the next record stored here, or the end of the wait
            await asyncio.wait_for(arrival, max(0.0, until - time.monotonic()))
        except TimeoutError:
            pass
        finally:
            _arrivals.discard(arrival)
    if found is None or not isinstance(found.value, DictionaryDHTValue):
        return None
    out = {}
    for subkey, (value_bytes, expiration_time) in found.value.items():
        if protocol.record_validator is not None:
            record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), value_bytes, expiration_time)
            value_bytes = protocol.record_validator.strip_value(record)
        out[subkey] = ValueWithExpiration(protocol.serializer.loads(value_bytes), expiration_time)
    return ValueWithExpiration(out, found.expiration_time)


def _end(*_: object) -> None:
    """End the DHT process now, and its p2pd daemon with it, and remove the daemon's sockets."""
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):  # gone already, or not ours to signal
            child.terminate()
    remove_sockets()
    os._exit(0)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    _end()


class DhtProcess(hivemind.DHT):  # type: ignore[misc]
    """hivemind's DHT process, made to end with the peer that started it.

    The fork copies the peer's asyncio signal handlers, which only wake the peer's own event loop: a
    SIGTERM would leave the DHT process (and its p2pd daemon) running after the peer is gone, and so
    would a peer killed with SIGKILL. Here SIGTERM and SIGINT end it, and so does its parent's death;
    every way it ends removes its daemon's sockets, and the next DHT process to start on the machine
    removes those of one that was killed (`sweep_sockets`).
    """

    def run(self) -> None:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _end)
        threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="dht-watch").start()
        use_own_sockets()
        try:
            super().run()
        finally:
            remove_sockets()


READY_MIN_S = 10.0
READY_MAX_S = 20.0
"""How long one start of the DHT process may take to be ready (bootstrap included) before it is killed
and started again: a wait without a bound would hang the thread that waits, and the event loop that
waits for that thread at exit, if the process never gets ready. A start takes seconds; now and then
one never gets ready (seen after a first start that found the initial peers not listening yet), and
it must leave time for another start within ``bootstrap_timeout_s``."""
REPLICAS = 8
"""The nodes that hold each record (hivemind's default is 5): a run of up to 8 peers stores every record
on every node, in one call each and without a search first (`store_records`)."""


_EXIT_S = 5.0
"""How long a DHT process that reported its failure to start has to end by itself before it is killed."""
_LOCK_S = 1.0
"""How long one of hivemind's cross-process locks may stay held before it counts as held by a process
that is gone (`_free_hivemind_locks`)."""


def _free_hivemind_locks() -> None:
    """Make sure hivemind's cross-process locks are free before a DHT process is forked.

    hivemind's futures (`hivemind.utils.mpfuture`) keep three `multiprocessing.Lock`s shared by this
    process and every process forked from it; a DHT process takes `MPFuture._update_lock` to send a
    result to this one, its readiness included. A process killed while it holds one leaves it held for
    good: every DHT process started after that blocks on it when it reports ready, and never gets ready.
    A lock still held after `_LOCK_S` is such a lock (what it guards takes microseconds to
    milliseconds): it is replaced. Processes forked before keep the old one, as they must (they share
    it with this one); none of them can take it anyway.
    """
    import multiprocessing as mp

    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    for owner, name in ((MPFuture, "_update_lock"), (MPFuture, "_initialization_lock"), (SharedBytes, "_lock")):
        lock = getattr(owner, name)
        if lock.acquire(timeout=_LOCK_S):
            lock.release()
            continue
        logger.warning("hivemind's %s.%s is held by a process that ended inside it: using a new one",
                       owner.__name__, name)
        setattr(owner, name, mp.Lock())


def start_process(ready_s: float, **kwargs: Any) -> DhtProcess:
    """Start the DHT process and wait up to `ready_s` for it to be ready; kill it if it is not.

    Raises:
        RuntimeError: the process failed to start, or was not ready in time ("bootstrap failed": worth
            another try while the initial peers start).
    """
    _free_hivemind_locks()
    dht = DhtProcess(start=False, **kwargs)
    dht.run_in_background(await_ready=False)
    try:
        dht.wait_until_ready(timeout=ready_s)
    except BaseException as e:
        if not isinstance(e, TimeoutError):
            # It reported its failure and ends by itself: killed at once, it could die right after the
            # report and before it let go of hivemind's update lock (`_free_hivemind_locks`). Seen: every
            # start after one that found the initial peers not listening yet was never ready.
            dht.join(_EXIT_S)
        if dht.is_alive():  # SIGTERM: `_end` takes its p2pd daemon with it
            dht.terminate()
            dht.join(5.0)
            if dht.is_alive():
                dht.kill()
                dht.join(5.0)
        if isinstance(e, TimeoutError):
            raise RuntimeError(f"DHTNode bootstrap failed: the DHT process was not ready within {ready_s:.0f} s"
                               ) from None
        raise
    return dht
