"""What one peer holds of one DHT round's exchange (`RoundState`), its parts decoded as they arrive, and what
the exchange brought (`Exchanged`).

Net layer helper for demonet.dht.exchange. A part whose slice plan this peer knows when it arrives (the
round's, once frozen, or the one this peer's own parts were sent ahead for) is decoded at once: on the
event loop if it is small (`wire.INLINE_DECODE_BYTES`), else in a thread of its own, one part at a time,
so that a round's parts never take the worker threads the training step needs. The merge after the
last part then decodes that one alone, and, where every part was decoded so and the slice is small
(`merges_inline`), merges on the event loop (docs/dht.md#a-round, step 4). Must not import grpc,
demonet.transport.grpc, or the round board.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload
from demonet.optim import Payload
from demonet.wire import merge as merging
from demonet.wire.merge import MergeRules, decode_contribution

from . import rules

__all__ = ["DecodedParts", "Exchanged", "Outcome", "RoundState", "decode_part", "merges_inline"]

Outcome = Payload | InvalidPayload
"""A part decoded for a merge, or why it is refused."""

_DECODER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="demonet-decode")
"""Where large parts are decoded as they arrive: one thread, whatever the number of parts."""


def merges_inline(undecoded: Collection[str], decoded: Iterable[Outcome]) -> bool:
    """Whether a slice's merge is made on the event loop: no part is left to decode, and the decoded ones (a
    refused part merges nothing) hold `demonet.wire.merge.INLINE_MERGE_ENTRIES` entries at most."""
    entries = sum(o.numel() for o in decoded if not isinstance(o, InvalidPayload))
    return not undecoded and entries <= merging.INLINE_MERGE_ENTRIES


def decode_part(data: bytes, specs: wire.Expected, r: int, rules: MergeRules) -> Outcome:
    """Round `r`'s part `data` of the slice that `specs` describes, validated for a merge, or why not."""
    try:
        step, part = decode_contribution(data, expected=specs, rules=rules)
    except InvalidPayload as e:
        return e
    return part if step == r else InvalidPayload(f"part says round {step}")


class DecodedParts:
    """The parts of one round decoded as they arrived, by (slice, sender): each sender's first part of a
    slice only, so that a sender that replaces its part costs one decode more at most (the merge's)."""

    def __init__(self, r: int, rules: MergeRules) -> None:
        self._r, self._rules = r, rules
        self._held: dict[tuple[int, str], tuple[bytes, wire.Expected, asyncio.Future[Outcome]]] = {}

    def start(self, s: int, sender: str, data: bytes, specs: wire.Expected) -> None:
        """Decode `sender`'s part `data` of slice `s` (described by `specs`) now, unless one of its parts of
        that slice was decoded already."""
        if (s, sender) in self._held:
            return
        if len(data) <= wire.INLINE_DECODE_BYTES:
            done: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
            done.set_result(decode_part(data, specs, self._r, self._rules))
        else:
            done = asyncio.get_running_loop().run_in_executor(_DECODER, decode_part, data, specs, self._r, self._rules)
        self._held[(s, sender)] = (data, specs, done)

    async def take(self, s: int, sender: str, data: bytes, specs: wire.Expected) -> Outcome | None:
        """What decoding `sender`'s part `data` of slice `s` against `specs` gave, once it is done; None where
        that was not started (another part of that sender, or decoded against other specs)."""
        held = self._held.get((s, sender))
        if held is None or held[0] is not data or held[1] != specs:
            return None
        return await asyncio.shield(held[2])


@dataclass(frozen=True)
class Exchanged:
    """What one round's exchange brought: the joined slices, or None if no slice came through."""

    aggregate: Payload | None
    kept: Payload | None
    """The aggregate without the slices this peer's payload is not in (restored into its momentum)."""
    contributors: tuple[str, ...]
    """The peers whose payload is in a delivered slice, sorted."""
    dead_owners: frozenset[str]
    """The owners of slices nobody delivered."""
    bytes_up: int
    bytes_down: int
    slice_owners: tuple[str, ...] = ()
    """The owner of each slice of the round, in order (for the dashboards)."""
    disagreed: frozenset[str] = frozenset()
    """The owners and verifiers of the slices dropped because the two disagreed."""
    capped: frozenset[str] = frozenset()
    """The senders whose claimed samples this peer capped in a slice it merged as the owner (`sample_weights`)."""
    claims: Mapping[str, int] = field(default_factory=dict)
    """The contributors' samples, as their parts held here claimed them (a slice this peer owns or verifies; a peer
    that holds none, as in client mode, knows none): their weights in every slice's merge."""
    topks: Mapping[str, int] = field(default_factory=dict)
    """The contributors' k per chunk, as their parts merged here held it (for the dashboard)."""
    other_lists: frozenset[str] = frozenset()
    """Peers that froze the round with another member list (they sent or answered a part cut for it), and
    the members those lists name: alive, so the next round waits for them. The slices of those owners are
    dropped this round, not asked from others."""
    checked: int = 0
    """Slices whose merge this peer checked against a verifier's (and found equal or not)."""
    phases: Mapping[str, float] = field(default_factory=dict)
    """Seconds of the exchange's phases: ``scatter`` (until the parts are sent, their verifiers answered, and
    this peer's slices merged) and ``gather`` (until the merged slices are fetched), both from the exchange's
    start (they run at once; each verified slice is checked as soon as it is merged or fetched); then ``recover``
    (slices the owner did not deliver asked from the others) and ``serve`` (waiting for the others to
    fetch this peer's slices)."""


