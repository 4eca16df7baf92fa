"""DHT mode without a coordinator: the pure logic every peer runs identically. No network, no asyncio.

Announcements and the majority rule (the freeze of a round's membership built on them is
demonet.dht.freeze_rules), the majority digest, the slice plan of the sparse reduce-scatter, which
slices a second owner verifies and which owners sit out, the parameter ranges a joiner loads from
several donors, and the HMAC of the run token. Imports the math layer's dataclasses and torch; must not
import asyncio, grpc, hivemind or any other demonet.dht module. The transport's parts
(demonet.dht.board, exchange, donor, streams) call these.

Shape legend: R = rows (chunks) of one tensor inside a slice, K = entries per row, U = merged entries per row.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import random
import statistics
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from demonet.optim import Compressed, Payload
from demonet.optim.payload import num_chunks
from demonet.wire.pace import MIN_GAP_S, SPAN, valid_report, valid_work

__all__ = ["MIN_SLICE_OWNERS", "Announcement", "SlicePlan", "excluded_owners", "has_majority", "majority_digest",
           "members_digest", "next_base", "owner_count", "owner_order", "param_ranges", "sign", "stacks_slices",
           "verifiers", "verify"]

Specs = Mapping[str, tuple[tuple[int, ...], tuple[int, int]]]
"""Parameter name -> (shape, chunk), in the optimizer's order (`DeMo.param_specs()`)."""


# -- authentication ------------------------------------------------------------------------------------


def sign(token: bytes, data: bytes) -> bytes:
    """HMAC-SHA256 of `data` keyed by the run token (32 bytes). The token itself never travels."""
    return hmac.new(token, data, hashlib.sha256).digest()


def verify(token: bytes, data: bytes, mac: bytes) -> bool:
    """Whether `mac` is `sign(token, data)` (constant-time comparison)."""
    return hmac.compare_digest(sign(token, data), mac)


# -- membership ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Announcement:
    """A peer's record under a round's member key: it has its payload and is ready to exchange."""

    peer_id: str
    t: float
    """DHT time at which it announced."""
    digest: str
    """Its parameter digest at the start of the round."""
    address: str = ""
    """Its libp2p peer id (where to send parts and fetch slices)."""
    client: bool = False
    """A peer in client mode (behind NAT): it cannot be dialed, so it owns no slice and donates nothing."""
    loss: float | None = None
    """Its training loss on its batch of the round, for the dashboards (None: not said)."""
    reports: Mapping[str, int] = field(default_factory=dict)
    """Owners it saw serve a slice their verifier disagreed with -> the latest round it saw that in."""
    pace: tuple[float, float, float] | None = None
    """Its speed for the automatic round length (`demonet.transport.Pace`: need_s, least_s, train_s); None: not
    measured yet, or not a valid report."""
    work: tuple[int, float, float] | None = None
    """Its payload's micro-batches, their forward and backward seconds and its last upload's seconds (0: none
    measured), for the dashboards (None: not said, or not valid: `demonet.wire.pace.valid_work`)."""


def announced_work(value: object) -> tuple[int, float, float] | None:
    """An announcement's `work` field: (micro_batches, compute_s, upload_s) where `demonet.wire.pace.valid_work`
    accepts them; None otherwise (for the dashboards only: a bad one is not shown)."""
    if not isinstance(value, list | tuple) or len(value) != 3:
        return None
    count, seconds, upload = value
    if not isinstance(count, int) or isinstance(count, bool) \
            or not all(isinstance(s, float | int) and not isinstance(s, bool) for s in (seconds, upload)):
        return None
    return (count, float(seconds), float(upload)) if valid_work(count, float(seconds), float(upload)) else None


def announced_pace(value: object) -> tuple[float, float, float] | None:
    """An announcement's `pace` field: (need_s, least_s, train_s) where it is three seconds counts that
    `demonet.wire.pace.valid_report` accepts; None otherwise (missing, or not a valid report: ignored, as a
    coordinator would refuse it)."""
    if not isinstance(value, list | tuple) or len(value) != 3:
        return None
    if not all(isinstance(s, float | int) and not isinstance(s, bool) for s in value):
        return None
    need_s, least_s, train_s = (float(s) for s in value)
    return (need_s, least_s, train_s) if valid_report(need_s, least_s, train_s) else None


def has_majority(members: Iterable[str], base: Collection[str] | None) -> bool:
    """Whether `members` hold more than half of `base` (None or empty: no base yet, e.g. the first round).

    The base is the previous round's members (`freeze_rules.majority_base`): two sides of a partition
    cannot both hold more than half of it, so at most one side applies rounds.
    """
    if not base:
        return True
    return 2 * len(set(base).intersection(members)) > len(base)


