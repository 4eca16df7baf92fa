"""The DHT-mode `Gatherer`: peers meet on a hivemind DHT and exchange payloads over its libp2p streams.

Net layer: imports hivemind (the optional extra ``dht``; nothing imports this module unless DHT mode
is asked for), the wire layer and demonet.dht.rules (the pure rules). No coordinator: every round,
members announce under a DHT key per round, freeze the same membership, reduce-scatter their payload
slices to the slices' owners and all-gather the merged slices. Every record and message carries an
HMAC of the run token.
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
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import hivemind
import torch
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload, PeerUnavailable
from demonet.optim import Payload
from demonet.transport import NotMember, Resync, RoundResult
from demonet.wire import params as wire_params
from demonet.wire.digest import param_digest
from demonet.wire.merge import decode_contribution, merge

from . import rules
from .streams import HANDLER, DhtOptions, HmacValidator, _Round, _Streams
from .streams import now as _now

__all__ = ["DhtGatherer", "DhtOptions", "HmacValidator"]

logger = logging.getLogger(__name__)

_MAX_DONORS = 4
_POLL_S = 0.05
_START_TIMEOUT_S = 600.0  # how long the first round waits for its start_peers


def _children() -> list[int]:
    """This process's child processes (Linux; elsewhere none are known)."""
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def _end(*_: object) -> None:
    """End the DHT process now, and its p2pd daemon with it."""
    for pid in _children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
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


