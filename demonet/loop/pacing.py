"""A peer's own pace: its micro-batch and exchange times, averaged over its recent rounds. Pure logic, no clock.

The round loop's cut-off leaves room for the exchange; the report (`Pace`) goes with each payload to the
coordinator's automatic round length (`demonet.wire.pace`).
"""

from __future__ import annotations

from dataclasses import dataclass

from demonet.transport import Pace

from .link import LinkPace

__all__ = ["PeerPace"]

_SMOOTHING = 0.3
"""Each round moves the averages this far."""


def _averaged(old: float, new: float) -> float:
    return new if not old else old + _SMOOTHING * (new - old)


@dataclass
class PeerPace:
    """This peer's measured times."""

    exchange_s: float = 0.0
    """Its predicted exchange of a round: its compress, its upload and its settle, which a cut-off leaves room for."""
    micro_batch_s: float = 0.0
    """Its recent micro-batches' mean time (0: none measured yet)."""
    own_micro_batches: int = 1
    """The micro-batches of its own lockstep round (`--accumulate`), as its last lockstep round trained."""

    def measured(self, micro_batches: int, train_s: float, exchange_s: float, *, lockstep: bool) -> float:
        """A round trained `micro_batches` in `train_s` and its exchange took `exchange_s`; returns the round of
        one micro-batch this peer now needs (its `least_s`)."""
        if micro_batches and train_s:
            self.micro_batch_s = _averaged(self.micro_batch_s, train_s / micro_batches)
        if lockstep and micro_batches:  # (a round of a micro-batch spanning rounds may have ended none)
            self.own_micro_batches = micro_batches
        self.exchange_s = _averaged(self.exchange_s, exchange_s)
        return self.micro_batch_s + self.exchange_s

    def report(self, link: LinkPace | None) -> Pace | None:
        """Its round of its own micro-batches and of one, exchange included, at the full k (the length is set by
        the payloads a lockstep run sends); None before its first round is measured."""
        if not self.micro_batch_s:
            return None
        exchange_s = self.exchange_s
        if link is not None and link.k:
            exchange_s += max(0.0, link.upload_s(link.max_k) - link.upload_s(link.k))
        return Pace(need_s=self.own_micro_batches * self.micro_batch_s + exchange_s,
                    least_s=self.micro_batch_s + exchange_s, train_s=self.micro_batch_s)