def next_base(base: Collection[str] | None, members: Iterable[str], contributors: Iterable[str]) -> frozenset[str]:
    """The base of the round after one applied with `members` (those with the majority digest) over `base`.

    The members become the next base only if the round's contributors (the peers whose payload is in
    a slice this peer got: each sent parts cut for this very member list, after the freeze) hold more
    than half of `base`. Otherwise the base stays, the members added (joiners then count from the
    round after). Who a round froze with depends on which announcements a peer read: across a
    partition a side reads those of the far side stored before the cut. Two against two, {c, d}
    reading b's announcement freezes with b, c and d, 3 of 4, and gets the payloads of c and d only
    (2 of 4: it aborts the round, `DhtGatherer.gather`); were its next base {b, c, d}, c and d would
    hold 2 of 3 and go on while a and b wait (or go on too, having read c's). A member that really left
    is out of the base at once as long as the others, a majority, contributed.

    Args:
        base: the base the round froze over (None: the first round, whose members are the next base).
        members: the round's members with the majority digest (joiners admitted to it included).
        contributors: the peers whose payload is in a slice of the round this peer got.
    """
    if not base or has_majority(contributors, base):
        return frozenset(members)
    return frozenset(base).union(members)


def majority_digest(digests: Mapping[str, str]) -> str:
    """The parameter digest most members hold (ties: the smallest), which every peer picks the same."""
    counts = Counter(digests.values())
    best = max(counts.values())
    return min(d for d, c in counts.items() if c == best)


def members_digest(members: Sequence[str], owners: Sequence[str] | None = None) -> str:
    """A short digest of a sorted member list, and of the sorted members that own slices (`owners`, where it is
    not all of them): parts cut for another list, or for other owners, are refused."""
    named = list(members) if owners is None or list(owners) == list(members) else [*members, "", *owners]
    return hashlib.sha256("\n".join(named).encode()).hexdigest()[:16]


# -- slice owners -----------------------------------------------------------------------------------------

MIN_SLICE_OWNERS = 4
"""Members that own a slice of a round at least, where that many can be dialed: one owner lost then drops
at most a quarter of the aggregate."""


def owner_count(dialable: int, specs: Specs, topk: int, slice_entries: int) -> int:
    """How many of a round's `dialable` members own a slice: one for each `slice_entries` entries of the
    aggregate (`topk` a chunk, at most the chunk's coefficients), at least `MIN_SLICE_OWNERS`, at most every
    dialable member (`slice_entries` 0: every one).

    Each owner answers every member's part with its merged slice, so a round makes members x owners
    streams; a slice much smaller than a stream's fixed cost (a few milliseconds of CPU and a round
    trip at each end) is cheaper to carry in fewer, larger slices (docs/dht.md#slice-owners). `SlicePlan`
    still makes no more slices than the model has rows.
    """
    if slice_entries <= 0 or dialable <= MIN_SLICE_OWNERS:
        return dialable
    entries = sum(num_chunks(shape, chunk) * min(topk, chunk[0] * chunk[1]) for shape, chunk in specs.values())
    return min(dialable, max(MIN_SLICE_OWNERS, math.ceil(entries / slice_entries)))


def owner_order(r: int, dialable: Sequence[str], n_owners: int) -> list[str]:
    """Round `r`'s `dialable` members (sorted) in the order they own slices: slice s is the s-th one's, for
    s < `n_owners`. With fewer owners than members the list turns by one member a round, so that every
    member owns slices (and carries their upload) in turn; with every member an owner it is as given."""
    if n_owners >= len(dialable) or not dialable:
        return list(dialable)
    k = r % len(dialable)
    return [*dialable[k:], *dialable[:k]]


# -- verified slices ------------------------------------------------------------------------------------


def verifiers(r: int, mdigest: str, owners: Sequence[str], n_slices: int, fraction: float) -> dict[int, str]:
    """The slices of round `r` that a second member merges too: slice -> its verifier, the same on every peer.

    ``ceil(fraction * n_slices)`` slices, drawn with a generator seeded by the round and its member list
    (`mdigest`), each verified by a member drawn among the others of `owners` (the dialable members in
    `owner_order`: slice s is `owners[s]`'s, so `n_slices <= len(owners)`; a member that owns no slice may
    verify one). An owner of one slice is thus checked with probability ``ceil(fraction * n) / n`` per
    round. None with fewer than two dialable members.
    """
    if fraction <= 0.0 or len(owners) < 2 or n_slices < 1:
        return {}
    seed = int.from_bytes(hashlib.sha256(f"verify/{r}/{mdigest}".encode()).digest()[:8], "big")
    rng = random.Random(seed)
    count = min(n_slices, math.ceil(fraction * n_slices - 1e-9))
    out = {}
    for s in sorted(rng.sample(range(n_slices), count)):  # slice s is owned by owners[s]
        out[s] = owners[(s + 1 + rng.randrange(len(owners) - 1)) % len(owners)]
    return out


