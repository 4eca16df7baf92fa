"""One peer's hivemind DHT node: the DHT process, its libp2p streams, and the signed records of the run.

Net layer: imports hivemind and psutil (the optional extra ``dht``). Knows DHT keys, records and their
TTLs, not what a round does with them (demonet.dht.board, exchange and donor build on it). Must not
import grpc or demonet.transport.grpc.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterable
from typing import Any

import hivemind
import psutil
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from demonet._proto import demonet_pb2 as pb
from demonet.errors import PeerUnavailable
from demonet.wire.identity import Identity, fingerprint

from . import keys
from .streams import DhtOptions, HmacValidator, KeyValidator, Streams, now

__all__ = ["DhtNode"]

logger = logging.getLogger(__name__)


async def _ping_and_refresh(addresses: list[str], dht: Any, node: Any) -> int:
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


async def _store_records(records: list[tuple[str, str, str, float]], also: list[str], dht: Any, node: Any
                         ) -> tuple[bool, bool]:
    """Run inside the DHT process (`hivemind.DHT.run_coroutine`): store records of dictionary values, each
    (key, subkey, value, expiration time). Returns whether a node stored each one (all of them), and
    whether they went to every node of the routing table and of `also` (libp2p addresses) at once.

    hivemind's store first searches for the ``num_replicas`` nodes nearest to each key (a find call to
    every node it meets), then stores at them, one call per node and key. When this node's routing
    table holds fewer nodes than that, the search can only end with all of them and this node: its own
    start searched the DHT for its neighbours, and every node that met it since is in the table (a run
    of up to `_REPLICAS` peers). Then the records go to each of them in one call, and to this node,
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


_LOOK_EVERY_S = 0.002
"""How often `_local_records` looks at the storage while it waits for peers' records (inside the DHT process)."""


async def _local_records(key: str, wait_for: frozenset[str], wait_s: float, dht: Any, node: Any) -> Any:
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
        await asyncio.sleep(_LOOK_EVERY_S)
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
    """End the DHT process now, and its p2pd daemon with it."""
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):  # gone already, or not ours to signal
            child.terminate()
    os._exit(0)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    _end()


class _DhtProcess(hivemind.DHT):  # type: ignore[misc]
    """hivemind's DHT process, made to end with the peer that started it.

    The fork copies the peer's asyncio signal handlers, which only wake the peer's own event loop: a
    SIGTERM would leave the DHT process (and its p2pd daemon) running after the peer is gone, and so
    would a peer killed with SIGKILL. Here SIGTERM and SIGINT end it, and so does its parent's death.
    """

    def run(self) -> None:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _end)
        threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="dht-watch").start()
        super().run()


_READY_MIN_S = 10.0
_READY_MAX_S = 20.0
"""How long one start of the DHT process may take to be ready (bootstrap included) before it is killed
and started again: a wait without a bound would hang the thread that waits, and the event loop that
waits for that thread at exit, if the process never gets ready. A start takes seconds; now and then
one never gets ready (seen after a first start that found the initial peers not listening yet), and
it must leave time for another start within ``bootstrap_timeout_s``."""
_REPLICAS = 8
"""The nodes that hold each record (hivemind's default is 5): a run of up to 8 peers stores every record
on every node, in one call each and without a search first (`_store_records`)."""


def _start_process(ready_s: float, **kwargs: Any) -> _DhtProcess:
    """Start the DHT process and wait up to `ready_s` for it to be ready; kill it if it is not.

    Raises:
        RuntimeError: the process failed to start, or was not ready in time ("bootstrap failed": worth
            another try while the initial peers start).
    """
    dht = _DhtProcess(start=False, **kwargs)
    dht.run_in_background(await_ready=False)
    try:
        dht.wait_until_ready(timeout=ready_s)
    except BaseException as e:
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


