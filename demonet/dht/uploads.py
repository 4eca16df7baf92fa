"""A DHT peer's uplink, timed by the receipts of its parts.

Pure logic, no clock: `demonet.dht.streams.Streams` feeds it each part's bytes and the seconds from the
part's write to the receipt its owner (or verifier) sends once it has read the whole part
(`DHT_KIND_RECEIVED`, before the merge it answers after). The round loop sizes its k from the result
(`demonet.loop.link.LinkPace`), as a coordinator-mode peer sizes it from its Submit's time.

The parts of a round go out at once, one link to each peer they go to, and share this peer's uplink. An
uplink may serve its links together (each peer's parts end at about the time of all of them) or one after
another (the peer served first is done early); either way, by the time a peer's last part is read, at
least the parts of the peers read before it have gone up. A peer can also be slow to read its parts (its
downlink, or a busy reader), which says nothing of this uplink. So the round's upload rate is the highest,
over the peers in the order their last parts were read, of the bytes of the parts read so far over the
time so far, and its time is the bytes of all the parts at that rate. Peers slow to read their parts then
count only where they are half of them or more (below). With one other peer, its downlink counts as this
uplink.

A part read within `MIN_S` times nothing: a link's first tens of kB go at once, into a shaper's burst or a
buffer, whatever the link's rate. Its bytes count in the parts read so far, but no rate is taken at its time.
Where the peers' lower median read its parts within `MIN_S`, the round's upload is 0 (not measured: a fast
uplink, or a burst), and the round loop keeps the rate it measured before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MIN_S", "Uploads"]

MIN_S = 0.05
"""No rate is taken at a part read sooner (a part of tens of kB can fit a burst)."""


@dataclass
class Uploads:
    """The parts' receipts of this peer's latest rounds, and the upload each round's show."""

    keep: int = 4
    """Rounds kept (the latest): a round's parts are received before the next round's are sent."""
    _rounds: dict[int, dict[str, tuple[int, float]]] = field(default_factory=dict)
    """round -> the peer its parts went to -> (their bytes, the seconds of the slowest)"""

    def receipt(self, r: int, to: str, size: int, seconds: float) -> None:
        """A part of round `r` to peer `to`, of `size` bytes, was read whole `seconds` after its write began."""
        if size <= 0 or seconds < 0:
            return
        held, slowest = self._rounds.setdefault(r, {}).get(to, (0, 0.0))
        self._rounds[r][to] = held + size, max(slowest, seconds)
        for q in sorted(self._rounds)[:-self.keep]:
            del self._rounds[q]

    def of(self, r: int) -> tuple[int, float] | None:
        """Round `r`'s upload: the bytes of its received parts, and the seconds they take at the round's rate
        (the module's docstring), 0 where the peers' lower median read its parts within `MIN_S` (None: no part
        received)."""
        peers = self._rounds.get(r)
        if not peers:
            return None
        held = sorted(peers.values(), key=lambda part: part[1])
        total = sum(size for size, _ in held)
        if held[(len(held) - 1) // 2][1] < MIN_S:
            return total, 0.0
        so_far, rate = 0, 0.0
        for size, seconds in held:
            so_far += size
            if seconds >= MIN_S:
                rate = max(rate, so_far / seconds)
        return total, total / rate