def excluded_owners(announced: Mapping[str, Announcement], members: Collection[str], r: int, rounds: int
                    ) -> frozenset[str]:
    """Owners that more than half of round `r`'s `members` reported within the last `rounds` rounds.

    They own no slice in round `r`. Every peer reads the same announcements of the frozen members, so
    every peer excludes the same owners.
    """
    if rounds <= 0 or not members:
        return frozenset()
    votes: Counter[str] = Counter()
    for p in members:
        a = announced.get(p)
        if a is not None:
            votes.update(o for o, seen in a.reports.items() if r - rounds <= seen < r)
    return frozenset(o for o, n in votes.items() if 2 * n > len(members))


def slow_links(announced: Mapping[str, Announcement], members: Collection[str]) -> frozenset[str]:
    """The members slow by their link, as the round's announcements of its `members` tell: their exchange (the
    announced `least_s` less `train_s`, at the full k) over `SPAN` times the median member's and over it by
    `MIN_GAP_S`, and at least their own micro-batch's time (of three members with a pace at least). They own no
    slice (docs/dht.md#mixed-speed-peers): an owner's downlink carries every member's part of its slice and
    its uplink the merged slice to each. Every peer reads the same announcements, so every peer agrees."""
    exchange = {p: (pace[1] - pace[2], pace[2]) for p in members
                if (a := announced.get(p)) is not None and (pace := a.pace) is not None and pace[0] > 0}
    if len(exchange) < 3:
        return frozenset()
    median = statistics.median_low(x for x, _ in exchange.values())
    return frozenset(p for p, (x, train) in exchange.items() if x > SPAN * median and x - median >= MIN_GAP_S
                     and x >= train)


# -- the sparse reduce-scatter ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    name: str
    lo: int
    hi: int


def stacks_slices(encoding: str) -> bool:
    """Whether payloads of a value encoding can be cut into stacked slices (`SlicePlan`'s `stack`): all but
    fp16, whose values carry one scale per tensor."""
    return encoding != "fp16"


