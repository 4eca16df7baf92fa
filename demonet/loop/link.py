"""A payload sized to the peer's uplink: the top-k that its measured upload rate carries in its share of a round.

Pure logic, no clock: the round loop feeds it each round's payload bytes, k and upload seconds, and asks for the
next round's k (docs/coordinator.md#links). Each coefficient of the aggregate is already the mean over the peers
that sent it, so a peer that sends fewer coefficients needs no change anywhere else; what it does not send
stays in its momentum (error feedback) and goes out in a later round.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["UPLOAD_SHARE", "LinkPace"]

UPLOAD_SHARE = 0.25
"""A peer's upload should take at most this share of a round by the clock: the rest is its training."""
_SMOOTHING = 0.3
"""Each measurement moves the averages this far (the recent submits count most)."""


@dataclass
class LinkPace:
    """This peer's uplink, from its recent submits, and the k that fits a round.

    Args:
        max_k: `[optim] compression_topk`: the k of a fast link, and of every round when `adaptive` is off.
        min_k: the floor (`[optim] min_compression_topk`, or its default).
        adaptive: `[optim] adaptive_topk`.
    """

    max_k: int
    min_k: int
    adaptive: bool = True
    bytes_per_s: float = 0.0
    """The upload rate of the recent submits (0: none measured)."""
    bytes_per_k: float = 0.0
    """A payload's bytes per unit of k (its size is about linear in k: indices and values per coefficient)."""
    k: int = 0
    """The k of the last payload (0: none sent yet)."""
    last_s: float = 0.0
    """The last upload measured, in seconds (0: none yet)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_k <= self.max_k:
            raise ValueError(f"min_k and max_k should be 1 <= min_k <= max_k, got {self.min_k} and {self.max_k}")

    def sent(self, k: int, size: int, upload_s: float) -> None:
        """A payload of `size` bytes at `k` went up in `upload_s` seconds (a Submit's, start to reply)."""
        self.k = k
        if size <= 0 or upload_s <= 0 or k <= 0:
            return
        self.last_s = upload_s
        rate, per_k = size / upload_s, size / k
        self.bytes_per_s = rate if not self.bytes_per_s else self.bytes_per_s + _SMOOTHING * (rate - self.bytes_per_s)
        self.bytes_per_k = per_k if not self.bytes_per_k else self.bytes_per_k + _SMOOTHING * (per_k - self.bytes_per_k)

    def upload_s(self, k: int) -> float:
        """The predicted upload of a payload at `k` (0 before one is measured)."""
        if not self.bytes_per_s:
            return 0.0
        return self.bytes_per_k * k / self.bytes_per_s

    def choose(self, round_s: float) -> int:
        """The k of the next payload: in a round by the clock of `round_s`, the most whose upload takes at most
        `UPLOAD_SHARE` of it, within [min_k, max_k]; lockstep (0), adaptation off or nothing measured: max_k."""
        if not self.adaptive or round_s <= 0 or not self.bytes_per_s:
            return self.max_k
        fits = int(UPLOAD_SHARE * round_s * self.bytes_per_s / self.bytes_per_k)
        return max(self.min_k, min(self.max_k, fits))
