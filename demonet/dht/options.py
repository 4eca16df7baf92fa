"""`DhtOptions`: how a peer joins the DHT and runs rounds on it.

Configuration only: imports the wire layer's `MergeRules`; must not import hivemind, asyncio or any
other demonet.dht module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from demonet.wire.merge import MergeRules

__all__ = ["DhtOptions"]


@dataclass(frozen=True, kw_only=True)
class DhtOptions:
    """How a peer joins the DHT and runs rounds on it."""

    run: str
    """The run's DHT prefix: peers with the same prefix (and token) train together."""
    token: str
    """The run token: records and messages carry an HMAC keyed by it; it never travels."""
    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of peers already in the DHT (none: this peer starts a new DHT)."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    """Where this peer listens (TCP port 0: any free one)."""
    announce_maddrs: tuple[str, ...] = ()
    """Public multiaddrs to advertise instead of the listening ones (port forwarding)."""
    identity_path: str | None = None
    """Private key file of this peer's libp2p identity (created if missing): a stable peer id, so a
    bootstrap peer keeps its multiaddr across restarts. None: a new identity each start."""
    bootstrap_timeout_s: float = 60.0
    """How long to keep trying to reach the initial peers when starting."""
    client_mode: bool = False
    """Behind NAT: only dial out. Such a peer trains and sends, but owns no slice and donates nothing."""
    window_s: float = 30.0
    """A round freezes at most this long after its first announcement, without the peers not in by then."""
    round_s: float = 0.0
    """`[net] round_s`: each peer's training cut-off, a fixed round length; 0: automatic, from the members'
    announced speeds (`demonet.wire.pace.RoundPace`), or lockstep with `lockstep`."""
    lockstep: bool = False
    """`[net] lockstep`: every peer trains its own micro-batches each round (no rounds by the clock)."""
    max_micro_batches: int = 16
    """`[net] max_micro_batches`: the automatic length stays within this many of the median member's rounds."""
    spans: bool = True
    """Whether a member slower than a round by its compute spans rounds (the automatic length leaves it out and
    it trains across rounds, `demonet.loop.spanning`); False (an overlapped peer, `[net] overlap = 1`): the
    rounds cover it. Each peer decides for its own cut-off; a member spans where its own peer says so."""
    exchange_timeout_s: float = 10.0
    """Each of the two exchange phases (parts to owners, merged slices back) ends this long after the previous."""
    settle_s: float = 0.2
    """Store latency allowed: a freeze at the deadline is read again this long after it."""
    start_peers: int = 1
    """The first round freezes once this many peers announced."""
    leave_after_s: float = 600.0
    """A member of the previous round not heard from for this long no longer counts in the base of a
    round's majority (docs/dht.md#the-majority-rule): a run that lost most of its peers goes on after it."""
    verify_fraction: float = 0.25
    """The fraction of each round's slices that a second owner merges as well (docs/dht.md#verified-slices)."""
    exclude_rounds: int = 20
    """Rounds an owner reported by a majority for a disagreeing slice owns no slice."""
    slice_entries: int = 4096
    """Entries of the aggregate per slice owner (`rules.owner_count`); 0: every dialable member owns a slice."""
    stack_slices: bool = True
    """Within a slice, the rows of all tensors with one chunk shape travel as one tensor (`rules.SlicePlan`).
    Off where the payloads' values carry one scale per tensor (`[optim] encoding = "fp16"`), which cannot
    be stacked. Every peer of a run must agree: `rules.stacks_slices` gives it from the run's encoding."""
    rules: MergeRules = field(default_factory=lambda: MergeRules(topk=32))
    """How a slice owner merges: the coordinator's rules (top-k, encoding, median-norm clipping, norm bound)."""
    allowed: Mapping[bytes, str | None] | None = None
    """With admission "allowlist": the keys whose records and messages count (key -> the one peer id it
    may use; None: any), read from `[net] allowlist` at start. None: any key that holds the token, each
    peer id pinned to the first key seen for it (docs/security.md)."""

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("token should be non-empty")
        if not self.run or "/" in self.run:
            raise ValueError("run should be a non-empty name without '/'")
        if self.window_s <= 0 or self.exchange_timeout_s <= 0 or self.settle_s < 0:
            raise ValueError("window_s and exchange_timeout_s should be > 0, settle_s >= 0")
        if self.start_peers < 1:
            raise ValueError("start_peers should be >= 1")
        if self.leave_after_s <= self.window_s:
            raise ValueError("leave_after_s should be > window_s")
        if not 0.0 <= self.verify_fraction <= 1.0 or self.exclude_rounds < 0:
            raise ValueError("verify_fraction should be in [0, 1] and exclude_rounds >= 0")
        if self.slice_entries < 0:
            raise ValueError(f"slice_entries should be >= 0 (0: every member owns a slice), got {self.slice_entries}")
