"""One peer's hivemind DHT node: its libp2p streams and the signed records of the run (hivemind's node on
this process's event loop, its p2pd daemon, and the coroutines that reach into the node: demonet.dht.hive).

Net layer: imports hivemind (the optional extra ``dht``). Knows DHT keys, records and their
TTLs, not what a round does with them (demonet.dht.board, exchange and donor build on it). Must not
import grpc or demonet.transport.grpc.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterable
from typing import Any

from google.protobuf.message import DecodeError
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload, PeerUnavailable
from demonet.wire.identity import Identity, fingerprint

from . import keys
from .deadlines import now
from .hive import READY_MAX_S, READY_MIN_S, Hive, local_records, ping_and_refresh, serve_store, store_records
from .options import DhtOptions
from .streams import Reply, Streams
from .validators import VOUCHED, HmacValidator, KeyValidator

__all__ = ["DhtNode"]

logger = logging.getLogger(__name__)


class DhtNode:
    """This peer's DHT node and libp2p endpoint (`streams`); stores and reads the run's signed records.

    Create it with `DhtNode.start`. Records are JSON objects stored under ``demonet/<run>/<what>[/<round>]``
    with the subkey ``<peer id>@<hex key>``, signed by this peer's key (`KeyValidator`) and the run
    token (`HmacValidator`). `book` says which key counts for each peer id; `get` reads only its records.
    """

    def __init__(self, opts: DhtOptions, peer_id: str, hive: Hive, identity: Identity) -> None:
        self.opts, self.peer_id, self.identity = opts, peer_id, identity
        self.hive: Hive | None = hive
        self.p2p: Any = hive.p2p
        self.address = str(hive.p2p.peer_id)
        """This peer's libp2p peer id, which other peers dial."""
        self.book = keys.KeyBook((peer_id, identity.public), opts.allowed)
        self.streams = Streams(opts, peer_id, hive.p2p, identity, self.book, self.resolve_key)
        self.streams.serve(pb.DHT_KIND_STORE, self._serve_store)
        self._ignored: set[tuple[str, bytes]] = set()  # (peer id, key) whose records were logged as ignored
        self._resolving: dict[tuple[str, int], asyncio.Task[bytes | None]] = {}  # one search per (peer id, round)
        self.everywhere = False
        """Whether the last store went to every node at once (a routing table of fewer than `REPLICAS` nodes):
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
                ready_s = min(READY_MAX_S, max(READY_MIN_S, give_up_at - time.monotonic()))
                hive = await Hive.start(ready_s, initial_peers=opts.initial_peers, host_maddrs=opts.host_maddrs,
                                        announce_maddrs=opts.announce_maddrs, client_mode=opts.client_mode,
                                        identity_path=opts.identity_path, record_validators=validators)
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
        return cls(opts, peer_id, hive, identity)

    def visible_maddrs(self) -> list[str]:
        return list(self.hive.maddrs) if self.hive is not None else []

    async def close(self) -> None:
        if self.p2p is not None:
            with contextlib.suppress(Exception):  # the daemon may be gone already; nothing to release then
                await self.streams.close()
            self.p2p = None
        if self.hive is not None:
            hive, self.hive = self.hive, None
            await hive.close()

    async def check_initial_peers(self) -> int:
        """Ping the initial peers' stream handlers; returns how many answered as peers of this run.

        While none has answered, the unanswered ones are pinged again for up to ``bootstrap_timeout_s``:
        a peer whose first ping timed out (a loaded machine, a daemon still opening its handlers) would
        otherwise go on unchecked, and one with a wrong token would then wait for a run it cannot see.

        Raises:
            PermissionError: one refused this peer's messages, or answered without the run token's HMAC.
        """
        pending = {maddr.rsplit("/p2p/", 1)[-1]: maddr for maddr in self.opts.initial_peers if "/p2p/" in maddr}
        give_up_at, answered = time.monotonic() + self.opts.bootstrap_timeout_s, 0
        failures: dict[str, PeerUnavailable] = {}
        while pending:
            for address, maddr in list(pending.items()):
                try:
                    await self.streams.call(address, pb.DHT_KIND_PING, 0, timeout_s=self.opts.exchange_timeout_s)
                except PeerUnavailable as e:
                    if "run token" in str(e):
                        raise PermissionError(f"the peer at {maddr} refused our messages: wrong run token") from None
                    failures[address] = e
                    continue
                answered += 1
                del pending[address]
            if answered or not pending or time.monotonic() >= give_up_at:
                break
            logger.info("[%s] no initial peer answered a ping yet; trying again", self.peer_id)
            await asyncio.sleep(1.0)
        for address, maddr in pending.items():
            logger.warning("[%s] the initial peer %s did not answer: %s", self.peer_id, maddr, failures[address])
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
        if not ids or self.hive is None:
            return 0
        with contextlib.suppress(TimeoutError, Exception):  # noqa: BLE001 - any failure: still cut off
            async with asyncio.timeout(self.opts.exchange_timeout_s):
                return await ping_and_refresh(self._node(), ids)
        return 0

    async def store(self, key: str, value: dict[str, Any]) -> None:
        """Store this peer's record under `key` for `ttl_s`, waiting at most exchange_timeout_s for the replicas.

        A replica that does not answer in time (a node cut off: its dial hangs) is logged, not fatal:
        the nodes that answered hold the record, and a reader that finds none treats it as missing.
        """
        await self.store_many({key: value})

    async def store_many(self, values: dict[str, dict[str, Any]], also: Iterable[str] = ()) -> bool:
        """`store` for several keys at once: in a run of a few peers, one call to each node for all of them,
        and to the nodes of `also` (libp2p addresses) as well. Sets `everywhere`. Returns whether every node
        it went to confirmed it."""
        subkey, expiration_time = keys.subkey(self.peer_id, self.identity.public), now() + self.ttl_s
        records = [(key, subkey, json.dumps(value), expiration_time) for key, value in values.items()]
        try:
            async with asyncio.timeout(self.opts.exchange_timeout_s):
                ok, self.everywhere = await store_records(self._node(), records, sorted(set(also)), links=self)
        except TimeoutError:
            logger.warning("[%s] the DHT did not confirm storing %s within %s s (a node does not answer)",
                           self.peer_id, ", ".join(values), self.opts.exchange_timeout_s)
            return False
        if not ok:
            logger.debug("[%s] a DHT node did not store %s", self.peer_id, ", ".join(values))
        return bool(ok)

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
                found = await self._node().get(key, latest=True)
        except TimeoutError:
            logger.warning("[%s] the DHT did not answer a search for %s", self.peer_id, key)
            return {}
        return self._valid(found)

    async def get_local(self, key: str, wait_for: Iterable[str] = (), wait_s: float = 0.0) -> dict[str, dict[str, Any]]:
        """`get` from this node's own storage alone, without a search: the records the other peers stored
        here. A store goes to every node of the storer's routing table at once (`store_records`), so in
        a run of a few peers this is what a search would find, less the stores that failed or are still
        on their way. It returns once the storage holds a record of each peer id in `wait_for` (their
        keys not checked yet), or after `wait_s`."""
        try:
            async with asyncio.timeout(wait_s + self.opts.exchange_timeout_s):
                found = await local_records(self._node(), key, frozenset(wait_for), wait_s)
        except TimeoutError:
            return {}
        return self._valid(found)

    def has_link(self, address: str) -> bool:
        """`hive.Linked`: whether this peer's streams hold a link to `address`."""
        return self.streams.has_link(address)

    async def store_over_link(self, address: str, request: bytes) -> list[bool] | None:
        """`hive.Linked`: a hivemind ``StoreRequest`` sent over the link to `address`; whether it stored each
        record there (None: no answer, or a refusal)."""
        from hivemind.proto import dht_pb2

        try:
            _, data = await self.streams.call(address, pb.DHT_KIND_STORE, 0, timeout_s=self.opts.exchange_timeout_s,
                                              data=request)
            return list(dht_pb2.StoreResponse.FromString(data).store_ok)
        except (PeerUnavailable, DecodeError) as e:
            logger.debug("[%s] a store over the link to %s failed: %s", self.peer_id, address, e)
            return None

    async def _serve_store(self, head: pb.DhtMessage, data: bytes | None) -> Reply:
        """The handler of a STORE call: its records stored in this node (`hive.serve_store`). The call proved
        its sender (its link's hello, or its own signature), so the sender's own records are taken without
        checking their signatures again (`streams.KeyValidator`)."""
        public = self.streams.book.key_of(head.sender)
        vouched = VOUCHED.set((head.sender, public) if public is not None else None)
        try:
            return Reply(data=await serve_store(self._node(), data or b""))
        except InvalidPayload as e:
            return Reply(error=str(e))
        finally:
            VOUCHED.reset(vouched)

    def _node(self) -> Any:
        """hivemind's DHT node. Raises PeerUnavailable once `close` has ended it."""
        if self.hive is None or self.hive.node is None:
            raise PeerUnavailable(f"[{self.peer_id}] the DHT node is closed")
        return self.hive.node

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
