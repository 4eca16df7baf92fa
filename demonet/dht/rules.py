"""DHT mode without a coordinator: the pure logic every peer runs identically. No network, no asyncio.

Membership freeze (who is in a round), the majority digest, the slice plan of the sparse
reduce-scatter, which slices a second owner verifies and which owners sit out, the parameter ranges
a joiner loads from several donors, and the HMAC of the run token. Imports the math layer's
dataclasses and torch; must not import asyncio, grpc, hivemind or any other demonet.dht module.
The transport's parts (demonet.dht.board, exchange, donor, streams) call these.

Shape legend: R = rows (chunks) of one tensor inside a slice, K = entries per row, U = merged entries per row.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import random
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from demonet.optim import Compressed, Payload
from demonet.optim.payload import num_chunks

__all__ = ["MIN_SLICE_OWNERS", "Announcement", "Frozen", "SlicePlan", "excluded_owners", "freeze", "has_majority",
           "late_majority", "majority_base", "majority_digest", "members_digest", "next_base", "owner_count",
           "owner_order", "param_ranges", "sign", "stacks_slices", "verifiers", "verify"]

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


@dataclass(frozen=True)
class Frozen:
    """A round's frozen membership."""

    deadline: float
    """DHT time of the freeze: announcements at or before it are members."""
    members: tuple[str, ...]
    """Sorted peer ids."""
    complete: bool
    """Every expected peer announced before the timeout (False: some were dropped at the deadline)."""
    settled: bool
    """Final as soon as seen (every expected peer is in); otherwise final once read after deadline + latency."""
    majority: bool = True
    """Its members are more than half of the majority's base (`has_majority`): only then may the round
    be applied. False: this peer is on a minority side (a partition) and waits."""


@dataclass(frozen=True)
class Staying:
    """A round's expected peers and the base of its majority, less the peers that left (`staying`)."""

    expected: frozenset[str] | None
    previous: frozenset[str] | None


def staying(expected: Iterable[str] | None, previous: Iterable[str] | None, announced: Collection[str],
            left: Collection[str]) -> Staying:
    """`expected` and `previous` (the base before `majority_base`) of a round, less the peers in `left` (they
    said they leave the run before this round or one before it) that did not announce the round.

    A peer that leaves says so itself, in a record only it can store, before the round it does not
    announce: no partition can make it up. So it leaves the base at once, where a silent member leaves
    only after `leave_after_s`: the last member of a run whose other members all left goes on alone. A
    peer that read the record and one that did not yet freeze the same members (it announced nothing);
    their bases may differ by it until the record arrives. None stays None (the first round; no base).
    """
    gone = set(left) - set(announced)
    return Staying(None if expected is None else frozenset(expected) - gone,
                   None if previous is None else frozenset(previous) - gone)


def has_majority(members: Iterable[str], base: Collection[str] | None) -> bool:
    """Whether `members` hold more than half of `base` (None or empty: no base yet, e.g. the first round).

    The base is the previous round's members (`majority_base`): two sides of a partition cannot both
    hold more than half of it, so at most one side applies rounds.
    """
    if not base:
        return True
    return 2 * len(set(base).intersection(members)) > len(base)


def majority_base(previous: Iterable[str], last_seen: Mapping[str, float], *, now: float,
                  leave_after_s: float) -> frozenset[str]:
    """The peers a round's majority is counted over: the previous round's members, less those not heard
    from for `leave_after_s` (DHT time).

    Joiners admitted to a round are not in its base: they count from the round after (they are then
    its previous round's members). Dropping the silent ones lets a run that really lost most of its
    peers go on; it also lets a minority that waits longer than `leave_after_s` go on alone.

    Args:
        previous: the members of the previous round.
        last_seen: peer -> the DHT time of its latest announcement this peer read (absent: never).
        now: the DHT time now.
        leave_after_s: how long a silent member stays in the base.
    """
    return frozenset(p for p in previous if now - last_seen.get(p, -math.inf) <= leave_after_s)


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


def late_majority(announced: Mapping[str, Announcement], base: Collection[str],
                  following: Collection[str] = ()) -> tuple[str, ...] | None:
    """The members of a round that had no majority at its deadline, late announcements counted, if they
    now hold a majority of `base` (None otherwise).

    Peers that are all alive but announced more than a window apart (a heal, a slow store) would
    otherwise wait on each other for ever. The round is too late for its exchange: the caller aborts it
    and the next round goes on with these members.

    `following`: peers registered to join the round after (`RoundBoard.joiners`). A member of the base
    among them counts as here: it gave up its own rounds and loads the parameters from whoever admits
    it. After a split healed, a side waiting a round behind the other (which applied the round the
    split cut into and then waited too) sees the other's head past its own and registers; the side
    ahead then holds a majority and admits it. The members returned are the announced ones only.
    """
    members = tuple(sorted(announced))
    return members if has_majority(set(members).union(following), base) else None


def freeze(announced: Mapping[str, Announcement], *, expected: Iterable[str] | None, start_peers: int,
           window_s: float, base: Collection[str] | None = None) -> Frozen | None:
    """The membership of a round from its announcements; the same on every peer that sees the same records.

    With `expected` (the previous round's members plus the joiners admitted for this round), the
    round is complete once all of them announced: its members are exactly them, decided as soon as
    a peer sees their records. Without (the first round), it is complete once `start_peers` peers
    announced, however long that takes (deadline inf until then). Otherwise it freezes `window_s`
    after the first announcement with whoever announced by then. Every answer but an
    expected-complete one is final only when read once the DHT time is past `deadline` plus the
    store latency the caller allows (records stored before the deadline are visible by then):
    `Frozen.settled` says which.

    With `base` (`majority_base`), `Frozen.majority` says whether the members hold more than half of
    it. A complete round without a majority is not decided early: it freezes at the deadline with
    whoever announced by then (peers that announced without being expected count too).

    Returns:
        None when nobody has announced yet.
    """
    if not announced:
        return None
    times = sorted(a.t for a in announced.values())
    timeout_at = times[0] + window_s
    if expected is not None:
        want = set(expected)
        if want and want <= set(announced) and has_majority(want, base):
            complete_at = max(announced[p].t for p in want)
            if complete_at <= timeout_at:
                return Frozen(deadline=complete_at, members=tuple(sorted(want)), complete=True, settled=True)
    elif len(times) >= start_peers:
        complete_at = times[start_peers - 1]
        members = tuple(sorted(p for p, a in announced.items() if a.t <= complete_at))
        return Frozen(deadline=complete_at, members=members, complete=True, settled=False)
    else:  # the first round waits for its start_peers (the caller bounds the wait)
        return Frozen(deadline=math.inf, members=(), complete=False, settled=False)
    members = tuple(sorted(p for p, a in announced.items() if a.t <= timeout_at))
    return Frozen(deadline=timeout_at, members=members, complete=False, settled=False,
                  majority=has_majority(members, base))


def majority_digest(digests: Mapping[str, str]) -> str:
    """The parameter digest most members hold (ties: the smallest), which every peer picks the same."""
    counts = Counter(digests.values())
    best = max(counts.values())
    return min(d for d, c in counts.items() if c == best)


def members_digest(members: Sequence[str]) -> str:
    """A short digest of a sorted member list: parts cut for another list are refused."""
    return hashlib.sha256("\n".join(members).encode()).hexdigest()[:16]


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
            scale = scales[0] if len(cs) == 1 or scales[0] is None else torch.cat(scales)
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
