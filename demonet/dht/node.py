"""One peer's hivemind DHT node: the DHT process, its libp2p streams, and the signed records of the run.

Net layer: imports hivemind and psutil (the optional extra ``dht``). Knows DHT keys, records and their
TTLs, not what a round does with them (demonet.dht.board, exchange and donor build on it). Must not
import grpc or demonet.transport.grpc.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
import time
from typing import Any

import hivemind
import psutil
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from demonet._proto import demonet_pb2 as pb
from demonet.errors import PeerUnavailable

from .streams import DhtOptions, HmacValidator, Streams, now

__all__ = ["DhtNode"]

logger = logging.getLogger(__name__)


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


_READY_MIN_S = 30.0
_READY_MAX_S = 60.0
"""How long one start of the DHT process may take to be ready (bootstrap included) before it is killed
and started again: a wait without a bound would hang the thread that waits, and the event loop that
waits for that thread at exit, if the process never gets ready."""


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
    with this peer's id as the subkey, signed by `HmacValidator`.
    """

    def __init__(self, opts: DhtOptions, peer_id: str, dht: Any, p2p: Any) -> None:
        self.opts, self.peer_id = opts, peer_id
        self.dht: Any = dht
        self.p2p: Any = p2p
        self.address = str(p2p.peer_id)
        """This peer's libp2p peer id, which other peers dial."""
        self.streams = Streams(opts, peer_id, p2p)

    @classmethod
    async def start(cls, opts: DhtOptions, peer_id: str) -> DhtNode:
        """Start this peer's DHT node (a p2pd daemon); `streams.open()` then serves the handlers given to it.

        The initial peers may not be up yet (they start at the same time, or restart): the node is
        started again every few seconds for up to ``bootstrap_timeout_s``.

        Raises:
            PeerUnavailable: no initial peer could be reached in that time.
        """
        give_up_at = time.monotonic() + opts.bootstrap_timeout_s
        while True:
            try:
                ready_s = min(_READY_MAX_S, max(_READY_MIN_S, give_up_at - time.monotonic()))
                dht = await asyncio.to_thread(_start_process, ready_s, initial_peers=list(opts.initial_peers) or None,
                                              host_maddrs=list(opts.host_maddrs),
                                              announce_maddrs=list(opts.announce_maddrs) or None,
                                              client_mode=opts.client_mode, identity_path=opts.identity_path,
                                              record_validators=[HmacValidator(opts.token.encode())])
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
        return cls(opts, peer_id, dht, await dht.replicate_p2p())

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

    async def store(self, key: str, value: dict[str, Any]) -> None:
        """Store this peer's record under `key` for `ttl_s`, waiting at most exchange_timeout_s for the replicas.

        A replica that does not answer in time (a node cut off: its dial hangs) is logged, not fatal:
        the nodes that answered hold the record, and a reader that finds none treats it as missing.
        """
        try:
            async with asyncio.timeout(self.opts.exchange_timeout_s):
                ok = await self.dht.store(key, json.dumps(value), expiration_time=now() + self.ttl_s,
                                          subkey=self.peer_id, return_future=True)
        except TimeoutError:
            logger.warning("[%s] the DHT did not confirm storing %s within %s s (a node does not answer)",
                           self.peer_id, key, self.opts.exchange_timeout_s)
            return
        if not ok:
            logger.debug("[%s] a DHT node did not store %s", self.peer_id, key)

    async def get(self, key: str) -> dict[str, dict[str, Any]]:
        """The valid records under `key` by subkey; nothing if the DHT does not answer within exchange_timeout_s."""
        try:
            async with asyncio.timeout(self.opts.exchange_timeout_s):
                found = await self.dht.get(key, latest=True, return_future=True)
        except TimeoutError:
            logger.warning("[%s] the DHT did not answer a search for %s", self.peer_id, key)
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}
        out = {}
        for subkey, item in found.value.items():
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                value = json.loads(item.value)
                if isinstance(subkey, str) and isinstance(value, dict):
                    out[subkey] = value
        return out
