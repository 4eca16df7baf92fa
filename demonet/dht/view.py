"""A DHT peer's view of its run, for the dashboard (`demonet peer --dht --dashboard-port`).

Fed by the peer's `DhtGatherer` at two points of each round (the freeze, the end of the exchange); it
keeps a `demonet.dashboard.RunRecord` and describes the run in the same document a coordinator
serves (docs/dashboard.md). Pure bookkeeping: no I/O, no asyncio, no hivemind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from demonet.dashboard import RunRecord
from demonet.dashboard.record import finite
from demonet.wire.merge import sample_weights

from .rules import Announcement

__all__ = ["DhtView"]


class DhtView:
    """What one DHT peer saw of the run: rounds, members and their digests, slices owned, resyncs.

    Args:
        peer_id: this peer.
        total_rounds: the run's rounds (0: no end).
        window_s: the round window (the freeze's timeout).
    """

    def __init__(self, peer_id: str, *, total_rounds: int, window_s: float) -> None:
        self.peer_id, self.total_rounds, self.window_s = peer_id, total_rounds, window_s
        self.record = RunRecord()
        self.refused: Callable[[], int] = lambda: 0
        """Stream messages refused so far (bad MAC, another run, bad signature); set by the peer once its node runs."""
        self.round, self.phase = 0, "waiting"
        self.rounds_closed = self.rounds_aborted = self.resyncs = self.bytes_up = self.bytes_down = 0
        self.capped = 0
        """Payloads whose claimed samples this peer capped in the slices it merged (`verified`)."""
        self.last_loss: float | None = None
        self.digest = ""
        self._states: dict[str, str] = {}  # the last round's members -> their state in it
        self._entered_at = self._frozen_at = 0.0
        self._ended_at: float | None = None

    def entered(self, round: int) -> None:
        """This peer announced itself in `round` (its payload is ready)."""
        self.round, self.phase, self._entered_at = round, "exchanging", time.monotonic()

    def frozen(self, round: int, members: Sequence[str], announced: Mapping[str, Announcement], good: str, *,
               spanning: Collection[str] = ()) -> None:
        """The round froze with `members`; those whose digest is not the majority's (`good`) resync, and those whose
        micro-batch spans rounds (`spanning`, as the announced speeds tell) are shown so."""
        self._frozen_at, self.digest = time.monotonic(), good
        self._states = {}
        for p in members:
            stats = self.record.member(p)
            stats.last_loss = finite(announced[p].loss)
            pace, work = announced[p].pace, announced[p].work
            stats.need_s = finite(pace[0]) if pace is not None else None
            stats.micro_batches, stats.compute_s, stats.upload_s = (
                (work[0], work[1], work[2] or None) if work is not None else (None, None, None))
            self._states[p] = ("resync" if announced[p].digest != good else "spanning" if p in spanning
                               else "member")
            if self._states[p] == "resync":
                self.record.count("resyncs", p)
        if self._states.get(self.peer_id) == "resync":
            self.resyncs += 1
            self.phase = "resyncing"

    def minority(self, round: int, minority: bool) -> None:
        """This peer waits in `round` without a majority (True: it applies no round), or stopped waiting."""
        self.round = round
        if minority:
            self.phase = "minority"
        elif self.phase == "minority":
            self.phase = "exchanging"

    def verified(self, round: int, *, disagreed: Sequence[str], excluded: Sequence[str], capped: Sequence[str] = (),
                 max_ratio: float = 0.0) -> None:
        """Owners and verifiers of slices that disagreed in `round` (listed with the refusals), the owners left
        out of it (their state reads ``excluded``), and the senders whose samples this peer capped in its
        merges (counted, and listed with the refusals as the coordinator lists them)."""
        for p in capped:
            self.capped += 1
            self.record.refused(p, round, "samples_capped",
                                f"its samples were above {max_ratio:g} times the median of the others': capped")
        if disagreed:
            self.record.refused(", ".join(sorted(disagreed)), round, "disagreement",
                                "a verified slice's owner and verifier merged it differently; dropped, both reported")
        for p in excluded:
            if self._states.get(p) == "member":
                self._states[p] = "excluded"

    def exchanged(self, round: int, *, contributors: Sequence[str], slice_owners: Sequence[str], aborted: bool,
                  bytes_up: int, bytes_down: int, claims: Mapping[str, int] | None = None,
                  topks: Mapping[str, int] | None = None,
                  max_ratio: float = 0.0) -> None:
        """The round's exchange ended: count it, with this peer's bytes and the slices each member owned; where this
        peer holds every contributor's claimed samples (`claims`), each one's samples and weight in the merge; and the
        k of the members whose parts it merged (`topks`)."""
        claims, topks = claims or {}, topks or {}
        for p, k in topks.items():
            if p in self._states:
                self.record.member(p).topk = k
        now = time.monotonic()
        for p in self._states:  # counted once the round's exchange ended: a reader never sees a half-counted round
            self.record.member(p).slices = 0
        for p in slice_owners:
            if p in self.record.members:
                stats = self.record.members[p]
                stats.slices = (stats.slices or 0) + 1
        for p in self._states:
            if self._states[p] in ("member", "spanning") and p not in contributors:
                self._states[p] = "missed"
        if contributors and all(p in claims for p in contributors):  # as every slice's merge weighs them
            weights, _ = sample_weights([claims[p] for p in contributors], max_ratio)
            self.record.weighted(contributors, weights)
            for p in contributors:
                self.record.member(p).samples = claims[p]
        self.record.count("bytes_up", self.peer_id, bytes_up)
        self.record.count("bytes_down", self.peer_id, bytes_down)
        self.bytes_up, self.bytes_down = self.bytes_up + bytes_up, self.bytes_down + bytes_down
        losses = [s.last_loss for p in contributors if (s := self.record.members.get(p)) and s.last_loss is not None]
        loss = sum(losses) / len(losses) if losses else None
        self.rounds_closed += 1
        self.rounds_aborted += aborted
        self.last_loss = loss if loss is not None else self.last_loss
        self.record.round_closed(round, members=list(self._states), contributors=contributors, aborted=aborted,
                                 loss=loss, round_s=now - (self._ended_at or self._entered_at),
                                 close_s=now - self._frozen_at, bytes_up=bytes_up, bytes_down=bytes_down)
        self._ended_at = now
        self.round, self.phase = round + 1, "training"

    def document(self, since: int | None = None) -> dict[str, Any]:
        """The document of docs/dashboard.md, from this peer's view (null where DHT mode has no such thing)."""
        now = time.monotonic()
        run = {"round": self.round, "phase": self.phase, "seconds_left": None, "members": len(self._states),
               "idle": None, "joiners": None, "submitted": None, "rounds_closed": self.rounds_closed,
               "rounds_aborted": self.rounds_aborted, "total_rounds": self.total_rounds,
               "last_loss": self.last_loss, "param_digest": self.digest, "bytes_up": self.bytes_up,
               "bytes_down": self.bytes_down, "rejected": self.refused(), "late": None, "clipped": None,
               "capped": self.capped, "resyncs": self.resyncs, "unauthorized": None, "round_timeout_s": self.window_s,
               "round_length_s": None}
        seen = {p: s.seen_at for p, s in self.record.members.items()}
        live = {p: (state, now - seen.get(p, self._frozen_at)) for p, state in self._states.items()}
        return self.record.document("dht", self.peer_id, run, live, since=since)
