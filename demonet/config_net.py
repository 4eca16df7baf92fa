"""The run config's [net] section (`NetConfig`): coordinator mode's rounds, the aggregate, who may join, and DHT
mode's majority and slices; re-exported by `demonet.config`, which holds the other sections and the loading.

Imports nothing of demonet: the config's leaf, so `demonet.config` builds on it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NetConfig"]


@dataclass(frozen=True, kw_only=True)
class NetConfig:
    """Coordinator mode: rounds and the aggregate."""

    round_timeout_s: float = 30.0
    """A round closes at most this long after it opens; stragglers are not waited on."""
    min_peers: int = 1
    """Payloads needed to apply a round at its deadline; fewer aborts it (peers restore theirs)."""
    start_peers: int = 1
    """The first round opens once this many peers have joined."""
    heartbeat_interval_s: float = 2.0
    """How often a peer tells the coordinator it is alive."""
    heartbeat_timeout_s: float = 15.0
    """A peer not heard from for this long is dropped from the membership."""
    leave_after_s: float = 600.0
    """DHT mode: a round is applied only with more than half of the previous round's members; a member
    not heard from for this long leaves that base, so the survivors of a mass failure go on after it. A
    peer cut off from the others for longer also goes on alone: make it longer than any partition the run
    should survive (docs/dht.md#the-majority-rule)."""
    verify_slices: float = 0.25
    """DHT mode: the fraction of each round's slices that a second owner merges too (seeded by the round),
    so an owner that serves a wrong merged slice shows as a disagreement (docs/dht.md#verified-slices);
    0: off."""
    slice_entries: int = 4096
    """DHT mode: a round's slices hold about this many entries of the aggregate each, and so many members
    own one (at least 4, or every member that can be dialed where fewer; the owners turn with the round):
    each owner answers every member's part, so slices far smaller than a stream's fixed cost are cheaper
    carried in fewer (docs/dht.md#slice-owners). 0: every member that can be dialed owns a slice. Every
    peer of a run must use the same value."""
    exclude_owner_rounds: int = 20
    """DHT mode: an owner that a majority of a round's members reported for a disagreeing slice owns no
    slice for this many rounds after the report."""
    max_idle_rounds: int = 3
    """A member whose payload is missing from this many consecutive rounds is idle: it stays a member
    (its heartbeats keep it), but rounds no longer wait for it until a payload of it is accepted again.
    0: rounds wait for every member until the deadline (one member that never submits then holds every
    round to round_timeout_s)."""
    aggregate_topk: int = 0
    """Merged coefficients kept per chunk in the aggregate (0: the peers' compression_topk), so a
    peer's download does not grow with the number of peers; peers restore what was dropped."""
    aggregate_encoding: str = "bf16"
    """Value encoding of the aggregate peers download: fp32, bf16 or fp16."""
    clip_to_median_norm: bool = True
    """Robust aggregation: before merging, scale every payload whose L2 norm exceeds the round's
    median payload norm down to it, so a poisoned (scaled or random) update weighs no more than a
    typical one."""
    max_payload_norm: float = 1e6
    """Reject a payload whose values' L2 norm exceeds this (0: no bound); honest payloads are
    orders of magnitude below."""
    round_s: float = 0.0
    """The round length (docs/coordinator.md#mixed-speed-peers). Each peer trains micro-batches until its
    cut-off, this long after it starts the round less its own predicted compress, upload and apply time, at
    least one and at most `max_micro_batches`, then compresses once: a slow peer sends fewer samples in time
    instead of holding the round. 0: automatic, from what the members report of their speed: lockstep while
    they are alike, else long enough for the median member's own round and the slowest one's one
    micro-batch; in coordinator mode a member slow by its compute spans rounds instead (`demonet.wire.pace`)."""
    lockstep: bool = False
    """Every round waits for every active member's own micro-batches (up to `round_timeout_s`), however the
    speeds differ: the behaviour without rounds by the clock, for comparison. Excludes `round_s`."""
    max_micro_batches: int = 16
    """With `round_s`: the most micro-batches a peer trains in one round."""
    max_sample_ratio: float = 16.0
    """The merge weights each payload by the samples it was computed from, at most this many times the median
    of the other payloads' samples (a claim above is capped and counted); 0: every payload weighs the same."""
    max_samples_per_round: int = 1 << 32
    """A payload claiming more samples than this is refused as invalid (no state changes)."""
    overlap: int = 0
    """Rounds a peer trains ahead of the network: 1 trains round r+1 while round r's payload travels
    and is merged (the aggregate is applied when it arrives, before round r+1's payload is made);
    0: a round's exchange waits for its training and the next round's training for its exchange."""
    lookahead: bool = True
    """With overlap = 1, train round r+1 from the parameters after this peer's own round-r update,
    which the real aggregate replaces when it arrives; False trains it from round r's parameters
    (a plain one-round delay)."""
    admission: str = "token"
    """Who may join (docs/security.md): "token", any key that presents the run token (each key speaks
    only for itself); "allowlist", only the keys listed in `allowlist` (reloaded on SIGHUP; a removed key
    is dropped); "open", any key, without the token. DHT mode: the token's HMAC gates the DHT in every
    policy ("open" is "token" there), and each peer checks the others' records and messages against
    the allowlist, read at start."""
    allowlist: str = ""
    """With admission = "allowlist": a file of ``ed25519:<hex> [peer_id]`` lines (`demonet keygen` prints a
    key's line)."""
    newcomer_s: float = 600.0
    """Coordinator mode: a peer that has had no payload accepted this long after its key joined is let go at the
    next challenge or join (dropped from the membership, its key and session forgotten: its id is free again)."""
    max_newcomers: int = 256
    """Coordinator mode: peers joined at once that have had no payload accepted yet, at most; a join of another
    new id is refused RESOURCE_EXHAUSTED until one contributes or is let go."""

    def __post_init__(self) -> None:
        _check(self.round_timeout_s > 0, "round_timeout_s should be > 0")
        _check(self.min_peers >= 1, "min_peers should be >= 1")
        _check(self.start_peers >= 1, "start_peers should be >= 1")
        _check(self.heartbeat_interval_s > 0, "heartbeat_interval_s should be > 0")
        _check(self.heartbeat_timeout_s > self.heartbeat_interval_s,
               "heartbeat_timeout_s should be > heartbeat_interval_s")
        _check(self.leave_after_s > 0, "leave_after_s should be > 0")
        _check(0.0 <= self.verify_slices <= 1.0, f"verify_slices should be in [0, 1], got {self.verify_slices}")
        _check(self.exclude_owner_rounds >= 0, "exclude_owner_rounds should be >= 0")
        _check(self.slice_entries >= 0, f"slice_entries should be >= 0 (0: every member owns a slice), "
                                        f"got {self.slice_entries}")
        _check(self.max_idle_rounds >= 0, f"max_idle_rounds should be >= 0 (0: off), got {self.max_idle_rounds}")
        _check(self.aggregate_topk >= 0, "aggregate_topk should be >= 0")
        _check(self.aggregate_encoding in ("fp32", "bf16", "fp16"), "aggregate_encoding should be fp32, bf16 or fp16")
        _check(self.max_payload_norm >= 0, "max_payload_norm should be >= 0")
        _check(self.overlap in (0, 1), f"overlap should be 0 or 1, got {self.overlap!r}")
        _check(self.round_s >= 0, f"round_s should be >= 0 (0: automatic), got {self.round_s}")
        _check(not (self.lockstep and self.round_s), "lockstep and a fixed round_s exclude each other: set one")
        _check(self.round_s <= self.round_timeout_s,
               f"round_s ({self.round_s}) should be <= round_timeout_s ({self.round_timeout_s})")
        _check(self.max_micro_batches >= 1, f"max_micro_batches should be >= 1, got {self.max_micro_batches}")
        _check(self.max_sample_ratio == 0 or self.max_sample_ratio >= 1,
               f"max_sample_ratio should be 0 (off) or >= 1, got {self.max_sample_ratio}")
        _check(self.max_samples_per_round >= 1,
               f"max_samples_per_round should be >= 1, got {self.max_samples_per_round}")
        _check(self.newcomer_s > 0, f"newcomer_s should be > 0, got {self.newcomer_s}")
        _check(self.max_newcomers >= 1, f"max_newcomers should be >= 1, got {self.max_newcomers}")
        _check(self.admission in ("token", "allowlist", "open"),
               f"admission should be token, allowlist or open, got {self.admission!r}")
        _check((self.admission == "allowlist") == bool(self.allowlist),
               "allowlist (a file of keys) goes with admission = \"allowlist\", and only with it")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