class SlicePlan:
    """All payload rows (chunks) of the model, in the optimizer's order, cut into `n` contiguous slices.

    Slice `s` holds global rows [s*T//n, (s+1)*T//n). Within a slice, the rows of every tensor with one
    chunk shape (h, w) travel as one tensor, stacked in the model's order, of shape ``(rows*h, w)`` and
    chunk ``(h, w)``, named ``{h}x{w}@{name}@{lo}`` after its first piece (rows [lo, ...) of tensor `name`): the
    wire format carries and validates it like any payload's tensor, and the codecs and the merge, whose
    work is row by row, do in one tensor what they did in one per piece, with fewer bytes of tensor
    headers. With `stack` off (payloads whose values carry one scale per tensor: fp16), each piece travels
    as a tensor of its own, named ``name@lo``.
    """

    def __init__(self, specs: Specs, n: int, *, stack: bool = True) -> None:
        self.specs = dict(specs)
        self.stack = stack
        rows = {name: num_chunks(shape, chunk) for name, (shape, chunk) in self.specs.items()}
        total = sum(rows.values())
        if n < 1:
            raise ValueError("a slice plan needs n >= 1")
        self.n = min(n, max(total, 1))
        bounds = [s * total // self.n for s in range(self.n + 1)]
        self.slices: list[list[_Piece]] = [[] for _ in range(self.n)]
        start = 0
        for name, count in rows.items():
            for s in range(self.n):
                lo, hi = max(start, bounds[s]), min(start + count, bounds[s + 1])
                if lo < hi:
                    self.slices[s].append(_Piece(name, lo - start, hi - start))
            start += count
        self.groups: list[dict[str, list[_Piece]]] = []
        """Per slice: the name of each tensor it travels as -> the pieces stacked in it, in order."""
        for pieces in self.slices:
            if not stack:
                self.groups.append({f"{p.name}@{p.lo}": [p] for p in pieces})
                continue
            by_chunk: dict[tuple[int, int], list[_Piece]] = {}
            for piece in pieces:
                by_chunk.setdefault(self.specs[piece.name][1], []).append(piece)
            self.groups.append({f"{h}x{w}@{ps[0].name}@{ps[0].lo}": ps for (h, w), ps in by_chunk.items()})

    def slice_specs(self, s: int) -> dict[str, tuple[tuple[int, ...], tuple[int, int]]]:
        """What a valid message for slice `s` holds: the name of each tensor -> (shape, chunk)."""
        out: dict[str, tuple[tuple[int, ...], tuple[int, int]]] = {}
        for name, pieces in self.groups[s].items():
            h, w = self.specs[pieces[0].name][1]
            out[name] = (sum(p.hi - p.lo for p in pieces) * h, w), (h, w)
        return out

    def cut(self, payload: Payload, s: int) -> Payload:
        """The rows of `payload` (a full one, in the model's layout) that slice `s` holds.

        Raises:
            ValueError: tensors to stack have different k, or a scale per tensor (fp16 with `stack` on).
        """
        tensors = {}
        for name, pieces in self.groups[s].items():
            cs = [payload.tensors[p.name] for p in pieces]
            h, w = cs[0].chunk
            scales = [c.scale if c.scale is None or c.scale.dim() != 2 else c.scale[p.lo:p.hi]  # (R, 1) per row
                      for p, c in zip(pieces, cs, strict=True)]
            if len(cs) > 1 and (len({c.k for c in cs}) > 1 or any(x is not None and x.dim() != 2 for x in scales)):
                raise ValueError(f"slice {s}: the tensors of {name} cannot be stacked (another k, or one scale "
                                 f"per tensor): cut payloads with one scale per tensor with stack=False")
            shape = (sum(p.hi - p.lo for p in pieces) * h, w)
            idx = [c.idx[p.lo:p.hi] for p, c in zip(pieces, cs, strict=True)]  # (R, K) each
            val = [c.val[p.lo:p.hi] for p, c in zip(pieces, cs, strict=True)]
            scale = scales[0] if len(cs) == 1 or scales[0] is None else torch.cat(cast(list[torch.Tensor], scales))
            tensors[name] = Compressed(idx=idx[0] if len(idx) == 1 else torch.cat(idx),
                                       val=val[0] if len(val) == 1 else torch.cat(val),
                                       shape=shape, chunk=(h, w), scale=scale)
        return Payload(tensors=tensors, encoding=payload.encoding)

    def join(self, merged: Sequence[Payload | None]) -> Payload:
        """The full aggregate from every slice's merged payload (None: a slice nobody could deliver).

        Rows of a missing slice hold no entries. Rows are padded to one width per tensor by
        repeating their first index with value 0, as `aggregate` pads; values are plain floats.
        """
        rows: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {name: [] for name in self.specs}
        for s, groups in enumerate(self.groups):
            part = merged[s]
            for name, pieces in groups.items():
                sizes = [p.hi - p.lo for p in pieces]
                if part is None:
                    for piece, size in zip(pieces, sizes, strict=True):
                        empty_R1 = torch.zeros(size, 1, dtype=torch.int64)
                        rows[piece.name].append((empty_R1, torch.zeros(empty_R1.shape, dtype=torch.float32)))
                    continue
                c = part.tensors[name]
                for piece, idx_RU, val_RU in zip(pieces, torch.split(c.idx, sizes), torch.split(c.val.float(), sizes),
                                                 strict=True):
                    rows[piece.name].append((idx_RU, val_RU))
        tensors = {}
        for name, (shape, chunk) in self.specs.items():
            width = max(idx.shape[1] for idx, _ in rows[name])
            idx_parts, val_parts = [], []
            for idx_RU, val_RU in rows[name]:
                pad = width - idx_RU.shape[1]
                if pad:
                    idx_RU = torch.cat([idx_RU, idx_RU[:, :1].expand(-1, pad)], dim=1)  # (R, width)
                    val_RU = torch.cat([val_RU, torch.zeros(val_RU.shape[0], pad, dtype=val_RU.dtype)], dim=1)
                idx_parts.append(idx_RU)
                val_parts.append(val_RU)
            tensors[name] = Compressed(idx=torch.cat(idx_parts), val=torch.cat(val_parts), shape=shape, chunk=chunk)
        return Payload(tensors=tensors, encoding="fp32")


def param_ranges(sizes: Sequence[tuple[str, int]], n: int) -> list[list[str]]:
    """Cut parameter names (in order, with their byte sizes) into at most `n` contiguous ranges of similar bytes.

    A joiner loads each range from a different donor, so no single donor serves the whole model.
    """
    if not sizes:
        return []
    n = max(1, min(n, len(sizes)))
    total = sum(size for _, size in sizes)
    ranges: list[list[str]] = [[]]
    done = 0
    for i, (name, size) in enumerate(sizes):
        names_left, ranges_left = len(sizes) - i, n - len(ranges)
        if ranges[-1] and ranges_left and (done >= len(ranges) * total / n or names_left <= ranges_left):
            ranges.append([])
        ranges[-1].append(name)
        done += size
    return ranges
