"""One peer's hivemind DHT node, in the peer's own process: its start, its p2pd daemon, which ends with the
peer, and the coroutines that reach into the node (its routing table, its protocol and its local storage).

hivemind's `DHTNode` runs on the peer's event loop, beside its streams (`DhtNode`, demonet.dht.node), and
shares their p2pd daemon. (hivemind's own `hivemind.DHT` would fork a process for it, and every call would
cross a pipe both ways: a store's record then waited for two more process wake-ups before it reached the
others, on cores the peers share.)

Net layer: imports hivemind (the optional extra ``dht``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from demonet.errors import InvalidPayload

from . import keys
from .sockets import use_own_sockets

__all__ = ["READY_MAX_S", "READY_MIN_S", "REPLICAS", "Hive", "Linked", "local_records", "ping_and_refresh",
           "serve_store", "store_records"]

logger = logging.getLogger(__name__)


async def ping_and_refresh(node: Any, addresses: list[str]) -> int:
    """Ping `addresses` from hivemind's `node` (each ping adds both ends to the other's routing table), then
    look up its nearest neighbours. Returns how many nodes the routing table gained."""
    from hivemind.p2p import PeerID

    table = node.protocol.routing_table
    before = len(table.uid_to_peer_id)
    pings = [node.protocol.call_ping(PeerID.from_base58(a)) for a in addresses]
    await asyncio.gather(*pings, return_exceptions=True)
    await node.find_nearest_nodes([node.node_id])
    return max(len(table.uid_to_peer_id) - before, 0)


async def store_records(node: Any, records: list[tuple[str, str, str, float]], also: list[str],
                        links: Linked | None = None) -> tuple[bool, bool]:
    """Store records of dictionary values from hivemind's `node`, each (key, subkey, value, expiration time).
    Returns whether a node stored each one (all of them), and whether they went to every node of the
    routing table and of `also` (libp2p addresses) at once.

    hivemind's store first searches for the ``num_replicas`` nodes nearest to each key (a find call to
    every node it meets), then stores at them, one call per node and key. When this node's routing
    table holds fewer nodes than that, the search can only end with all of them and this node: its own
    start searched the DHT for its neighbours, and every node that met it since is in the table (a run
    of up to `REPLICAS` peers). Then the records go to each of them in one call, and to this node,
    without the search, and to the nodes of `also` that the table lacks (after a partition, every call
    that failed across it dropped the other side from the table). A larger table takes hivemind's own store.

    A node that `links` holds a link to gets the records over it (`serve_store` stores them there), not in a
    hivemind store call: that call opens a libp2p stream of its own through both daemons, once per node and
    round. The node validates and stores them as hivemind's store call would.
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
    expirations, subkeys = [e for _, _, _, e in records], [s for _, s, _, _ in records]
    linked = {address for address in peers if links is not None and links.has_link(address)}
    request = b""
    if linked:
        from hivemind.proto import dht_pb2

        request = dht_pb2.StoreRequest(keys=[k.to_bytes() for k in key_ids],
                                       subkeys=[protocol.serializer.dumps(s) for s in subkeys], values=values,
                                       expiration_time=expirations, in_cache=[False] * len(values)).SerializeToString()

    async def store_at(address: str, peer: Any) -> list[bool] | None:
        if links is not None and address in linked:
            return await links.store_over_link(address, request)
        stored: list[bool] | None = await protocol.call_store(peer, keys=key_ids, values=values,
                                                               expiration_time=expirations, subkeys=subkeys)
        return stored

    answers = await asyncio.gather(*(store_at(address, peer) for address, peer in peers.items()))
    return all(here or any(a and a[i] for a in answers) for i, here in enumerate(stored)), True


class Linked(Protocol):
    """The links `store_records` may store over (`demonet.dht.node.DhtNode`)."""

    def has_link(self, address: str) -> bool:
        """Whether a link to the libp2p peer `address` is open."""

    async def store_over_link(self, address: str, request: bytes) -> list[bool] | None:
        """Send a serialized hivemind ``StoreRequest`` over the link; each record's answer, None on failure."""


