"""The round length: lockstep, a fixed `[net] round_s`, or the automatic length from what the peers report.

Pure logic: no clock, no asyncio; one rule for both network modes. The coordinator feeds it each accepted
payload's report, a DHT peer each frozen member's announcement (`need_s`: the seconds the peer needs for a round
of its own micro-batches, compress, upload and apply included; `least_s`: the same for one micro-batch), and
reads the next round's length at each close (docs/coordinator.md#mixed-speed-peers).

The automatic policy, per close, over the latest report of every member:
- While the members are alike (the slowest `need_s` within `ALIKE` times the median, or within `MIN_GAP_S` of
  it), rounds stay lockstep (length 0): every peer trains its own micro-batches, as a run of equal peers always
  did, bit for bit; a round of milliseconds is not turned over by a scheduling hiccup.
- Otherwise rounds go by the clock: long enough for the median member's own round and for
  `SLOWEST_MICRO_BATCHES` times the slowest member's round of one micro-batch, so every member is in every
  round and the faster ones train more micro-batches meanwhile. A member whose one micro-batch needs more than
  `max_micro_batches` median rounds (or half the round timeout) does not stretch the round; it is waited for
  until the round's deadline (`deadline_s`) only.
- Back to lockstep once the slowest is within `ALIKE_OFF` times the median again (hysteresis: no flapping).
- A member slow by its compute, not its link (its one-micro-batch round over `SPAN` (1.5) times the median
  member's round, and its forward and backward alone, `train_s`, over `SPAN` times the median member's), spans
  rounds instead: it is left out of the length above and rounds do not wait for it (`spanning`); its payload,
  from parameters some rounds old, enters the round that is open when it comes
  (docs/coordinator.md#mixed-speed-peers). Rounds stay
  as short as the others need: DeMo's step moves every parameter by about the lr each round, so more rounds
  reach a loss sooner. DHT mode has no late payloads (`late` False): there a spanning member is in every round
  with what it has at its cut-off, its micro-batch running across rounds (`demonet.loop.spanning`), so the rounds
  go by the clock even where the others are alike (the median other's own round). An overlapped DHT peer does not
  span (`spans` False): the rounds cover the slowest member's one micro-batch as above
  (docs/dht.md#mixed-speed-peers).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["ALIKE", "ALIKE_OFF", "MAX_MICRO_BATCHES", "MIN_GAP_S", "MOST_S", "SLOWEST_MICRO_BATCHES", "SPAN",
           "RoundPace", "valid_report", "valid_work"]

ALIKE = 1.5
"""Rounds go by the clock once the slowest member's round is over this many times the median member's."""
ALIKE_OFF = 1.25
"""...and back to lockstep once it is under this many times again."""
MIN_GAP_S = 0.1
"""...and over it by more than this many seconds."""
SLOWEST_MICRO_BATCHES = 1.1
"""A clock round is this many times the slowest member's one-micro-batch round (`least_s`). Short rounds reach a
loss sooner: DeMo's sign step moves every parameter by the lr each round, however many samples are behind it,
so rounds of twice the slowest one's (0.92x the samples of every peer kept busy, against 0.81x with once) took
1.6x lockstep's time to the same loss in `demonet bench` (docs/evidence.md#mixed-swarms). The tenth over once
lets a faster peer finish the micro-batch it would otherwise idle through."""
SPAN = ALIKE
"""A member whose one-micro-batch round is over this many times the median member's round, and whose forward and
backward alone are over this many times the median member's, spans rounds. A member slow by its link does not:
its payload shrinks to its link instead (`[optim] adaptive_topk`) and the clock covers its round; a peer that
spans downloads the aggregates it missed, which a slow link cannot afford. Measured (`python bench/mixed_links.py`):
a 1 Mbit/s peer whose upload was half its round, counted as spanning by its round and half of it its compute,
sent its payload every third round."""
SMOOTHING = 0.5
"""Each close moves the automatic length this far toward the newly computed one."""
WHOLE_SLACK = 1.05
"""A clock round fits this many times the median member's whole micro-batches (`RoundPace._whole`): its own
cut-off then fits the last one despite a little jitter."""
MOST_S = 86400.0
"""The largest round time a peer may report (`need_s`, `least_s`, `train_s`): a day."""
MAX_MICRO_BATCHES = 1 << 20
"""The most micro-batches a peer may say a payload was computed from (shown on the dashboards)."""


def valid_work(micro_batches: int, *seconds: float) -> bool:
    """Whether what a peer says of its payload's work, for the dashboards, is a count up to `MAX_MICRO_BATCHES` and
    seconds (its compute, its upload) between 0 and `MOST_S` (NaN is not)."""
    return 0 <= micro_batches <= MAX_MICRO_BATCHES and all(0.0 <= s <= MOST_S for s in seconds)


def valid_report(need_s: float, least_s: float, train_s: float) -> bool:
    """Whether a peer's report is three seconds counts between 0 and `MOST_S` (NaN is not)."""
    return all(0.0 <= s <= MOST_S for s in (need_s, least_s, train_s))


