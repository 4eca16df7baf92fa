"""The payload exchange of a DHT round: a sparse reduce-scatter to the slice owners, then an all-gather.

Net layer over demonet.dht.node's streams: sends each owner its part of the payload, merges the
slices this peer owns with the one merge rule (demonet.wire.merge), serves them, and fetches the
others. A seeded fraction of the slices also goes to a second owner, its verifier: every peer checks
the merged slice it fetched against the verifier's digest of the same merge, and drops a slice on
which the two disagree (docs/dht.md#verified-slices). Its calls to the other peers are the mixin
demonet.dht.exchange_calls, its handlers of theirs demonet.dht.exchange_serving. It does not decide
who is in a round (demonet.dht.board does). Must not import grpc, demonet.transport.grpc, or the round
board.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload
from demonet.optim import Payload
from demonet.wire.merge import Merged, merge

from . import rules
from .ahead import Ahead, PartsAhead, encode_parts_now
from .deadlines import now
from .exchange_calls import SliceCalls
from .exchange_serving import SliceServing
from .node import DhtNode
from .round_state import Exchanged, Outcome, RoundState, decode_part, merges_inline

__all__ = ["Exchanged", "SliceExchange"]

logger = logging.getLogger(__name__)

_KEEP_ROUNDS = 3  # rounds whose merged slices a late peer can still fetch


class SliceExchange(SliceCalls, SliceServing):
    """Reduce-scatter and all-gather of the payloads' slices over the streams; serves parts and slices.

    Timeouts (DHT time): ``exchange_timeout_s`` after the freeze, parts must have reached their owners;
    that long after, merged slices must be fetched. A slice still missing then is asked from the
    other members, and dropped by everyone if none holds it.
    """

    def __init__(self, node: DhtNode) -> None:
        self._node, self.opts, self.peer_id = node, node.opts, node.peer_id
        self._streams = node.streams
        self._rounds: dict[int, RoundState] = {}
        self._ahead = PartsAhead(node.streams, node.opts, node.peer_id)
        self._plans: dict[int, rules.SlicePlan] = {}
        self._cond = asyncio.Condition()
        self.latest = -1
        """The latest round this peer gathered for; streams about rounds far from it are refused."""
        self.capped = 0
        """Payloads (a sender in a round) whose claimed samples this peer capped in a slice it owns."""
        self._left: dict[int, tuple[str, ...]] = {}  # rounds that froze without this peer -> the members it read
        node.streams.serve(pb.DHT_KIND_PART, self._take_part)
        node.streams.serve(pb.DHT_KIND_FETCH, self._serve_slice)
        node.streams.serve(pb.DHT_KIND_CHECK, self._serve_check)

    def _round(self, r: int, *, mine: bool = False) -> RoundState:
        """The state of round `r`; `mine`: this peer starts it (older rounds are forgotten then)."""
        if mine and r > self.latest:
            self.latest = r
            for old in [k for k in self._rounds if k < r - _KEEP_ROUNDS]:
                del self._rounds[old]
        st = self._rounds.get(r)
        if st is None:  # (not setdefault: a RoundState is built only where none is held yet)
            st = self._rounds[r] = RoundState()
        return st

    def plan_for(self, specs: rules.Specs, owners: Sequence[str]) -> rules.SlicePlan:
        """The slice plan of `specs` among dialable `owners` (`rules.owner_count` slices), made once per count."""
        n = rules.owner_count(len(owners), specs, self.opts.rules.topk, self.opts.slice_entries)
        plan = self._plans.get(n)
        if plan is None or plan.specs != specs:
            plan = self._plans[n] = rules.SlicePlan(specs, n, stack=self.opts.stack_slices)
        return plan

    def _ordered(self, r: int, specs: rules.Specs, owners: Sequence[str]) -> tuple[rules.SlicePlan, list[str]]:
        """Round `r`'s plan and its dialable `owners` in `rules.owner_order`: the same for parts sent ahead."""
        plan = self.plan_for(specs, owners)
        return plan, rules.owner_order(r, owners, plan.n)

    async def left_out(self, r: int, members: Sequence[str]) -> None:
        """Round `r` froze without this peer, with these `members` as it read them. A member that counted
        this peer in (it read a record the others did not) is answered its parts with that list, as by a peer
        that froze another list (`_take_part`): it waits no longer for this peer, not until the deadlines."""
        async with self._cond:
            self._left = {q: m for q, m in self._left.items() if q > r - _KEEP_ROUNDS}
            self._left[r] = tuple(sorted(members))
            self._cond.notify_all()

    def _not_here(self, r: int) -> str | None:
        """Why calls about round `r` are refused here: it froze without this peer, or is long over or far ahead."""
        if r in self._left:
            return f"round {r} froze without this peer"
        far = r < self.latest - _KEEP_ROUNDS or (self.latest >= 0 and r > self.latest + 2)
        return f"round {r} is not kept here (at {self.latest})" if far else None

    def send_ahead(self, r: int, payload: Payload, *, specs: rules.Specs, members: Sequence[str],
                   owners: Sequence[str], addresses: Mapping[str, str],
                   encoded: tuple[rules.SlicePlan, list[bytes]] | None = None, samples: int = 1) -> None:
        """Send round `r`'s parts now, before this peer froze the round, cut for the `members` and `owners`
        it expects (sorted; `addresses` reaches them): the round before's, when that round was whole.

        The parts then travel while the last announcement does: the owners hold every part when they
        freeze, and the peer that announced last has sent its parts before its freeze. `run` takes the
        calls up where the freeze gives the same members and owners, and cancels them otherwise; an
        owner waits for the part a sender cuts once frozen in place of one sent ahead for other members
        (`RoundState.ahead`). The calls are made by a task (demonet.dht.ahead): this returns at once. The
        parts the others sent ahead for the same members are decoded from then on as they arrive. `encoded`:
        the parts encoded already (in the training's thread), and their plan; used where it is this one.
        `samples`: the payload's samples, sent with each part (its weight in the merges)."""
        (plan, owners), mdigest = self._ordered(r, specs, owners), rules.members_digest(members, owners)
        self._round(r).expect(r, plan, mdigest, self.opts.rules)

        async def parts() -> list[bytes]:
            if encoded is not None and encoded[0] is plan:
                return encoded[1]
            return await encode_parts_now(r, plan, payload)

        self._ahead.send(r, parts, plan=plan, mdigest=mdigest, owners=owners, addresses=addresses, samples=samples)

    def expect(self, r: int, *, specs: rules.Specs, members: Sequence[str], owners: Sequence[str]) -> None:
        """Round `r`'s parts will likely be cut for these `members` and `owners` (sorted): the round before's,
        which was whole. The parts that arrive from now on, while this peer still trains, are decoded as they
        come (`RoundState.decode_early`), not all at once when its own parts go ahead (`send_ahead`)."""
        st = self._round(r)
        if st.plan is None:
            st.expect(r, self.plan_for(specs, owners), rules.members_digest(members, owners), self.opts.rules)

    def drop_ahead(self, r: int) -> None:
        """Cancel the calls of round `r`'s parts sent ahead, if `run` did not take them up."""
        self._ahead.drop(r)

    async def run(self, r: int, payload: Payload, *, specs: rules.Specs, members: Sequence[str],
                  owners: Sequence[str], addresses: Mapping[str, str], frozen_at: float, samples: int = 1
                  ) -> Exchanged:
        """Exchange round `r`'s payload among `members` (sorted), `owners` (sorted, dialable) owning its slices
        (`rules.owner_count` of them, in `rules.owner_order`). `frozen_at`: the round's freeze (DHT time), from
        which the phases' deadlines run. `samples`: how many samples the payload was computed from, sent with
        each part: its weight in every slice's merge."""
        st = self._round(r, mine=True)
        async with self._cond:
            st.samples = samples
            st.mdigest = rules.members_digest(members, owners)
            st.plan, owners = self._ordered(r, specs, owners)
            st.owners, st.members, st.dialable = list(owners[:st.plan.n]), list(members), list(owners)
            st.verifiers = rules.verifiers(r, st.mdigest, owners, st.plan.n, self.opts.verify_fraction)
            st.rs_deadline = max(frozen_at, now()) + self.opts.exchange_timeout_s
            st.ag_deadline = st.rs_deadline + self.opts.exchange_timeout_s
            self._cond.notify_all()
        merged = await self._exchange(r, st, payload, addresses)
        disagreed = frozenset(p for s in st.disagreed for p in (st.owners[s], st.verifiers[s]))
        checked = sum(1 for s in st.verifiers if s in st.merged and s not in st.unverified)
        merged = [None if s in st.disagreed else m for s, m in enumerate(merged)]
        delivered = [s for s, m in enumerate(merged) if m is not None]
        contributors = tuple(sorted({p for s in delivered for p in st.merged[s][0]}))
        dead_owners = frozenset(st.owners[s] for s, m in enumerate(merged)
                                if m is None and s not in st.disagreed and st.owners[s] not in st.other_lists)
        if st.other_lists:
            logger.warning("[%s round=%d] %s froze the round with another member list", self.peer_id, r,
                           ", ".join(sorted(st.other_lists)))
        done: dict[str, Any] = dict(dead_owners=dead_owners, bytes_up=st.bytes_up, bytes_down=st.bytes_down,
                                    slice_owners=tuple(st.owners), disagreed=disagreed, checked=checked,
                                    phases=dict(st.phases), other_lists=self.other_lists(r),
                                    capped=frozenset(st.capped),
                                    claims={p: n for held in st.claims.values() for p, n in held.items()
                                            if p in contributors},
                                    topks={p: k for p, k in st.topks.items() if p in contributors})
        if not delivered:
            return Exchanged(None, None, contributors, **done)
        if dead_owners:
            logger.warning("[%s round=%d] dropped the slices of %s: no member holds them", self.peer_id, r,
                           ", ".join(sorted(dead_owners)))
        agg = st.plan.join(merged)
        mine = [m if m is not None and self.peer_id in st.merged[s][0] else None for s, m in enumerate(merged)]
        kept = agg if mine == merged else st.plan.join(mine)  # restore all of the slices without this payload
        return Exchanged(agg, kept, contributors, **done)

    async def _exchange(self, r: int, st: RoundState, payload: Payload, addresses: Mapping[str, str]
                        ) -> list[Payload | None]:
        """Send each owner its slice, merge ours, get every merged slice; returns them (None: dropped).

        An owner answers the part it is sent with its merged slice, on the same stream: one stream per
        other owner, and one per verified slice's verifier. The parts sent ahead of the freeze, if they
        were cut for the members and owners it froze, are not sent again: their calls are awaited.
        """
        ahead, unused = await self._ahead.take(r, st.mdigest, st.owners, st.verifiers)
        st.bytes_up += unused  # parts sent ahead for nothing count too
        st.phases["ahead"] = float(ahead is not None)
        try:
            return await self._exchange_parts(r, st, payload, addresses, ahead)
        finally:
            if ahead is not None:  # a call sent ahead that the exchange did not await (it was cancelled)
                ahead.cancel()

    async def _exchange_parts(self, r: int, st: RoundState, payload: Payload, addresses: Mapping[str, str],
                              ahead: Ahead | None) -> list[Payload | None]:
        assert st.plan is not None
        plan, me = st.plan, self.peer_id
        parts = ahead.parts if ahead is not None else await encode_parts_now(r, plan, payload)
        to_owners = ahead.to_owners if ahead is not None else {}
        to_verifiers = ahead.to_verifiers if ahead is not None else {}
        sends = []
        for s, owner in enumerate(st.owners):
            targets = [owner, st.verifiers[s]] if s in st.verifiers else [owner]
            if me in targets:
                async with self._cond:
                    st.parts.setdefault(s, {})[me] = (st.mdigest, parts[s])
                    st.claims.setdefault(s, {})[me] = st.samples
                    st.decode_early(r, s, me, st.mdigest, parts[s], self.opts.rules)
                    self._cond.notify_all()
            if s in st.verifiers and st.verifiers[s] != me:
                st.early[s] = asyncio.get_running_loop().create_future()
                sends.append(self._send_part(r, st, s, parts[s], addresses[st.verifiers[s]], to_verifiers.get(s)))
        t0 = time.perf_counter()

        async def verified(s: int, obtain: Any) -> None:
            """Obtain slice `s` (merge or fetch), then check it at once if it has a verifier."""
            await obtain
            if s in st.verifiers and s in st.merged:
                await self._check(r, st, s, addresses[st.verifiers[s]])

        async def timed(name: str, aws: list[Any]) -> None:
            await asyncio.gather(*aws)
            st.phases[name] = time.perf_counter() - t0

        merging = [verified(s, self._merge(r, st, s)) for s, owner in enumerate(st.owners) if owner == me]
        fetches = [verified(s, self._part_and_slice(r, st, s, parts[s], addresses[owner], to_owners.get(s)))
                   for s, owner in enumerate(st.owners) if owner != me]
        await asyncio.gather(timed("scatter", [*sends, *merging]), timed("gather", fetches))
        t1 = time.perf_counter()
        # Ask the other members (the owner last) for what the owner could not deliver; an owner that froze
        # another member list merged nothing for this one, so nobody holds that slice.
        missing = [s for s in range(plan.n) if s not in st.merged and st.owners[s] not in st.other_lists]
        if missing:
            await asyncio.gather(*(verified(s, self._fetch_from_holders(r, st, s, addresses)) for s in missing))
        t2 = time.perf_counter()
        st.phases["recover"] = t2 - t1
        # Stay until every member has fetched our slices and had its checks answered (or the phase
        # ended): an owner that leaves at once, after the run's last round, would take its slice with it.
        mine = [s for s, owner in enumerate(st.owners) if owner == me and s in st.merged]
        checking = [s for s, v in st.verifiers.items() if v == me and st.owners[s] not in st.other_lists]

        def want() -> int:  # not those of another list
            return len(set(st.members) - st.other_lists - {me})

        async with self._cond:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, st.ag_deadline - now())):
                    await self._cond.wait_for(lambda: all(len(st.fetched.get(s, ())) >= want() for s in mine)
                                              and all(len(st.asked.get(s, ())) >= want() for s in checking))
        st.phases["serve"] = time.perf_counter() - t2
        return [st.merged[s][2] if s in st.merged else None for s in range(plan.n)]

    async def _merged(self, r: int, st: RoundState, s: int, senders: Collection[str] | None = None
                      ) -> tuple[tuple[str, ...], Merged] | None:
        """The merge of slice `s` over the valid parts held here from `senders` (None: every member), and
        the senders in it (sorted); None if no part is valid, or (`senders` given) one of them is missing.

        Waits until all of them are in, or the reduce-scatter's deadline. Parts not decoded as they arrived
        (`RoundState.decode_early`) are decoded and merged in one trip to a worker thread; with none left, a
        small slice is merged on the event loop (`round_state.merges_inline`)."""
        # Every member but those that froze another member list: they send no part for this one.

        def want() -> set[str]:
            return set(st.members) - st.other_lists if senders is None else set(senders)

        async with self._cond:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, st.rs_deadline - now())):
                    await self._cond.wait_for(lambda: want() <= st.final_parts(s))
            parts = {p: v for p, v in st.parts.get(s, {}).items() if p in want()}
            claims = {p: st.claims.get(s, {}).get(p, 1) for p in parts}  # taken with the parts, under the lock
        assert st.plan is not None
        specs = st.plan.slice_specs(s)
        for sender in sorted(parts):
            if sender not in st.members or parts[sender][0] != st.mdigest:
                logger.warning("[%s round=%d] refused the part of %s: cut for another member list", self.peer_id, r,
                               sender)
                del parts[sender]
        outcomes: dict[str, Outcome] = {}
        for sender in parts if st.decoded is not None else ():
            assert st.decoded is not None  # set for the round before its parts are merged, never unset
            outcome = await st.decoded.take(s, sender, parts[sender][1], specs)
            if outcome is not None:
                outcomes[sender] = outcome
        st.phases["early"] = st.phases.get("early", 0.0) + len(outcomes)

        def decode_and_merge() -> tuple[dict[str, str], tuple[tuple[str, ...], Merged] | None]:
            for sender in parts.keys() - outcomes.keys():
                outcomes[sender] = decode_part(parts[sender][1], specs, r, self.opts.rules)
            refused = {p: str(o) for p, o in outcomes.items() if isinstance(o, InvalidPayload)}
            decoded = {p: o for p, o in outcomes.items() if not isinstance(o, InvalidPayload)}
            if not decoded or (senders is not None and set(decoded) != set(senders)):
                return refused, None
            order = tuple(sorted(decoded))
            ks.update({p: part.topk() for p, part in decoded.items()})
            merged = merge([decoded[p] for p in order], step=r, rules=self.opts.rules, expected=specs,
                           samples=[claims[p] for p in order])
            return refused, (order, merged)

        ks: dict[str, int] = {}  # the senders' k per chunk, for the dashboard
        inline = merges_inline(parts.keys() - outcomes.keys(), outcomes.values())
        refused, result = decode_and_merge() if inline else await asyncio.to_thread(decode_and_merge)
        for sender, k in ks.items():
            st.topks[sender] = max(k, st.topks.get(sender, 0))
        for sender, why in refused.items():
            logger.warning("[%s round=%d] refused the part of %s: %s", self.peer_id, r, sender, why)
        return result

    async def _merge(self, r: int, st: RoundState, s: int) -> None:
        """As the owner of slice `s`: wait for every member's part (or the deadline), merge, keep it."""
        result = await self._merged(r, st, s)
        if result is None:
            return
        # One merge gives both forms: the bytes the others fetch and the payload this owner applies,
        # which `merge` builds bit-identical to what they decode from those bytes (see its docstring).
        senders, merged = result
        async with self._cond:
            st.merged[s] = (senders, merged.data, merged.payload)
            self._cond.notify_all()
        if len(senders) < len(st.members):
            logger.info("[%s round=%d] slice %d merged without %s", self.peer_id, r, s,
                        ", ".join(sorted(set(st.members) - set(senders))))
        clipped = [p for p, f in zip(senders, merged.factors, strict=True) if f < 1.0]
        if clipped:
            logger.info("[%s round=%d] slice %d: clipped %s to the median norm", self.peer_id, r, s, ", ".join(clipped))
        capped = [p for p, c in zip(senders, merged.capped, strict=False) if c and p not in st.capped]
        if capped:  # counted once a round per sender, whatever the slices this peer owns
            st.capped.update(capped)
            self.capped += len(capped)
            logger.warning("[%s round=%d] %s claimed more samples than the cap: weighted at %g times the median of "
                           "the others'", self.peer_id, r, ", ".join(capped), self.opts.rules.max_sample_ratio)

    # -- verification ----------------------------------------------------------------------------------

    async def _digest_over(self, r: int, st: RoundState, s: int, senders: tuple[str, ...] | None
                           ) -> tuple[tuple[str, ...], bytes] | None:
        """As the verifier of slice `s`: the senders and SHA-256 of its merge over exactly `senders` (sorted;
        None: as its owner merges, over every member's part held by the reduce-scatter's deadline), once.

        The merge is one task shared by this peer's own check and the members' requests: a request whose
        caller goes away is cancelled, and must not cancel the merge the others wait for."""
        if senders is not None and (s, None) in st.checks:  # the merge of the early answers, if over those
            early = await asyncio.shield(st.checks[(s, None)])
            if early is not None and early[0] == senders:
                return early
        key = (s, senders)
        if key not in st.checks:
            async def digest() -> tuple[tuple[str, ...], bytes] | None:
                result = await self._merged(r, st, s, senders)
                return None if result is None else (result[0], hashlib.sha256(result[1].data).digest())

            st.checks[key] = asyncio.create_task(digest())
        return await asyncio.shield(st.checks[key])

    async def _froze_otherwise(self, st: RoundState, peer: str, named: Collection[str] = ()) -> None:
        """`peer` froze the round with another member list (it sent a part cut for it, or answered with it
        and `named` its members): it fetches nothing from this peer."""
        async with self._cond:
            st.other_lists.add(peer)
            st.named.update(named)
            self._cond.notify_all()

    def other_lists(self, r: int) -> frozenset[str]:
        """`Exchanged.other_lists` of round `r` as known now: parts that came after its exchange ended too."""
        st = self._rounds.get(r)
        return frozenset((st.other_lists | st.named) - {self.peer_id}) if st is not None else frozenset()