class DhtNode:
    """This peer's DHT process and libp2p endpoint (`streams`); stores and reads the run's signed records.

    Create it with `DhtNode.start`. Records are JSON objects stored under ``demonet/<run>/<what>[/<round>]``
    with the subkey ``<peer id>@<hex key>``, signed by this peer's key (`KeyValidator`) and the run
    token (`HmacValidator`). `book` says which key counts for each peer id; `get` reads only its records.
    """

    def __init__(self, opts: DhtOptions, peer_id: str, dht: Any, p2p: Any, identity: Identity) -> None:
        self.opts, self.peer_id, self.identity = opts, peer_id, identity
        self.dht: Any = dht
        self.p2p: Any = p2p
        self.address = str(p2p.peer_id)
        """This peer's libp2p peer id, which other peers dial."""
        self.book = keys.KeyBook((peer_id, identity.public), opts.allowed)
        self.streams = Streams(opts, peer_id, p2p, identity, self.book, self.resolve_key)
        self._ignored: set[tuple[str, bytes]] = set()  # (peer id, key) whose records were logged as ignored
        self._resolving: dict[tuple[str, int], asyncio.Task[bytes | None]] = {}  # one search per (peer id, round)
        self.everywhere = False
        """Whether the last store went to every node at once (a routing table of fewer than `_REPLICAS` nodes):
        then the records of a run's peers arrive on each node without a search (`get_local`)."""
        self.gets = 0
        """DHT searches so far (`get`), for the round's figures; `get_local` reads are not searches."""
        if not self.book.admits(peer_id, identity.public):
            logger.warning("[%s] this peer's key %s is not on the allowlist (as %s): the others ignore it", peer_id,
                           identity.fingerprint, peer_id)

    @classmethod
    async def start(cls, opts: DhtOptions, peer_id: str, identity: Identity | None = None) -> DhtNode:
        """Start this peer's DHT node (a p2pd daemon); `streams.open()` then serves the handlers given to it.

        `identity`: this peer's Ed25519 key, which signs its records and messages (None: a new key,
        for this process alone).

        The initial peers may not be up yet (they start at the same time, or restart): the node is
        started again every few seconds for up to ``bootstrap_timeout_s``.

        Raises:
            PeerUnavailable: no initial peer could be reached in that time.
        """
        identity = identity or Identity.generate()
        validators = [KeyValidator(identity), HmacValidator(opts.token.encode())]
        give_up_at = time.monotonic() + opts.bootstrap_timeout_s
        while True:
            try:
                ready_s = min(_READY_MAX_S, max(_READY_MIN_S, give_up_at - time.monotonic()))
                dht = await asyncio.to_thread(_start_process, ready_s, initial_peers=list(opts.initial_peers) or None,
                                              host_maddrs=list(opts.host_maddrs),
                                              announce_maddrs=list(opts.announce_maddrs) or None,
                                              client_mode=opts.client_mode, identity_path=opts.identity_path,
                                              num_replicas=_REPLICAS, record_validators=validators)
                break
            except (P2PDaemonError, RuntimeError) as e:
                # P2PDaemonError: no connection to the bootstrap peers; RuntimeError("DHTNode bootstrap
                # failed: none of the initial_peers responded to a ping"): connected, but their DHT node
                # does not answer yet (it starts a moment after its daemon listens).
                if isinstance(e, RuntimeError) and "bootstrap failed" not in str(e):
                    raise
                if time.monotonic() >= give_up_at:
                    raise PeerUnavailable(f"could not join the DHT through {', '.join(opts.initial_peers)}: {e}"
                                          ) from None
                logger.info("[%s] the initial peers are not reachable yet (%s); trying again", peer_id,
                            str(e).strip().splitlines()[-1][-120:])
                await asyncio.sleep(2.0)
        return cls(opts, peer_id, dht, await dht.replicate_p2p(), identity)

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    async def close(self) -> None:
        if self.p2p is not None:
            with contextlib.suppress(Exception):  # the daemon may be gone already; nothing to release then
                await self.streams.close()
            self.p2p = None
        if self.dht is not None:
            await asyncio.to_thread(self.dht.shutdown)
            if self.dht.is_alive():  # not even SIGTERM ended it
                self.dht.kill()
                await asyncio.to_thread(self.dht.join, 5.0)
            self.dht = None

    async def check_initial_peers(self) -> int:
        """Ping the initial peers' stream handlers; returns how many answered as peers of this run.

        Raises:
            PermissionError: one refused this peer's messages, or answered without the run token's HMAC.
        """
        answered = 0
        for maddr in self.opts.initial_peers:
            address = maddr.rsplit("/p2p/", 1)[-1] if "/p2p/" in maddr else ""
            if not address:
                continue
            try:
                await self.streams.call(address, pb.DHT_KIND_PING, 0, timeout_s=self.opts.exchange_timeout_s)
                answered += 1
            except PeerUnavailable as e:
                if "run token" in str(e):
                    raise PermissionError(f"the peer at {maddr} refused our messages: wrong run token") from None
                logger.warning("[%s] the initial peer %s did not answer: %s", self.peer_id, maddr, e)
        return answered

    # -- records ---------------------------------------------------------------------------------------

    def key(self, what: str, round: int | None = None) -> str:
        return f"demonet/{self.opts.run}/{what}" + ("" if round is None else f"/{round}")

    @property
    def ttl_s(self) -> float:
        """How long a record lives: a few rounds, so that late readers still find it."""
        return 4 * (self.opts.window_s + 2 * self.opts.exchange_timeout_s)

    async def reconnect(self, addresses: Iterable[str]) -> int:
        """Ping these libp2p peers from the DHT node and look up its neighbours again, so that its routing
        table holds them: after a partition, every DHT call that failed across it dropped the other side
        from the table, and nothing else brings them back. Bounded by exchange_timeout_s; failures are
        the partition still being there. Returns how many of them were not in the table before."""
        ids = sorted({a for a in addresses if a})
        if not ids or self.dht is None:
            return 0
        with contextlib.suppress(TimeoutError, Exception):  # noqa: BLE001 - any failure: still cut off
            async with asyncio.timeout(self.opts.exchange_timeout_s):
                return int(await self.dht.run_coroutine(functools.partial(_ping_and_refresh, ids),
                                                        return_future=True))
        return 0

    async def store(self, key: str, value: dict[str, Any]) -> None:
        """Store this peer's record under `key` for `ttl_s`, waiting at most exchange_timeout_s for the replicas.

        A replica that does not answer in time (a node cut off: its dial hangs) is logged, not fatal:
        the nodes that answered hold the record, and a reader that finds none treats it as missing.
        """
        await self.store_many({key: value})

    async def store_many(self, values: dict[str, dict[str, Any]], also: Iterable[str] = ()) -> None:
        """`store` for several keys at once: in a run of a few peers, one call to each node for all of them,
        and to the nodes of `also` (libp2p addresses) as well. Sets `everywhere`."""
        subkey, expiration_time = keys.subkey(self.peer_id, self.identity.public), now() + self.ttl_s
        records = [(key, subkey, json.dumps(value), expiration_time) for key, value in values.items()]
        try:
            async with asyncio.timeout(self.opts.exchange_timeout_s):
                ok, self.everywhere = await self.dht.run_coroutine(
                    functools.partial(_store_records, records, sorted(set(also))), return_future=True)
        except TimeoutError:
            logger.warning("[%s] the DHT did not confirm storing %s within %s s (a node does not answer)",
                           self.peer_id, ", ".join(values), self.opts.exchange_timeout_s)
            return
        if not ok:
            logger.debug("[%s] a DHT node did not store %s", self.peer_id, ", ".join(values))

    async def get(self, key: str) -> dict[str, dict[str, Any]]:
        """The valid records under `key` by peer id; nothing if the DHT does not answer within exchange_timeout_s.

        A search: every node that may hold the key is asked (in a run of a few peers, every node), and
        their records are merged with this node's own. A record counts only under the key `book` holds
        for its peer id (the first one read, or the allowlist's); the records of other keys are ignored
        (logged once per peer id and key).
        """
        self.gets += 1
        try:
            async with asyncio.timeout(self.opts.exchange_timeout_s):
                found = await self.dht.get(key, latest=True, return_future=True)
        except TimeoutError:
            logger.warning("[%s] the DHT did not answer a search for %s", self.peer_id, key)
            return {}
        return self._valid(found)

    async def get_local(self, key: str, wait_for: Iterable[str] = (), wait_s: float = 0.0) -> dict[str, dict[str, Any]]:
        """`get` from this node's own storage alone, without a search: the records the other peers stored
        here. A store goes to every node of the storer's routing table at once (`_store_records`), so in
        a run of a few peers this is what a search would find, less the stores that failed or are still
        on their way. It returns once the storage holds a record of each peer id in `wait_for` (their
        keys not checked yet), or after `wait_s`."""
        try:
            async with asyncio.timeout(wait_s + self.opts.exchange_timeout_s):
                found = await self.dht.run_coroutine(functools.partial(_local_records, key, frozenset(wait_for),
                                                                       wait_s), return_future=True)
        except TimeoutError:
            return {}
        return self._valid(found)

    def _valid(self, found: Any) -> dict[str, dict[str, Any]]:
        """The records of a `DHT.get` result by peer id, each under the key `book` holds for its peer id."""
        if found is None or not isinstance(found.value, dict):
            return {}
        claims: dict[str, dict[bytes, dict[str, Any]]] = {}  # peer id -> key -> its record
        for subkey, item in found.value.items():
            claim = keys.parse_subkey(subkey) if isinstance(subkey, str) else None
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                value = json.loads(item.value)
                if claim is not None and isinstance(value, dict):
                    claims.setdefault(claim[0], {})[claim[1]] = value
        out = {}
        for peer_id, by_key in claims.items():
            chosen = self.book.choose(peer_id, by_key)
            if chosen is not None:
                out[peer_id] = by_key[chosen]
            for public in by_key.keys() - {chosen}:
                if (peer_id, public) not in self._ignored:
                    self._ignored.add((peer_id, public))
                    logger.warning("[%s] ignored the records of key %s as %s (%s)", self.peer_id, fingerprint(public),
                                   peer_id, "not on the allowlist" if not self.book.admits(peer_id, public)
                                   else "another key holds this id" if self.book.key_of(peer_id) is not None
                                   else "several keys claim this id")
        return out

    async def resolve_key(self, peer_id: str, round: int) -> bytes | None:
        """The key of `peer_id`, read from its records of `round` (an announcement, a registration for
        it, which is among the announcements of the round before, or a state) if none is known yet; one
        search per peer id and round."""
        if (known := self.book.key_of(peer_id)) is not None:
            return known
        task = self._resolving.get((peer_id, round))
        if task is None:
            if len(self._resolving) > 4096:
                self._resolving = {k: t for k, t in self._resolving.items() if not t.done()}
            task = self._resolving[peer_id, round] = asyncio.create_task(self._search_key(peer_id, round))
        return await asyncio.shield(task)

    async def _search_key(self, peer_id: str, round: int) -> bytes | None:
        for what, r in (("members", round), ("members", round - 1), ("state", round)):
            await self.get(self.key(what, r))
            if (known := self.book.key_of(peer_id)) is not None:
                return known
        return None