@dataclass
class RoundPace:
    """The length of the next round a coordinator announces with each aggregate (`next_round_s`).

    Args:
        fixed_s: `[net] round_s`: > 0, every round is this long; 0: automatic (or lockstep).
        lockstep: `[net] lockstep`: every round waits for every active member's own micro-batches (length 0).
        max_micro_batches: `[net] max_micro_batches`: the most a peer trains in one round.
        round_timeout_s: `[net] round_timeout_s`: the automatic length stays under half of it.
        spans: whether a member slow by its compute spans rounds; False: the rounds cover it like any other member.
        late: whether a spanning member's payload counts late (coordinator mode): rounds do not wait for it. False
            (DHT mode): it is in every round, with what it has at its cut-off, so the rounds go by the clock even
            where the other members are alike: their median member's round.
    """

    fixed_s: float = 0.0
    lockstep: bool = False
    max_micro_batches: int = 16
    round_timeout_s: float = 30.0
    spans: bool = True
    late: bool = True
    round_s: float = 0.0
    """The next round's length (0: lockstep)."""
    reports: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    """Each member's latest (need_s, least_s, train_s): its round, its round of one micro-batch, and that micro-batch's
    forward and backward alone."""
    spanning: set[str] = field(default_factory=set)
    """The members whose one micro-batch spans rounds (automatic length only): rounds do not wait for them."""

    def __post_init__(self) -> None:
        if self.fixed_s and self.lockstep:
            raise ValueError("a fixed round_s and lockstep exclude each other")
        if self.fixed_s:
            self.round_s = self.fixed_s

    @property
    def automatic(self) -> bool:
        """Whether the length follows the reports (neither fixed nor lockstep)."""
        return not self.fixed_s and not self.lockstep

    def report(self, peer_id: str, need_s: float, least_s: float, train_s: float = 0.0) -> None:
        """A member's report, from its accepted payload; zeros (not measured yet) are ignored."""
        if need_s > 0 and least_s > 0:
            self.reports[peer_id] = (need_s, least_s, max(0.0, train_s))

    def close(self, members: Iterable[str]) -> float:
        """At a round's close: the next round's length, from the latest reports of the current `members`."""
        if not self.automatic:
            return self.round_s
        members = set(members)
        self.reports = {p: r for p, r in self.reports.items() if p in members}
        if not self.reports:
            return self.round_s
        self.spanning = self._spanning()
        others = {p: r for p, r in self.reports.items() if p not in self.spanning}
        target = self._target(others)
        if not target and self.spanning and not self.late:  # a cut-off for the spanning ones
            target = statistics.median_low(need for need, _, _ in others.values())
        if target == 0.0 or self.round_s == 0.0:
            self.round_s = target
        else:
            self.round_s += SMOOTHING * (target - self.round_s)
        return self.round_s

    def _spanning(self) -> set[str]:
        """The members slow by their compute: their one-micro-batch round over `SPAN` times the median member's round
        (and over it by `MIN_GAP_S`), and their forward and backward over `SPAN` times the median one (of three
        members at least: with two, neither is the norm)."""
        if not self.spans or len(self.reports) < 3:
            return set()
        median = statistics.median_low(need for need, _, _ in self.reports.values())
        median_train = statistics.median_low(train for _, _, train in self.reports.values())
        if median_train <= 0:  # not reported: none is known to be slow by its compute
            return set()
        return {p for p, (_, least, train) in self.reports.items()  # over by MIN_GAP_S: not a hiccup of ms rounds
                if least > SPAN * median and least - median >= MIN_GAP_S and train > SPAN * median_train}

    def _target(self, reports: dict[str, tuple[float, float, float]]) -> float:
        needs = [need for need, _, _ in reports.values()]
        median = statistics.median_low(needs)  # of two members: the faster one
        slowest = max(needs)
        if slowest < (ALIKE_OFF if self.round_s else ALIKE) * median or slowest - median < MIN_GAP_S:
            return 0.0
        cap = min(self.round_timeout_s / 2, self.max_micro_batches * median)
        covered = [least for _, least, _ in reports.values() if least <= cap]
        length = max([median, *(SLOWEST_MICRO_BATCHES * least for least in covered)])
        _, least, train = next(r for r in reports.values() if r[0] == median)  # the median member's
        return min(cap, self._whole(length, least, train))

    @staticmethod
    def _whole(length: float, least_s: float, train_s: float) -> float:
        """`length`, made up to the median member's exchange (its `least_s` less its `train_s`) and a whole number
        of its micro-batches, with `WHOLE_SLACK` to spare: a round a little over one micro-batch would otherwise
        leave it idle for most of one (measured: with one peer on a 1 Mbit/s link, rounds of 1.1 times that peer's
        round, 1.7 of the others' micro-batches, left them one micro-batch and 0.13 s of waiting each round)."""
        exchange_s = least_s - train_s
        if train_s <= 0 or exchange_s < 0:  # not reported: as it is
            return length
        whole = math.ceil((length - exchange_s) / train_s - 1e-9)
        return max(length, exchange_s + WHOLE_SLACK * whole * train_s)

    def deadline_s(self, round_timeout_s: float) -> float:
        """How long after it opens an automatic clock round stops waiting for members: twice its length and a
        second, within the round timeout (lockstep and fixed rounds: the round timeout)."""
        if not self.automatic or not self.round_s:
            return round_timeout_s
        return min(round_timeout_s, 2 * self.round_s + 1.0)
