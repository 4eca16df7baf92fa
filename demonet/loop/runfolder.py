"""A run folder: the peers' metrics merged into one file, a summary, the loss plot and the compute/wait plot.

What `demonet up` and `demonet train` leave behind (`metrics.jsonl`, `summary.json`, `loss.png`). Reads the
peers' rows as `demonet.loop.rows.MetricsRow`, the class the round loop writes them with.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .rows import MetricsRow

_Row = TypeVar("_Row")

__all__ = ["final_rows", "loss_figure", "merge_metrics", "pipeline_figure", "plot_loss", "plot_pipeline",
           "summarize_run", "to_json"]


def to_json(obj: Any) -> str:
    """Indented JSON with null for NaN and infinities (which JSON does not have)."""

    def finite(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [finite(v) for v in x]
        return x

    return json.dumps(finite(obj), indent=2, allow_nan=False)


def final_rows(rows: Sequence[_Row], round_of: Callable[[_Row], int] = lambda r: int(r["round"])  # type: ignore[index]
               ) -> list[_Row]:
    """One peer's metrics rows without the rounds it did again: a row for round r replaces the peer's
    earlier rows from r on. A peer does rounds again after a coordinator restarted from a state written
    before those rounds were published (the state is written after the publish); the last rows stand.
    `round_of`: a row's round (default: rows as JSON objects)."""
    kept: list[_Row] = []
    for row in rows:
        while kept and round_of(kept[-1]) >= round_of(row):
            kept.pop()
        kept.append(row)
    return kept


def merge_metrics(out: Path) -> list[MetricsRow]:
    """Merge the peers' ``metrics-<peer>.jsonl`` files into ``<out>/metrics.jsonl``, sorted by (round, peer),
    each peer's `final_rows`.

    Returns:
        the merged rows.
    """
    rows: list[MetricsRow] = []
    for path in sorted(out.glob("metrics-*.jsonl")):
        rows += final_rows(MetricsRow.read(path), lambda r: r.round)
    rows.sort(key=lambda r: (r.round, r.peer))
    with open(out / "metrics.jsonl", "w") as f:
        f.writelines(r.to_json() + "\n" for r in rows)
    return rows


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _pace(rows: Sequence[MetricsRow]) -> float:
    """Wall-clock seconds per round between a peer's first and last rows (NaN with fewer than 2 timed rows)."""
    timed = sorted((r.round, r.time) for r in rows if r.time)
    if len(timed) < 2 or timed[-1][0] == timed[0][0]:
        return float("nan")
    return (timed[-1][1] - timed[0][1]) / (timed[-1][0] - timed[0][0])


def summarize_run(rows: Sequence[MetricsRow]) -> dict[str, Any]:
    """What a run folder's metrics say: losses, bytes, and whether the peers' digests agreed.

    Returns:
        rounds and peers seen; first and last loss (mean over peers, then over the first and last
        max(1, min(10, rounds // 4)) rounds); mean bytes up/down per peer per round, overall and by
        peer; mean compute and wait seconds per round by peer (wait: the time its training was blocked
        on the network); s_per_round, by peer and overall (the median peer's), the wall-clock seconds
        between its rows (`time`) per round after its first (an overlapped round's `round_time_s` spans the
        next round's forward and backward: this is its pace); digests_agree (every round's peers reported
        one digest) and the rounds where not.
    """
    by_round: dict[int, list[MetricsRow]] = {}
    by_peer: dict[str, list[MetricsRow]] = {}
    for r in rows:
        by_round.setdefault(r.round, []).append(r)
        by_peer.setdefault(r.peer, []).append(r)
    rounds = sorted(by_round)
    history = [_mean([r.loss for r in by_round[n]]) for n in rounds]
    window = max(1, min(10, len(history) // 4))
    disagree = [n for n in rounds if len({r.param_digest for r in by_round[n]}) > 1]
    return {
        "rounds": len(rounds),
        "peers": len(by_peer),
        "first_loss": _mean(history[:window]),
        "last_loss": _mean(history[-window:]),
        "loss_window_rounds": window,  # first_loss and last_loss are means over this many rounds, not one
        "bytes_up_per_round": _mean([r.bytes_up for r in rows]),
        "bytes_down_per_round": _mean([r.bytes_down for r in rows]),
        "per_peer": {peer_id: {"rounds": len(rs), "bytes_up_per_round": _mean([r.bytes_up for r in rs]),
                               "bytes_down_per_round": _mean([r.bytes_down for r in rs]),
                               "compute_s": _mean([r.compute_s for r in rs]),
                               "wait_s": _mean([r.wait_s for r in rs]),
                               "s_per_round": _pace(rs)}
                     for peer_id, rs in sorted(by_peer.items())},
        "s_per_round": _median([x for x in map(_pace, by_peer.values()) if not math.isnan(x)]),
        "digests_agree": bool(rows) and not disagree,
        "disagreeing_rounds": disagree,
    }


def plot_loss(rows: Sequence[MetricsRow], path: Path) -> None:
    """Write a PNG of each peer's training loss by round, and their mean."""
    _save(loss_figure(rows), path)


def plot_pipeline(rows: Sequence[MetricsRow], path: Path) -> None:
    """Write a PNG of the seconds per round each peer spent computing and waiting for the network (the
    mean over the peers, stacked: their sum is the round's length for a peer that never idles otherwise)."""
    _save(pipeline_figure(rows), path)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path)
    _pyplot().close(fig)


def loss_figure(rows: Sequence[MetricsRow]) -> Any:
    """The figure of `plot_loss` (a matplotlib Figure), titled with the run's peers and rounds."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _pyplot().subplots(figsize=(7, 4), dpi=100)
    by_peer: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        by_peer.setdefault(r.peer, []).append((r.round, r.loss))
    for peer_id, points in sorted(by_peer.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], linewidth=0.8, alpha=0.5, label=peer_id)
    by_round: dict[int, list[float]] = {}
    for r in rows:
        by_round.setdefault(r.round, []).append(r.loss)
    rounds = sorted(by_round)
    ax.plot(rounds, [_mean(by_round[n]) for n in rounds], color="black", linewidth=1.6, label="mean")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("training loss")
    ax.set_title(f"Training loss by round: {len(by_peer)} peers, {len(rounds)} rounds")
    ax.grid(alpha=0.3)
    if len(by_peer) <= 10:
        ax.legend(fontsize="small")
    return fig


def pipeline_figure(rows: Sequence[MetricsRow]) -> Any:
    """The figure of `plot_pipeline` (a matplotlib Figure)."""
    from matplotlib.ticker import MaxNLocator

    by_round: dict[int, list[MetricsRow]] = {}
    for r in rows:
        by_round.setdefault(r.round, []).append(r)
    rounds = sorted(by_round)
    compute = [_mean([r.compute_s for r in by_round[n]]) for n in rounds]
    wait = [_mean([r.wait_s for r in by_round[n]]) for n in rounds]
    overlap = ", ".join(str(o) for o in sorted({r.overlap for r in rows}))
    fig, ax = _pyplot().subplots(figsize=(7, 4), dpi=100)
    ax.stackplot(rounds, compute, wait, labels=["compute", "wait for the network"], colors=["#4c72b0", "#dd8452"],
                 alpha=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("seconds per round (mean over peers)")
    ax.set_title(f"Time per round: compute and wait for the network (overlap = {overlap})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper right")
    return fig