@dataclass(eq=False)
class RoundState:
    """What this peer knows of one round: its plan once frozen, parts in, merged slices held."""

    plan: rules.SlicePlan | None = None
    guess: tuple[rules.SlicePlan | None, str] = (None, "")
    """The plan and member-list digest this peer sent its parts ahead for (`SliceExchange.send_ahead`)."""
    owners: list[str] = field(default_factory=list)  # slice -> its owner
    dialable: list[str] = field(default_factory=list)  # the members that can be dialed, owners first
    members: list[str] = field(default_factory=list)  # the effective members (majority digest)
    mdigest: str = ""
    rs_deadline: float = 0.0
    ag_deadline: float = 0.0
    parts: dict[int, dict[str, tuple[str, bytes]]] = field(default_factory=dict)  # slice -> sender -> (mdigest, data)
    claims: dict[int, dict[str, int]] = field(default_factory=dict)
    """Slice -> sender -> the samples its part held here claims (`DhtMessage.samples`): its weight in the merge."""
    topks: dict[str, int] = field(default_factory=dict)
    """Sender -> the k per chunk of its parts merged here (the dashboard's `topk`)."""
    samples: int = 1  # this peer's own samples in the round, sent with each of its parts
    capped: set[str] = field(default_factory=set)  # Exchanged.capped
    ahead: dict[int, set[str]] = field(default_factory=dict)
    """Slice -> the senders whose part held here was sent ahead of their freeze (`SliceExchange.send_ahead`):
    one cut for another member list is replaced by the part they send once frozen, and is waited for."""
    decoded: DecodedParts | None = None  # the parts decoded as they arrived (`decode_early`)
    merged: dict[int, tuple[tuple[str, ...], bytes, Payload]] = field(default_factory=dict)
    fetched: dict[int, set[str]] = field(default_factory=dict)  # slice -> peers that fetched it from here
    asked: dict[int, set[str]] = field(default_factory=dict)  # slice -> peers this verifier answered a check of
    check_lists: dict[int, dict[str, tuple[str, ...]]] = field(default_factory=dict)  # slice -> asker -> its list
    verifiers: dict[int, str] = field(default_factory=dict)  # slice -> its second owner (rules.verifiers)
    checks: dict[tuple[int, tuple[str, ...] | None], asyncio.Task[tuple[tuple[str, ...], bytes] | None]] = field(
        default_factory=dict)
    """As a verifier: (slice, contributors; None: as the owner merges) -> the senders and SHA-256 of that merge
    (None: a part is missing)."""
    early: dict[int, asyncio.Future[tuple[tuple[str, ...], bytes] | None]] = field(default_factory=dict)
    """Slice -> its verifier's answer to this peer's part: (the senders, the SHA-256 of their merge), or None."""
    disagreed: set[int] = field(default_factory=set)  # slices whose owner and verifier disagreed
    unverified: set[int] = field(default_factory=set)  # verified slices whose verifier could not answer
    silent: set[str] = field(default_factory=set)  # peers that let a call of the exchange time out (`NoAnswer`)
    other_lists: set[str] = field(default_factory=set)
    """Peers that sent a part once frozen, or answered one, for another member list: alive, but they froze
    the round otherwise, and send or fetch nothing for this peer's list."""
    named: set[str] = field(default_factory=set)  # the members of the lists they answered with
    phases: dict[str, float] = field(default_factory=dict)  # Exchanged.phases
    bytes_up: int = 0
    bytes_down: int = 0

    def expect(self, r: int, plan: rules.SlicePlan, mdigest: str, merge_rules: MergeRules) -> None:
        """Parts are expected cut by `plan` for the member list `mdigest` (the `guess`): those held already, and
        those that come from now on, are decoded as they arrive (`decode_early`)."""
        self.guess = plan, mdigest
        for s, held in self.parts.items():
            for sender, (cut_for, data) in held.items():
                self.decode_early(r, s, sender, cut_for, data, merge_rules)

    def decode_early(self, r: int, s: int, sender: str, mdigest: str, data: bytes, merge_rules: MergeRules) -> None:
        """Start decoding `sender`'s part `data` of slice `s`, cut for the member list `mdigest`, as it arrives,
        where the plan it was cut for is known here: the round's, or the one this peer sent its parts ahead for."""
        plan, digest = (self.plan, self.mdigest) if self.plan is not None else self.guess
        if plan is not None and mdigest == digest and s < plan.n:
            if self.decoded is None:
                self.decoded = DecodedParts(r, merge_rules)
            self.decoded.start(s, sender, data, plan.slice_specs(s))

    def other_list(self, reply: pb.DhtMessage) -> bool:
        """Whether `reply` comes from a peer that froze the round with another member list than this one."""
        return bool(reply.members_digest) and reply.members_digest != self.mdigest

    def final_parts(self, s: int) -> set[str]:
        """The senders of slice `s` whose part held here is final: cut for this peer's member list, or
        sent after the sender's freeze (a part sent ahead for other members will be replaced)."""
        ahead = self.ahead.get(s, set())
        return {p for p, (d, _) in self.parts.get(s, {}).items() if d == self.mdigest or p not in ahead}

    def holders(self, s: int, me: str) -> list[str]:
        """Whom `me` asks for missing slice `s` after the exchange: the other dialable members (each fetched
        every slice), its own owner last. A peer that let a call of the exchange time out (cut off, or
        stalled) is not asked: asking would only wait `exchange_timeout_s` more (a dead peer refuses at once,
        and is asked)."""
        owner = self.owners[s]
        others = [p for p in self.dialable if p not in (me, owner, *self.silent)]
        return others if owner in self.silent or owner == me else [*others, owner]
