"""The services layer's round loop: one peer's rounds over any transport (`RoundLoop`), its pipelines, its
metrics rows, the local cluster (`demonet.loop.local`) and the run folder (`demonet.loop.runfolder`).

Imports the training side and the transport protocols; `demonet.loop.local` alone imports the coordinator,
and is imported by name, never from here.
"""

from __future__ import annotations

from .round_loop import RoundLoop
from .rows import MetricsRow
from .state import STOP_GRACE_S, RoundLog, RoundOutcome

__all__ = ["STOP_GRACE_S", "MetricsRow", "RoundLog", "RoundLoop", "RoundOutcome"]