async def serve_store(node: Any, request: bytes) -> bytes:
    """Store the records of a serialized hivemind ``StoreRequest`` that came over a link in hivemind `node`'s
    own storage, as hivemind's store call does (each record validated: the run token's HMAC, its peer's
    signature), and return the serialized ``StoreResponse`` (whether each was stored).

    Raises:
        InvalidPayload: not a ``StoreRequest``, or one whose lists are not of one length.
    """
    from google.protobuf.message import DecodeError
    from hivemind.proto import dht_pb2

    msg = dht_pb2.StoreRequest()
    try:
        msg.ParseFromString(request)
    except DecodeError as e:
        raise InvalidPayload(f"not a StoreRequest: {e}") from None
    if not len(msg.keys) == len(msg.subkeys) == len(msg.values) == len(msg.expiration_time) == len(msg.in_cache):
        raise InvalidPayload("a StoreRequest whose keys, subkeys, values, expiration times and cache flags differ "
                             "in number")
    msg.ClearField("peer")  # the sender's node info: hivemind's store call would ping it back
    response = await node.protocol.rpc_store(msg, None)
    serialized: bytes = response.SerializeToString()
    return serialized


def _arrivals(storage: Any) -> set[asyncio.Future[None]]:
    """The looks of `local_records` waiting for the next record stored in `storage`, a node's own storage.

    Made once per storage: from then on each record stored there (another node's store, or this one's)
    wakes them. They sleep until then, and use no CPU while the peers they wait for still train on the
    same cores."""
    arrivals: set[asyncio.Future[None]] | None = getattr(storage, "_demonet_arrivals", None)
    if arrivals is not None:
        return arrivals
    arrivals = storage._demonet_arrivals = set()

    def waking(store: Callable[..., bool]) -> Callable[..., bool]:
        def store_and_wake(*args: Any, **kwargs: Any) -> bool:
            stored = store(*args, **kwargs)
            for arrival in arrivals:
                if not arrival.done():
                    arrival.set_result(None)
            arrivals.clear()
            return stored
        return store_and_wake

    # hivemind's store RPC calls `store_subkey` itself for a dictionary's records, and `store` otherwise.
    storage.store, storage.store_subkey = waking(storage.store), waking(storage.store_subkey)
    return arrivals


