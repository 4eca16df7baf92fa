"""The coordinator's status document: what `/status.json`, the dashboard and `demonet status` show.

Reads the round state machine, the metrics and the dashboard's record; changes nothing. Imports no
grpc: the servicer's Status RPC and the dashboard's HTTP server both call `status_document`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from demonet.dashboard.record import finite

from .metrics import Metrics
from .rounds import Rounds

__all__ = ["status_document"]


def status_document(rounds: Rounds, metrics: Metrics, *, now: float, param_digest: str, total_rounds: int,
                    since: int | None = None, keys: Mapping[str, str] | None = None,
                    round_length_s: float = 0.0) -> dict[str, Any]:
    """The document of docs/dashboard.md for a coordinator.

    Args:
        rounds: the coordinator's round state.
        metrics: its counters and record.
        now: the clock `rounds` runs on (time.monotonic()).
        param_digest: the canonical digest at the start of the open round.
        total_rounds: the run's rounds (0: no end).
        since: only the rounds after this one.
        keys: peer -> its key's fingerprint.
        round_length_s: the length announced for the open round (0: lockstep).
    """
    t = metrics.totals
    phase = "closing" if metrics.phase.value else "open" if rounds.started else "waiting"
    run = {"round": rounds.round, "phase": phase,
           "seconds_left": rounds.seconds_left(now) if rounds.started else None,
           "members": len(rounds.members), "idle": len(rounds.idle), "joiners": len(rounds.joiners),
           "submitted": len(rounds.submitted),
           "rounds_closed": t["rounds_closed"], "rounds_aborted": t["rounds_aborted"], "total_rounds": total_rounds,
           "last_loss": finite(metrics.last_loss), "param_digest": param_digest, "bytes_up": t["bytes_up"],
           "bytes_down": t["bytes_down"], "rejected": t["rejected"], "late": t["late"], "clipped": t["clipped"],
           "capped": t["capped"],
           "resyncs": t["resyncs"], "unauthorized": t["unauthorized"], "round_timeout_s": rounds.cfg.round_timeout_s,
           "round_length_s": round_length_s}
    submitted = set(rounds.submitted)
    live = {p: (_state(rounds, p, submitted), now - seen) for p, seen in rounds.members.items()}
    live.update({p: ("joining", now - seen) for p, seen in rounds.joiners.items()})
    return metrics.record.document("coordinator", "coordinator", run, live, since=since, keys=keys)


def _state(rounds: Rounds, peer_id: str, submitted: set[str]) -> str:
    """A member's state on the dashboard: whether its payload is in, and whether the open round waits for it."""
    if peer_id in submitted:
        return "submitted"
    if peer_id in rounds.idle:
        return "idle"
    if peer_id in rounds.spanning:
        return "spanning"
    return "member" if peer_id in rounds.worked or peer_id in rounds.active else "new"
