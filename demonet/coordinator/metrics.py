"""The coordinator's Prometheus metrics (served over HTTP with --metrics-port), status counters, and the
dashboard's record of the run.

Imports prometheus_client and demonet.dashboard only; the servicer updates these, `demonet status`
reads them over gRPC and the dashboard over HTTP.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

from demonet.dashboard import RunRecord

__all__ = ["Metrics"]


class _Phase:
    """The phase gauge, and its value for the status (a gauge has no public getter)."""

    def __init__(self, gauge: Gauge) -> None:
        self.gauge, self.value = gauge, 0

    def set(self, value: int) -> None:
        self.value = value
        self.gauge.set(value)


class Metrics:
    """One registry per coordinator (tests run several in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.round = Gauge("demonet_round", "The open round", registry=r)
        self.members = Gauge("demonet_members", "Members of the open round", registry=r)
        self.submitted = Gauge("demonet_submitted", "Payloads in for the open round", registry=r)
        self.phase = _Phase(Gauge("demonet_phase", "0: the round is open; 1: closing (its merge, until the publish)",
                                  registry=r))
        self.loss = Gauge("demonet_loss", "Mean training loss of the last applied round", registry=r)
        self._counters = {
            name: Counter(f"demonet_{name}", doc, registry=r) for name, doc in (
                ("rounds_closed", "Rounds closed (applied or aborted)"),
                ("rounds_aborted", "Rounds closed without a quorum"),
                ("rejected", "Payloads that failed validation"),
                ("clipped", "Payloads scaled down to their round's median norm"),
                ("capped", "Payloads whose samples were above the cap (max_sample_ratio times the median of the "
                           "others'): weighted at the cap"),
                ("late", "Payloads for a round that had closed"),
                ("resyncs", "Members whose parameter digest differed from the canonical one, so that they "
                            "downloaded the whole parameters again"),
                ("unauthorized", "Calls with a missing or wrong token"),
                ("bytes_up", "Payload bytes received"),
                ("bytes_down", "Aggregate and parameter bytes sent to members"),
                ("bytes_public", "Aggregate bytes sent on the public path (unsigned GetAggregate calls)"),
                ("persist_failures", "State writes that failed (a full disk, no permission): the state file "
                                     "stayed at an older round"),
                ("persist_coalesced", "Round snapshots replaced by a newer one before their write began (the "
                                      "disk was slower than the rounds)"),
            )
        }
        self.totals = dict.fromkeys(self._counters, 0)
        """The counters' values, for `demonet status` and for persistence across restarts."""
        self.round_time = Histogram("demonet_close_seconds", "Time to close a round and publish its aggregate "
                                    "(the merge); the apply and the state write come after",
                                    registry=r, buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10))
        self.persist_time = Histogram("demonet_persist_seconds", "Time to write the state file of a round "
                                      "(in the background)", registry=r, buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10))
        self.persisted_round = Gauge("demonet_persisted_round", "The round the state file on disk starts; a "
                                     "restart resumes there", registry=r)
        self.last_loss = float("nan")
        self.record = RunRecord()
        """What the dashboard shows: recent rounds, members' counters, recent refusals (bounded)."""
        self._bytes_at_close = (0, 0)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose /metrics on an HTTP port (a daemon thread)."""
        start_http_server(port, addr=addr, registry=self.registry)

    def set_round(self, round: int, members: int, submitted: int) -> None:
        self.round.set(round)
        self.members.set(members)
        self.submitted.set(submitted)

    def exposition(self) -> tuple[str, bytes]:
        """The /metrics page: (content type, body), for a server other than `serve`'s."""
        return CONTENT_TYPE_LATEST, generate_latest(self.registry)

    def add(self, name: str, amount: int = 1, *, peer: str = "") -> None:
        """Count something (a name from `totals`); with `peer`, also in that member's counters."""
        self.totals[name] += amount
        self._counters[name].inc(amount)
        if peer:
            self.record.count(name, peer, amount)

    def uploaded(self, peer: str, num_bytes: int, seconds: float, loss: float, *, samples: int | None = None,
                 topk: int | None = None, need_s: float | None = None, micro_batches: int = 0,
                 compute_s: float = 0.0) -> None:
        """An accepted payload of `num_bytes` whose Submit stream took `seconds` (and what it was computed from)."""
        self.add("bytes_up", num_bytes)
        self.record.uploaded(peer, num_bytes, seconds, loss, samples=samples, topk=topk, need_s=need_s,
                             micro_batches=micro_batches, compute_s=compute_s)

    def refused(self, peer: str, round: int | None, kind: str, reason: str) -> None:
        """A refused call or payload, for the dashboard's list (the counters are counted where they apply)."""
        self.record.refused(peer, round, kind, reason)

    def closed(self, aborted: bool, seconds: float, loss: float | None, *, round: int = -1,
               members: Iterable[str] = (), contributors: Iterable[str] = (), round_s: float | None = None) -> None:
        """A round closed in `seconds` (its merge, until the publish); `round_s`: since it opened."""
        self.add("rounds_closed")
        if aborted:
            self.add("rounds_aborted")
        self.round_time.observe(seconds)
        if loss is not None:
            self.last_loss = loss
            self.loss.set(loss)
        up, down = self.totals["bytes_up"], self.totals["bytes_down"]
        self.record.round_closed(round, members=members, contributors=contributors, aborted=aborted, loss=loss,
                                 round_s=round_s, close_s=seconds, bytes_up=up - self._bytes_at_close[0],
                                 bytes_down=down - self._bytes_at_close[1])
        self._bytes_at_close = (up, down)

    def persisted(self, round: int, seconds: float) -> None:
        """The state of `round` is on disk; its write took `seconds`."""
        self.persisted_round.set(round)
        self.persist_time.observe(seconds)

    def counters(self) -> dict[str, Any]:
        """Totals worth keeping across a restart."""
        return {**self.totals, "last_loss": self.last_loss}

    def restore(self, saved: dict[str, Any]) -> None:
        for name, value in saved.items():
            if name == "last_loss":
                self.last_loss = float(value)
            elif name in self.totals and value:
                self.add(name, int(value))
        self._bytes_at_close = (self.totals["bytes_up"], self.totals["bytes_down"])  # a round's bytes, not the run's
