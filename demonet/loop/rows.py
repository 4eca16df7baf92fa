"""A peer's metrics row: one round as the peer saw it, one JSON line of its `metrics-<peer>.jsonl`.

The schema of docs/coordinator.md ("The run folder"); the round loop writes these, and the run folder's
summary and plots (`demonet.loop.runfolder`) and `demonet bench` (`demonet.lab.evidence`) read them back
through the same class. Imports the standard library only.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["MetricsRow"]


@dataclass(kw_only=True)
class MetricsRow:
    """One round of one peer.

    `extra` holds fields a mode adds to every row (a FlexDeMo node's rank count); they are written at the
    row's top level, beside the others, and read back into `extra`.
    """

    round: int
    peer: str
    loss: float
    """The peer's training loss on its batch for the round."""
    bytes_up: int
    """Bytes of the peer's serialized payload."""
    bytes_down: int
    """Bytes of the serialized aggregate (0 when aborted)."""
    param_digest: str
    """The peer's parameter digest after the round."""
    round_time_s: float
    """From the round's training to its settle (and the wait for its canonical digest, where it waited)."""
    compute_s: float
    """Blocking torch work of the round: forward, backward, compress, lookahead, settle."""
    wait_s: float
    """Time the peer waited for the network in the round."""
    contributors: int
    """Payloads in the round's aggregate."""
    aborted: bool
    canonical_digest: str = ""
    """The run's digest after the round ("" where it never came: the next submission's check stands in)."""
    overlap: int = 0
    """The peer's `[net] overlap`."""
    time: float = 0.0
    """Wall-clock UNIX time the row was written (the end of the peer's round)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Where the round's exchange went, name -> seconds (docs/coordinator.md); left out of the line when empty."""
    resynced: bool = False
    """The round where the peer found its digest differed and downloaded the parameters; written only when true."""
    resyncs: int = 0
    """The peer's whole-parameter downloads so far because its digest differed from the canonical one."""
    samples: int = 0
    """How many samples the round's payload was computed from: its weight in the merge (0: not recorded)."""
    micro_batches: int = 0
    """How many micro-batches the peer trained in the round (0: not recorded)."""
    topk: int = 0
    """The coefficients per chunk the round's payload sent (its largest tensor's; 0: not recorded)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The row as its JSON line holds it."""
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("phases", "resynced", "extra")}
        row.update(self.extra)
        if self.phases:
            row["phases"] = dict(self.phases)
        if self.resynced:
            row["resynced"] = True
        return row

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> MetricsRow:
        """A row read back from its JSON object.

        Raises:
            ValueError: a field of the schema is missing or has the wrong type.
        """
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in row.items() if k in names}
        try:
            parsed = cls(**known, extra={k: v for k, v in row.items() if k not in names})
        except TypeError as e:
            raise ValueError(f"a metrics row should have the fields of docs/coordinator.md: {e}") from None
        for name, kind in (("round", int), ("peer", str), ("bytes_up", int), ("bytes_down", int)):
            if not isinstance(getattr(parsed, name), kind):
                raise ValueError(f"a metrics row's {name} should be {kind.__name__}, got {row[name]!r}")
        return parsed

    @classmethod
    def read(cls, path: Path) -> list[MetricsRow]:
        """Every row of a metrics file (a line cut short by a crash at its end is left out)."""
        text = path.read_text()
        return [cls.from_dict(json.loads(line)) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]
