"""The peers of one `demonet bench` comparison: each one's link speed and compute slowdown.

A bench module: the standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Swarm"]


def _g(values: tuple[float, ...]) -> str:
    return ",".join(f"{v:g}" for v in values)


@dataclass(frozen=True)
class Swarm:
    """Per peer: its link's speed in Mbit/s (both ways) and its compute slowdown (1: as fast as the machine
    makes it; 2: each forward and backward takes twice as long, `demonet.lab.evidence.slowdown`)."""

    mbit: tuple[float, ...]
    slowdown: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.mbit:
            raise ValueError("a swarm should have at least one peer")
        if len(self.slowdown) != len(self.mbit):
            raise ValueError(f"one slowdown per peer: {len(self.mbit)} links, {len(self.slowdown)} slowdowns")
        if not all(m > 0 for m in self.mbit):
            raise ValueError(f"link speeds should be > 0 Mbit/s, got {_g(self.mbit)}")
        if not all(s >= 1 for s in self.slowdown):
            raise ValueError(f"slowdowns should be >= 1 (a sleep cannot make a peer faster), got {_g(self.slowdown)}")

    @classmethod
    def alike(cls, mbit: float, peers: int) -> Swarm:
        """`peers` peers, each at `mbit` and none slowed."""
        return cls((mbit,) * peers, (1.0,) * peers)

    @classmethod
    def of(cls, peers: int, mbit: list[float] | None = None, slowdown: list[float] | None = None,
           sweep: float = 100.0) -> Swarm:
        """A swarm from `demonet bench`'s flags: `mbit` one speed per peer (else every peer at `sweep`),
        `slowdown` one factor per peer (else none slowed).

        Raises:
            ValueError: a list whose length is not `peers`, or a value out of range.
        """
        for flag, values in (("--peer-mbit", mbit), ("--slowdown", slowdown)):
            if values is not None and len(values) != peers:
                raise ValueError(f"{flag} should have one value per peer ({peers}), got {len(values)}")
        return cls(tuple(mbit or [sweep] * peers), tuple(slowdown or [1.0] * peers))

    @property
    def peers(self) -> int:
        return len(self.mbit)

    @property
    def mixed(self) -> bool:
        """Whether the peers differ (in their links or their compute)."""
        return len(set(self.mbit)) > 1 or any(s != 1 for s in self.slowdown)

    @property
    def fastest(self) -> float:
        """The fastest link: a coordinator's."""
        return max(self.mbit)

    def fast(self) -> Swarm:
        """The fast peers alone: those not slowed whose link is the fastest (every peer of a swarm of equals).

        Raises:
            ValueError: no peer is both.
        """
        keep = [i for i in range(self.peers) if self.slowdown[i] == 1 and self.mbit[i] == self.fastest]
        if not keep:
            raise ValueError(f"no peer is both unslowed and on the fastest link ({self.label})")
        return Swarm(tuple(self.mbit[i] for i in keep), tuple(self.slowdown[i] for i in keep))

    @property
    def label(self) -> str:
        """For tables and plots: "100 Mbit/s", or "100,100,100,5 Mbit/s, slowdown 1,1,1,2"."""
        if not self.mixed:
            return f"{self.fastest:g} Mbit/s"
        return f"{_g(self.mbit)} Mbit/s, slowdown {_g(self.slowdown)}"

    @property
    def folder(self) -> str:
        """A run's folder name suffix: "100mbit", or "100-100-100-5mbit-1-1-1-2x"."""
        if not self.mixed:
            return f"{self.fastest:g}mbit"
        return f"{'-'.join(f'{m:g}' for m in self.mbit)}mbit-{'-'.join(f'{s:g}' for s in self.slowdown)}x"
