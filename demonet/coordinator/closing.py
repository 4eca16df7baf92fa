"""What a round's close sets and keeps besides its merge: the next round's length (`RoundPace`) and how long it
waits, the aggregates kept for download, and the counters and the dashboard's record of the close.

Functions of explicit arguments, called by the round core (`demonet.coordinator.core`) holding its condition:
no asyncio, no grpc, no protobuf.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from demonet.wire.pace import RoundPace

from .metrics import Metrics
from .rounds import Rounds
from .state import ClosedAggregate
from .terms import KEEP_AGGREGATE_BYTES, KEEP_AGGREGATES, MIN_KEPT_AGGREGATES

__all__ = ["count_close", "keep", "next_round_s"]

logger = logging.getLogger(__name__)


def next_round_s(pace: RoundPace, r: Rounds, round_timeout_s: float) -> float:
    """At a close: the next round's length (`RoundPace`), and how long that round waits for its members."""
    was, spanned = pace.round_s, r.spanning
    now_s = pace.close(r.members)
    r.limit_s = pace.deadline_s(round_timeout_s)
    r.spanning = set(pace.spanning)
    if r.spanning != spanned:
        logger.info("[coordinator round=%d] rounds do not wait for the members whose micro-batch spans rounds: %s",
                    r.round, ", ".join(sorted(r.spanning)) or "none")
    if pace.automatic and (was == 0.0) != (now_s == 0.0):
        logger.info("[coordinator round=%d] %s", r.round, f"rounds by the clock: {now_s:.2f} s (the members' "
                    "speeds differ)" if now_s else "lockstep rounds again (the members are alike)")
    return now_s


def keep(aggregates: OrderedDict[int, ClosedAggregate], closed: ClosedAggregate) -> None:
    """Keep a closed round's aggregate for download: the newest `KEEP_AGGREGATES`, fewer where they hold more
    than `KEEP_AGGREGATE_BYTES` (but at least `MIN_KEPT_AGGREGATES`); the oldest go first."""
    aggregates[closed.round] = closed
    kept = sum(len(a.data) for a in aggregates.values())
    while len(aggregates) > KEEP_AGGREGATES or (kept > KEEP_AGGREGATE_BYTES and len(aggregates) > MIN_KEPT_AGGREGATES):
        kept -= len(aggregates.popitem(last=False)[1].data)


def count_close(metrics: Metrics, closed: ClosedAggregate, *, close_s: float, losses: list[float],
                members: tuple[str, ...], contributors: tuple[str, ...], round_s: float,
                max_sample_ratio: float) -> None:
    """Count a closed round: its close, its weights, its clipped payloads and its capped sample counts."""
    metrics.closed(closed.aborted, close_s, sum(losses) / len(losses) if losses else None,
                   round=closed.round, members=members, contributors=contributors, round_s=round_s)
    if not closed.aborted:
        metrics.record.weighted(closed.contributors, closed.weights)
    if closed.clipped:
        metrics.add("clipped", len(closed.clipped))
    for peer in closed.capped:
        metrics.add("capped")
        metrics.refused(peer, closed.round, "samples_capped", "its samples were above "
                        f"{max_sample_ratio:g} times the median of the others': capped")