class DhtGatherer(_Streams):
    """One peer's node in the DHT and its libp2p endpoint; a `Gatherer`. Create it with `DhtGatherer.create`.

    Timeouts (DHT time, the same clock on every peer):

    - ``window_s``: from a round's first announcement to its freeze at the latest.
    - ``exchange_timeout_s``: parts must reach their owners this long after the freeze, and merged
      slices must be fetched this long after that; a slice still missing then is asked from the
      other members, and dropped by everyone if none holds it.
    """

    def __init__(self, opts: DhtOptions, peer_id: str, specs: rules.Specs) -> None:
        self.opts, self.peer_id, self.specs = opts, peer_id, dict(specs)
        self._token = opts.token.encode()
        self.dht: Any = None
        self.p2p: Any = None
        self.address = ""
        self.expected: dict[int, set[str] | None] = {}
        """Round -> the peers its freeze waits for (None: the first round, `start_peers`)."""
        self._rounds: dict[int, _Round] = {}
        self._cond = asyncio.Condition()
        self._params: tuple[int, Callable[[], list[tuple[str, torch.Tensor]]]] | None = None
        self.refused = 0
        """Messages refused (bad MAC, another run, replayed)."""

    @classmethod
    async def create(cls, opts: DhtOptions, peer_id: str, specs: rules.Specs) -> DhtGatherer:
        """Start this peer's DHT node (a p2pd daemon) and register the stream handler.

        The initial peers may not be up yet (they start at the same time, or restart): the node is
        started again every few seconds for up to ``bootstrap_timeout_s``.

        Raises:
            PeerUnavailable: no initial peer could be reached in that time.
        """
        self = cls(opts, peer_id, specs)
        give_up_at = time.monotonic() + opts.bootstrap_timeout_s
        while True:
            try:
                self.dht = await asyncio.to_thread(
                    _DhtProcess, initial_peers=list(opts.initial_peers) or None, host_maddrs=list(opts.host_maddrs),
                    announce_maddrs=list(opts.announce_maddrs) or None, client_mode=opts.client_mode,
                    identity_path=opts.identity_path, record_validators=[HmacValidator(self._token)], start=True)
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
        self.p2p = await self.dht.replicate_p2p()
        self.address = str(self.p2p.peer_id)
        await self.p2p.add_protobuf_handler(HANDLER, self._handle, pb.DhtMessage, stream_input=True,
                                            stream_output=True)
        return self

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    async def close(self) -> None:
        if self.p2p is not None:
            with contextlib.suppress(Exception):  # the daemon may be gone already; nothing to release then
                await self.p2p.remove_protobuf_handler(HANDLER, stream_input=True, stream_output=True)
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
                await self._call(address, pb.DHT_KIND_PING, 0, timeout_s=self.opts.exchange_timeout_s)
                answered += 1
            except PeerUnavailable as e:
                if "run token" in str(e):
                    raise PermissionError(f"the peer at {maddr} refused our messages: wrong run token") from None
                logger.warning("[%s] the initial peer %s did not answer: %s", self.peer_id, maddr, e)
        return answered

    def _key(self, what: str, round: int | None = None) -> str:
        return f"demonet/{self.opts.run}/{what}" + ("" if round is None else f"/{round}")

    # -- DHT records -----------------------------------------------------------------------------------

    async def _store(self, key: str, value: dict[str, Any], ttl_s: float) -> None:
        """Store this peer's record under `key`, waiting at most exchange_timeout_s for the replicas.

        A replica that does not answer in time (a node cut off: its dial hangs) is logged, not fatal:
        the nodes that answered hold the record, and a reader that finds none treats it as missing.
        """
        try:
            async with asyncio.timeout(self.opts.exchange_timeout_s):
                ok = await self.dht.store(key, json.dumps(value), expiration_time=_now() + ttl_s,
                                          subkey=self.peer_id, return_future=True)
        except TimeoutError:
            logger.warning("[%s] the DHT did not confirm storing %s within %s s (a node does not answer)",
                           self.peer_id, key, self.opts.exchange_timeout_s)
            return
        if not ok:
            logger.debug("[%s] a DHT node did not store %s", self.peer_id, key)

    async def _get(self, key: str) -> dict[str, dict[str, Any]]:
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

    @property
    def _ttl_s(self) -> float:
        return 4 * (self.opts.window_s + 2 * self.opts.exchange_timeout_s)

    # -- joining ---------------------------------------------------------------------------------------

    async def head_round(self) -> int | None:
        """The latest round any peer of the run has started, or None if the DHT knows no run yet."""
        heads = [v.get("round") for v in (await self._get(self._key("head"))).values()]
        rounds = [r for r in heads if isinstance(r, int)]
        return max(rounds) if rounds else None

    async def register(self, rounds: Iterable[int]) -> None:
        """Ask to be admitted at these rounds (the members of the round before decide at its freeze)."""
        # At once: rounds of a small model last tens of milliseconds, less than a store takes.
        await asyncio.gather(*(self._store(self._key("join", r), {"t": _now()}, self._ttl_s) for r in rounds))

    async def publish_state(self, round: int, digest: str,
                            named_params: Callable[[], list[tuple[str, torch.Tensor]]]) -> None:
        """Say this peer starts `round` with `digest`; serve its parameters until the round ends."""
        self._params = (round, named_params)
        expected = self.expected.get(round)
        record = {"digest": digest, "address": self.address, "client": self.opts.client_mode,
                  "expected": sorted(expected) if expected is not None else None}
        await asyncio.gather(self._store(self._key("state", round), record, self._ttl_s),
                             self._store(self._key("head"), {"round": round}, self._ttl_s))

    async def admitted(self, round: int, timeout_s: float) -> bool | None:
        """Whether the members of `round` expect this peer (None: no member said so within `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = await self._get(self._key("state", round))
            lists = [tuple(v["expected"]) for v in states.values() if isinstance(v.get("expected"), list)]
            if lists:
                return self.peer_id in max(set(lists), key=lists.count)
            await asyncio.sleep(4 * _POLL_S)
        return None

    async def load_parameters(self, round: int, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
                              ) -> tuple[dict[str, torch.Tensor], int, list[str]]:
        """Load the parameters at the start of `round` from several donors, a range of tensors from each.

        The donors are the members that published the majority digest; a range whose donor fails
        or sends bad data is asked from the next donor. The whole is checked against the digest.

        Returns:
            (tensors by name, bytes received, the donors that served a range).

        Raises:
            PeerUnavailable: no donor, or a range no donor could serve.
            InvalidPayload: the assembled parameters do not match the donors' digest.
        """
        states = await self._get(self._key("state", round))
        digests = {p: v["digest"] for p, v in states.items() if isinstance(v.get("digest"), str)}
        if not digests:
            raise PeerUnavailable(f"no peer serves the parameters of round {round}")
        good = rules.majority_digest(digests)
        donors = sorted(p for p in digests if digests[p] == good and p != self.peer_id
                        and not states[p].get("client") and isinstance(states[p].get("address"), str))
        if not donors:
            raise PeerUnavailable(f"no reachable donor for the parameters of round {round}")
        lists = [v["expected"] for p, v in states.items() if p in donors and isinstance(v.get("expected"), list)]
        if lists:
            self.expected[round] = set(lists[0])
        sizes = [(name, max(1, int(torch.Size(shape).numel()) * dtype.itemsize)) for name, (shape, dtype)
                 in expected.items()]
        ranges = rules.param_ranges(sizes, min(len(donors), _MAX_DONORS))
        results = await asyncio.gather(*(self._load_range(round, i, len(ranges), names, expected, donors, states)
                                          for i, names in enumerate(ranges)))
        tensors: dict[str, torch.Tensor] = {}
        for part, _, _ in results:
            tensors.update(part)
        tensors = {name: tensors[name] for name in expected}
        if param_digest(tensors.items()) != good:
            raise InvalidPayload(f"the parameters of round {round} do not match the donors' digest")
        return tensors, sum(r[1] for r in results), sorted({r[2] for r in results})

    async def _load_range(self, round: int, i: int, n: int, names: list[str],
                          expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]], donors: list[str],
                          states: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, torch.Tensor], int, str]:
        specs = {name: expected[name] for name in names}
        errors = []
        for j in range(len(donors)):
            donor = donors[(i + j) % len(donors)]  # range i starts at donor i: different donors, different ranges
            try:
                _, data = await self._call(states[donor]["address"], pb.DHT_KIND_PARAMS, round, slice=i,
                                           num_slices=n, timeout_s=self.opts.exchange_timeout_s * 3)
                got, tensors = await asyncio.to_thread(wire_params.decode_parameters, data, expected=specs)
                if got != round:
                    raise InvalidPayload(f"{donor} sent the parameters of round {got}")
                return tensors, len(data), donor
            except (PeerUnavailable, InvalidPayload) as e:
                errors.append(f"{donor}: {e}")
                logger.warning("[%s] parameter range %d/%d from %s failed: %s; trying another donor", self.peer_id,
                               i + 1, n, donor, e)
        raise PeerUnavailable(f"no donor served parameter range {i + 1}/{n} of round {round}: {'; '.join(errors)}")

    # -- one round -------------------------------------------------------------------------------------

    async def gather(self, round: int, payload: Payload, *, loss: float, param_digest: str) -> RoundResult:
        """Announce, freeze the membership, reduce-scatter the payload's slices, all-gather the merged slices.

        See `demonet.transport.Gatherer.gather`. `RoundResult.param_digest` is empty: in DHT mode the
        digests are compared at the next round's freeze (a peer whose digest is not the majority's
        gets `Resync` there and loads the parameters again).

        Raises:
            NotMember: this peer announced after the round froze.
            Resync: this peer's parameters are not the majority's.
        """
        r = round
        announcement = {"t": _now(), "digest": param_digest, "address": self.address,
                        "client": self.opts.client_mode}
        await self._store(self._key("members", r), announcement, self._ttl_s)
        frozen, announced = await self._freeze(r)
        if self.peer_id not in frozen.members:
            raise NotMember(f"round {r} froze without this peer (announced too late)")
        digests = {p: announced[p].digest for p in frozen.members}
        good = rules.majority_digest(digests)
        members = [p for p in frozen.members if digests[p] == good]
        # Joiners admitted for the next round: registered before this freeze, minus the store latency
        # (every member reads the same records then). Read while the payloads are exchanged.
        joiners_task = asyncio.create_task(self._joiners(r + 1, frozen.deadline))
        if param_digest != good:
            self.expected[r + 1] = set(members) | await joiners_task
            raise Resync(f"round {r}: parameter digest {param_digest[:12]} is not the majority's {good[:12]}")
        owners = [p for p in members if not announced[p].client]
        if not owners:
            joiners_task.cancel()
            raise NotMember(f"round {r}: no member can be dialed (all are in client mode)")
        st = self._round(r, mine=True)
        async with self._cond:
            st.plan = rules.SlicePlan(self.specs, len(owners))
            st.owners, st.members = owners[:st.plan.n], members
            st.mdigest = rules.members_digest(members)
            st.rs_deadline = max(frozen.deadline, _now()) + self.opts.exchange_timeout_s
            st.ag_deadline = st.rs_deadline + self.opts.exchange_timeout_s
            self._cond.notify_all()
        addresses = {p: announced[p].address for p in members}
        try:
            merged = await self._exchange(r, st, payload, addresses)
        finally:
            joiners = await joiners_task
        delivered = [s for s, m in enumerate(merged) if m is not None]
        contributors = sorted({p for s in delivered for p in st.merged[s][0]})
        # The next round waits for the members whose payload and own slice made it into this one.
        dead_owners = {st.owners[s] for s, m in enumerate(merged) if m is None}
        self.expected[r + 1] = (set(contributors) - dead_owners) | joiners
        self._params = None
        if not delivered:
            return RoundResult(round=r, aggregate=None, contributors=(), param_digest="", aborted=True,
                               bytes_up=st.bytes_up, bytes_down=st.bytes_down)
        assert st.plan is not None
        agg = st.plan.join(merged)
        mine = [m if m is not None and self.peer_id in st.merged[s][0] else None for s, m in enumerate(merged)]
        kept = agg if mine == merged else st.plan.join(mine)  # restore all of the slices without this payload
        if dead_owners:
            logger.warning("[%s round=%d] dropped the slices of %s: no member holds them", self.peer_id, r,
                           ", ".join(sorted(dead_owners)))
        return RoundResult(round=r, aggregate=agg, contributors=tuple(contributors), param_digest="", aborted=False,
                           bytes_up=st.bytes_up, bytes_down=st.bytes_down, kept=kept)

    async def _joiners(self, r: int, freeze_deadline: float) -> set[str]:
        """The peers admitted at round `r`: registered for it before the previous round's freeze."""
        joins = await self._get(self._key("join", r))
        return {p for p, v in joins.items() if isinstance(v.get("t"), float | int)
                and v["t"] < freeze_deadline - self.opts.settle_s}

    async def _freeze(self, r: int) -> tuple[rules.Frozen, dict[str, rules.Announcement]]:
        """Read the round's announcements until the freeze is final (see `rules.freeze`)."""
        expected = self.expected.get(r)
        # The first round waits for its start_peers to come up; later ones freeze within window_s.
        limit = time.monotonic() + (_START_TIMEOUT_S if expected is None else self.opts.window_s * 3 + 10)
        while time.monotonic() < limit:
            read_at = _now()
            announced = {}
            for p, v in (await self._get(self._key("members", r))).items():
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    announced[p] = rules.Announcement(p, float(v["t"]), str(v["digest"]), str(v["address"]),
                                                           bool(v["client"]))
            frozen = rules.freeze(announced, expected=expected, start_peers=self.opts.start_peers,
                                       window_s=self.opts.window_s)
            if frozen is not None and (frozen.settled or read_at >= frozen.deadline + self.opts.settle_s):
                if not frozen.complete:
                    missing = sorted(set(expected or ()) - set(frozen.members))
                    logger.info("[%s round=%d] froze at the deadline with %d members%s", self.peer_id, r,
                                len(frozen.members), f" (not in: {', '.join(missing)})" if missing else "")
                return frozen, announced
            wait_s = _POLL_S
            if frozen is not None and not frozen.settled:
                wait_s = min(max(frozen.deadline + self.opts.settle_s - _now(), 0.0) + 0.001, 4 * _POLL_S)
            elif expected is None:
                wait_s = 4 * _POLL_S
            await asyncio.sleep(wait_s)
        raise PeerUnavailable(f"round {r}: could not read its membership from the DHT")

    async def _exchange(self, r: int, st: _Round, payload: Payload, addresses: Mapping[str, str]
                        ) -> list[Payload | None]:
        """Send each owner its slice, merge ours, fetch every merged slice; returns them (None: dropped)."""
        assert st.plan is not None
        plan, me = st.plan, self.peer_id
        sends = []
        for s, owner in enumerate(st.owners):
            cut = plan.cut(payload, s)
            if owner == me:
                async with self._cond:
                    st.parts.setdefault(s, {})[me] = (st.mdigest, wire.encode(cut, step=r))
                    self._cond.notify_all()
            else:
                sends.append(self._send_part(r, st, s, cut, addresses[owner]))
        merging = [self._merge(r, st, s) for s, owner in enumerate(st.owners) if owner == me]
        fetches = [self._fetch_from_owner(r, st, s, addresses[owner]) for s, owner in enumerate(st.owners)
                   if owner != me]
        await asyncio.gather(*sends, *merging, *fetches)
        missing = [s for s in range(plan.n) if s not in st.merged]
        if missing:  # ask the other members (the owner last) for what the owner could not deliver
            holders = [p for p in st.owners if p != me]
            await asyncio.gather(*(self._fetch_from_holders(
                r, st, s, [addresses[p] for p in sorted(holders, key=lambda p: p == st.owners[s])]) for s in missing))
        # Stay until every member has fetched our slices (or the phase ended): an owner that leaves
        # at once, after the run's last round, would take its slice with it.
        mine = [s for s, owner in enumerate(st.owners) if owner == me and s in st.merged]
        want = len(st.members) - 1
        async with self._cond:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, st.ag_deadline - _now())):
                    await self._cond.wait_for(lambda: all(len(st.fetched.get(s, ())) >= want for s in mine))
        return [st.merged[s][2] if s in st.merged else None for s in range(plan.n)]

    async def _send_part(self, r: int, st: _Round, s: int, cut: Payload, address: str) -> None:
        data = await asyncio.to_thread(wire.encode, cut, step=r)

        async def send(timeout_s: float) -> None:
            await self._call(address, pb.DHT_KIND_PART, r, slice=s, data=data, members_digest=st.mdigest,
                             timeout_s=timeout_s)

        error = await self._retry(send, st.rs_deadline)
        if error:
            logger.warning("[%s round=%d] slice %d: its owner did not take the part: %s", self.peer_id, r, s, error)
        else:
            st.bytes_up += len(data)

    async def _merge(self, r: int, st: _Round, s: int) -> None:
        """As the owner of slice `s`: wait for every member's part (or the deadline), merge, keep it."""
        async with self._cond:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, st.rs_deadline - _now())):
                    await self._cond.wait_for(lambda: set(st.members) <= set(st.parts.get(s, {})))
            parts = dict(st.parts.get(s, {}))
        assert st.plan is not None
        specs = st.plan.slice_specs(s)
        decoded: dict[str, Payload] = {}
        for sender in sorted(parts):
            mdigest, data = parts[sender]
            if sender not in st.members or mdigest != st.mdigest:
                logger.warning("[%s round=%d] refused the part of %s: cut for another member list", self.peer_id, r,
                               sender)
                continue
            try:
                step, part = await asyncio.to_thread(decode_contribution, data, expected=specs, rules=self.opts.rules)
                if step != r:
                    raise InvalidPayload(f"part says round {step}")
                decoded[sender] = part
            except InvalidPayload as e:
                logger.warning("[%s round=%d] refused the part of %s: %s", self.peer_id, r, sender, e)
        if not decoded:
            return
        senders = tuple(sorted(decoded))
        merged = await asyncio.to_thread(merge, [decoded[p] for p in senders], step=r, rules=self.opts.rules,
                                         expected=specs)
        async with self._cond:
            st.merged[s] = (senders, merged.data, merged.payload)
            self._cond.notify_all()
        if len(senders) < len(st.members):
            logger.info("[%s round=%d] slice %d merged without %s", self.peer_id, r, s,
                        ", ".join(sorted(set(st.members) - set(senders))))
        clipped = [p for p, f in zip(senders, merged.factors, strict=True) if f < 1.0]
        if clipped:
            logger.info("[%s round=%d] slice %d: clipped %s to the median norm", self.peer_id, r, s, ", ".join(clipped))

    async def _fetch_from_owner(self, r: int, st: _Round, s: int, address: str) -> None:
        error = await self._retry(lambda timeout_s: self._fetch(r, st, s, address, timeout_s=timeout_s),
                                  st.ag_deadline)
        if error:
            logger.warning("[%s round=%d] slice %d: not from its owner: %s", self.peer_id, r, s, error)

    async def _fetch_from_holders(self, r: int, st: _Round, s: int, addresses: list[str]) -> None:
        await asyncio.sleep(max(0.0, st.ag_deadline - _now()))  # holders answer for good only after it
        for address in addresses:
            with contextlib.suppress(PeerUnavailable, InvalidPayload):
                await self._fetch(r, st, s, address, timeout_s=self.opts.exchange_timeout_s)
                return

    async def _fetch(self, r: int, st: _Round, s: int, address: str, *, timeout_s: float) -> None:
        reply, data = await self._call(address, pb.DHT_KIND_FETCH, r, slice=s, timeout_s=timeout_s)
        assert st.plan is not None
        step, payload = await asyncio.to_thread(wire.decode, data, expected=st.plan.slice_specs(s))
        if step != r:
            raise InvalidPayload(f"merged slice says round {step}")
        async with self._cond:
            st.bytes_down += len(data)
            st.merged.setdefault(s, (tuple(reply.contributors), data, payload))
            self._cond.notify_all()