async def local_records(node: Any, key: str, wait_for: frozenset[str], wait_s: float) -> Any:
    """The records under `key` in hivemind `node`'s own storage, as `DHTNode.get` returns them (a
    `ValueWithExpiration` of subkey -> `ValueWithExpiration`, signatures stripped), or None. No call
    leaves the process: these are the records other nodes stored here (and this node's own).

    It waits up to `wait_s` until a record of each peer id in `wait_for` is there (records arrive here
    as the other nodes store them); `wait_for` empty: at once."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.timed_storage import ValueWithExpiration

    protocol = node.protocol
    arrivals = _arrivals(protocol.storage)
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
        arrivals.add(arrival)
        try:  # until the next record stored here, or the end of the wait
            await asyncio.wait_for(arrival, max(0.0, until - time.monotonic()))
        except TimeoutError:
            pass
        finally:
            arrivals.discard(arrival)
    if found is None or not isinstance(found.value, DictionaryDHTValue):
        return None
    out = {}
    for subkey, (value_bytes, expiration_time) in found.value.items():
        if protocol.record_validator is not None:
            record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), value_bytes, expiration_time)
            value_bytes = protocol.record_validator.strip_value(record)
        out[subkey] = ValueWithExpiration(protocol.serializer.loads(value_bytes), expiration_time)
    return ValueWithExpiration(out, found.expiration_time)




READY_MIN_S = 10.0
READY_MAX_S = 20.0
"""How long one start of the DHT node may take (its bootstrap: the initial peers answer a ping) before it
is given up and started again. A start takes seconds; it must leave time for another start within
``bootstrap_timeout_s`` (the initial peers may not listen yet: they start at the same time)."""
REPLICAS = 8
"""The nodes that hold each record (hivemind's default is 5): a run of up to 8 peers stores every record
on every node, in one call each and without a search first (`store_records`)."""


class Hive:
    """hivemind's DHT node (`node`) on this process's event loop, and the p2pd daemon (`p2p`) it shares with
    the peer's streams. Start it with `Hive.start`; `close` ends both.

    The daemon is a child of this process, in a session of its own (`_daemon_in_own_session`). So that it
    does not outlive a peer killed with SIGKILL, a watcher (a shell's `read`, which sleeps without using
    CPU) waits for the end of a pipe that only this process holds open: when the process dies, the kernel
    closes it, and the watcher terminates the daemon. `close` stops the watcher first, so it never signals
    a process id that another process may hold by then.
    """

    def __init__(self, node: Any, p2p: Any, maddrs: Sequence[Any], watcher: subprocess.Popen[bytes] | None) -> None:
        self.node, self.p2p = node, p2p
        self.maddrs = [str(m) for m in maddrs]
        """The libp2p addresses the node is reachable at, as the daemon reported them at the start."""
        self._watcher = watcher

    @classmethod
    async def start(cls, ready_s: float, *, initial_peers: Sequence[str], host_maddrs: Sequence[str],
                    announce_maddrs: Sequence[str], client_mode: bool, identity_path: str | None,
                    record_validators: Sequence[Any]) -> Hive:
        """Start the daemon and the DHT node, and wait up to `ready_s` for the node's bootstrap.

        Raises:
            P2PDaemonError: the daemon could not start, or reach any initial peer.
            RuntimeError: the node's bootstrap failed ("bootstrap failed": no initial peer's DHT node
                answered in time; worth another try while the initial peers start).
        """
        from hivemind.dht.node import DHTNode
        from hivemind.dht.validation import CompositeValidator
        from hivemind.p2p import P2P

        use_own_sockets()
        with _daemon_in_own_session():
            p2p = await P2P.create(initial_peers=list(initial_peers) or None, host_maddrs=list(host_maddrs),
                                   announce_maddrs=list(announce_maddrs) or None, identity_path=identity_path,
                                   dht_mode="client" if client_mode else "server")
        watcher = None
        try:
            watcher = _watch_daemon(p2p)
            async with asyncio.timeout(ready_s):
                node = await DHTNode.create(p2p=p2p, initial_peers=list(initial_peers) or None,
                                            client_mode=client_mode, num_replicas=REPLICAS,
                                            record_validator=CompositeValidator(list(record_validators)))
        except BaseException as e:
            await _end_daemon(p2p, watcher)
            if isinstance(e, TimeoutError):
                raise RuntimeError(f"DHTNode bootstrap failed: the DHT node was not ready within {ready_s:.0f} s"
                                   ) from None
            raise
        return cls(node, p2p, await node.get_visible_maddrs(), watcher)

    async def close(self) -> None:
        """End the DHT node (it stops serving) and its daemon."""
        node, self.node = self.node, None
        if node is not None:
            with contextlib.suppress(Exception):  # the daemon may be gone already; nothing to release then
                await node.shutdown()
        if self.p2p is not None:
            p2p, self.p2p = self.p2p, None
            await _end_daemon(p2p, self._watcher)


@contextlib.contextmanager
def _daemon_in_own_session() -> Iterator[None]:
    """Start the p2pd daemons that hivemind's `P2P.create` spawns meanwhile in a session of their own.

    A Ctrl-C at a terminal (SIGINT), or its hangup, reaches every process of the terminal's process group:
    the daemon would end at once, while the peer's graceful stop (its open round, then its leave) still
    needs it. It ends with the peer instead (SIGTERM: `Hive.close`, or the watcher). hivemind offers no
    way to pass this to its spawn, so its call is wrapped while `P2P.create` runs; other programs are
    spawned as asked."""
    import asyncio.subprocess as aio_subprocess

    spawn = aio_subprocess.create_subprocess_exec

    async def spawn_daemon(program: Any, *args: Any, **kwargs: Any) -> Any:
        if str(program).endswith("p2pd"):
            kwargs.setdefault("start_new_session", True)
        return await spawn(program, *args, **kwargs)

    aio_subprocess.create_subprocess_exec = spawn_daemon
    try:
        yield
    finally:
        aio_subprocess.create_subprocess_exec = spawn


def _watch_daemon(p2p: Any) -> subprocess.Popen[bytes] | None:
    """Start the watcher that terminates `p2p`'s daemon once this process is gone (`Hive`)."""
    child = getattr(p2p, "_child", None)
    if child is None or child.pid is None:
        return None
    try:
        return subprocess.Popen(["/bin/sh", "-c", 'read _ignored; kill -TERM "$0" 2>/dev/null', str(child.pid)],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)  # not stopped by a terminal's Ctrl-C before its peer is
    except OSError as e:  # no /bin/sh: the daemon still ends with a peer that stops, not with one killed
        logger.warning("no watcher for the p2pd daemon (%s): it outlives this process if it is killed", e)
        return None


async def _end_daemon(p2p: Any, watcher: subprocess.Popen[bytes] | None) -> None:
    """Stop the watcher, then the daemon."""
    if watcher is not None:
        watcher.kill()  # first: once the daemon is gone, its process id may be another process's
        if watcher.stdin is not None:
            watcher.stdin.close()
        await asyncio.to_thread(watcher.wait)
    with contextlib.suppress(Exception):  # gone already
        async with asyncio.timeout(5.0):
            await p2p.shutdown()
