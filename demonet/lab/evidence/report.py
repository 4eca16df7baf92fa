"""What the bench runs say: loss by step and by time, bytes per peer per step, time to a target loss.

A bench module: reads `Run`s (step records and link counter samples) and writes results.json, a
markdown table and PNG plots; imports torch only to evaluate the final parameters.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from demonet.train.data import Batches, load_corpus, split
from demonet.train.model import GPT, ModelConfig

from . import SYSTEMS, BenchSetup, Run

__all__ = ["curve", "eval_loss", "mixed_table", "summarize", "table", "plot"]

SMOOTH = 5
"""Losses are averaged over peers, then over this many trailing steps (a batch of 16 x 64 bytes is noisy)."""


def curve(run: Run) -> tuple[list[int], list[float], list[float]]:
    """(steps, seconds since training started, mean loss over the peers) by step.

    A step's time is when its last peer finished it (or a step before it, if later: hivemind peers finish
    steps out of order); time 0 is when the last peer was ready to train (setup is not counted).
    """
    by_step: dict[int, list[dict[str, Any]]] = {}
    for records in run.peers:
        for r in records:
            by_step.setdefault(int(r["step"]), []).append(r)
    starts = [r["time"] for r in by_step.get(0, [])]
    if not starts:
        return [], [], []
    t0 = max(starts)  # the last peer ready: a demonet peer waits for the others' parameter downloads
    # hivemind peers can skip a global step (they load the state of a later one): a step counts once
    # any peer did it, so its time is when the last of the peers that did it finished.
    steps = sorted(s for s in by_step if s > 0)
    times = list(itertools.accumulate((max(r["time"] for r in by_step[s]) - t0 for s in steps), max))  # never back
    losses = [statistics.fmean(float(r["loss"]) for r in by_step[s]) for s in steps]
    return steps, times, losses


def smooth(values: Sequence[float], n: int = SMOOTH) -> list[float]:
    return [statistics.fmean(values[max(0, i - n + 1):i + 1]) for i in range(len(values))]


def _at(samples: list[tuple[float, int, int]], t: float) -> tuple[float, float]:
    """A host's (tx, rx) counters at time t, interpolated between the samples around it."""
    before = [s for s in samples if s[0] <= t] or samples[:1]
    after = [s for s in samples if s[0] >= t] or samples[-1:]
    (t0, tx0, rx0), (t1, tx1, rx1) = before[-1], after[0]
    w = 0.0 if t1 == t0 else (t - t0) / (t1 - t0)
    return tx0 + w * (tx1 - tx0), rx0 + w * (rx1 - rx0)


def bytes_per_step(run: Run, host: str) -> tuple[float, float]:
    """(sent, received) bytes per step on `host`'s link, in steady state: from the end of step n/5
    (after the parameter download / broadcast and the warm-up) to the end of the last step n."""
    steps, times, _ = curve(run)
    samples = run.samples.get(host, [])
    if len(steps) < 2 or len(samples) < 2:
        return math.nan, math.nan
    t0 = max(r["time"] for rs in run.peers for r in rs if r["step"] == 0)
    i = max(0, len(steps) // 5 - 1)
    (tx_a, rx_a), (tx_b, rx_b) = _at(samples, t0 + times[i]), _at(samples, t0 + times[-1])
    n = steps[-1] - steps[i]
    return (tx_b - tx_a) / n, (rx_b - rx_a) / n


def eval_loss(path: Path | None, model: ModelConfig, seq_len: int, batches: int = 16) -> float:
    """Validation loss of saved parameters on fixed batches of the held-out split (the same for every run)."""
    if path is None:
        return math.nan
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = state.get("model", state)  # a demonet checkpoint holds the model under "model"
    net = GPT(model)
    net.load_state_dict(state)
    net.eval()
    _, val = split(load_corpus())
    data = Batches(val, batch_size=8, seq_len=seq_len, seed=12345)
    with torch.no_grad():
        return statistics.fmean(float(net(*next(data))[1]) for _ in range(batches))


def _time_to(target: float, times: list[float], losses: list[float]) -> float:
    for t, loss in zip(times, smooth(losses), strict=True):
        if loss <= target:
            return t
    return math.nan


def _steps_to(target: float, steps: list[int], losses: list[float]) -> int | None:
    for s, loss in zip(steps, smooth(losses), strict=True):
        if loss <= target:
            return s
    return None


def _samples_per_step(run: Run, batch_size: int) -> float:
    """Median sequences per global step, as the records say: a demonet row's samples (more than one
    micro-batch's where its round went by the clock), a hivemind step's local batches (NaN for records without
    them), else one batch of `batch_size` a peer."""
    per_step: dict[int, int] = {}
    for records in run.peers:
        for r in (r for r in records if r["step"] > 0):
            if r.get("samples"):
                n = int(r["samples"])
            elif run.system == "hivemind" and "batches" not in r:
                return math.nan
            else:
                n = int(r.get("batches", 1)) * batch_size
            per_step[r["step"]] = per_step.get(r["step"], 0) + n
    return float(statistics.median(per_step.values())) if per_step else math.nan


def swarm_figures(run: Run, batch_size: int) -> dict[str, Any]:
    """Samples trained per second (every peer's samples over the rounds not aborted, over the training time of
    `curve`) and each peer's median micro-batches a round. A record without "samples" took its "batches" (1
    where it says none) of `batch_size` sequences, each batch one micro-batch."""
    _, times, _ = curve(run)
    records = [[r for r in rs if r["step"] > 0 and not r.get("aborted", False)] for rs in run.peers]
    micro = [[int(r.get("micro_batches") or r.get("batches", 1)) for r in rs] for rs in records]
    samples = sum(int(r.get("samples") or batch_size * m) for rs, ms in zip(records, micro, strict=True)
                  for r, m in zip(rs, ms, strict=True))
    return {"samples_per_s": samples / times[-1] if times and times[-1] > 0 else math.nan,
            "micro_batches": [statistics.median(ms) if ms else math.nan for ms in micro]}


def default_target(runs: Sequence[Run], setup: BenchSetup) -> float:
    """3% above the smoothed loss AdamW-DDP reaches at half the steps on the fastest link (else above the
    loss every run reached). The curves flatten there, so a target on the plateau itself would be hit or
    missed by noise; 3% above it lies on the descent, and "within 3% of AdamW-DDP" is the loss goal."""
    ddp = [r for r in runs if r.system == "adamw-ddp" and r.finished]
    if ddp:
        steps, _, losses = curve(max(ddp, key=lambda r: r.mbit))
        return 1.03 * smooth(losses)[min(len(steps), setup.steps // 2) - 1]
    return 1.03 * max(min(smooth(curve(r)[2]) or [math.inf]) for r in runs)


def _beside(runs: Sequence[Run], run: Run, system: str) -> Run | None:
    """`system`'s run on the same swarm as `run`, if any."""
    return next((r for r in runs if r.system == system and r.swarm.label == run.swarm.label), None)


def summarize(runs: Sequence[Run], setup: BenchSetup, target: float | None = None) -> dict[str, Any]:
    """Per run: steps done, mean step time, bytes per peer per step, time to the target, final losses."""
    target = default_target(runs, setup) if target is None else target
    fastest = {r.system: r for r in sorted(runs, key=lambda r: r.mbit)}  # the last one wins: highest mbit
    rows = []
    for run in runs:
        steps, times, losses = curve(run)
        per_host = [bytes_per_step(run, h) for h in run.peer_hosts]
        sent, recv = [b[0] for b in per_host], [b[1] for b in per_host]
        # Mean over the run, stalls included (hivemind's out-of-order steps leave no median of gaps).
        step_s = (times[-1] - times[0]) / (steps[-1] - steps[0]) if len(steps) > 1 else math.nan
        reached = _time_to(target, times, losses)
        # A run stopped by the time cap: the steps this system needed on the fastest link, at this link's pace.
        ref = curve(fastest[run.system])
        need = _steps_to(target, ref[0], ref[2])
        projected = reached if not math.isnan(reached) else (need * step_s if need else math.nan)
        t0 = max((r["time"] for rs in run.peers for r in rs if r["step"] == 0), default=math.nan)
        rows.append({
            "system": run.system, "label": SYSTEMS[run.system].label, "mbit": run.mbit, "swarm": run.swarm.label,
            "mixed": run.swarm.mixed, "peers": len(run.peers), "finished": run.finished,
            "steps": steps[-1] if steps else 0, "train_s": times[-1] if times else math.nan,
            "setup_s": t0 - run.launched_at, "run_s": run.ended_at - run.launched_at, "step_s": step_s,
            "loss_last": smooth(losses)[-1] if losses else math.nan,
            "val_loss": eval_loss(run.final_params, setup.model, setup.seq_len),
            "sent_per_step": statistics.median(sent) if sent else math.nan,
            "recv_per_step": statistics.median(recv) if recv else math.nan,
            "time_to_target_s": reached, "projected_time_to_target_s": projected,
            "steps_to_target": _steps_to(target, steps, losses),
            "samples_per_step": _samples_per_step(run, setup.batch_size),
            **swarm_figures(run, setup.batch_size),
        })
    for row, run in zip(rows, runs, strict=True):  # loss at an equal number of steps, against AdamW-DDP
        ddp = _beside(runs, run, "adamw-ddp")
        mine, theirs = curve(run), curve(ddp) if ddp else ([], [], [])
        k = min(len(mine[0]), len(theirs[0]))
        row["loss_vs_ddp"] = smooth(mine[2])[k - 1] / smooth(theirs[2])[k - 1] - 1 if k else math.nan
        row["loss_vs_ddp_step"] = mine[0][k - 1] if k else 0
    for row, run in zip(rows, runs, strict=True):
        row.update(pipeline(run, _beside(runs, run, "demonet")))
    return {"target_loss": target, "runs": rows}


def pipeline(run: Run, plain: Run | None) -> dict[str, Any]:
    """A demonet run's round against its compute: the mean blocking torch work per round (compute_s), the
    mean time training waited for the network (wait_s), and compute-only rounds per second as a fraction
    of those it did (1.0: the network costs nothing); its loss against plain demonet's (`plain`, the same
    link) at an equal number of rounds."""
    records = [r for rs in run.peers for r in rs if r["step"] > 0 and "compute_s" in r]
    if not records:
        return {}
    steps, times, losses = curve(run)
    step_s = (times[-1] - times[0]) / (steps[-1] - steps[0]) if len(steps) > 1 else math.nan
    compute_s = statistics.fmean(r["compute_s"] for r in records)
    out = {"compute_s": compute_s, "wait_s": statistics.fmean(r["wait_s"] for r in records),
           "compute_fraction": compute_s / step_s if step_s > 0 else math.nan, "loss_vs_plain": math.nan}
    if plain is not None and plain is not run:
        theirs = curve(plain)
        k = min(len(steps), len(theirs[0]))
        if k:
            window = slice(max(0, k - SMOOTH), k)
            out["loss_vs_plain"] = statistics.fmean(losses[window]) / statistics.fmean(theirs[2][window]) - 1
            out["loss_vs_plain_step"] = steps[k - 1]
    return out


def pipeline_table(summary: dict[str, Any]) -> str:
    """The demonet runs' rounds against their compute (`pipeline`), as markdown."""
    out = ["| link | system | rounds | compute s/round | wait s/round | s/round | rounds/s vs compute-only | "
           "loss vs demonet, same round |", "|---|---|---|---|---|---|---|---|"]
    for r in summary["runs"]:
        if "compute_s" in r:
            out.append(f"| {r['swarm']} | {r['system']} | {r['steps']} | {_fmt(r['compute_s'])} | "
                       f"{_fmt(r['wait_s'])} | {_fmt(r['step_s'])} | {_fmt(r['compute_fraction'], '.2f')} | "
                       f"{_fmt(100 * r['loss_vs_plain'], '+.1f')}% |")
    return "\n".join(out) + "\n"


def _fmt(x: float, spec: str = ".3g") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(summary: dict[str, Any]) -> str:
    """A markdown table with each run's figures and its ratios to AdamW-DDP at the same link speed."""
    ddp = {r["swarm"]: r for r in summary["runs"] if r["system"] == "adamw-ddp"}
    out = [f"Target loss (smoothed training loss over {SMOOTH} steps): {summary['target_loss']:.4f}", "",
           "| link | system | steps | seqs/step | s/step | loss at last step | vs DDP, same step | val loss | "
           "sent B/peer/step | recv B/peer/step | bytes vs DDP | time to target (s) | speed-up vs DDP |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["runs"]:
        base = ddp.get(r["swarm"])
        total = r["sent_per_step"] + r["recv_per_step"]
        fewer = (base["sent_per_step"] + base["recv_per_step"]) / total if base and total else math.nan
        tt = r["time_to_target_s"]
        shown = _fmt(tt, ".1f") if not math.isnan(tt) else f"~{_fmt(r['projected_time_to_target_s'], '.0f')} (proj.)"
        base_t = (base["time_to_target_s"] if base and not math.isnan(base["time_to_target_s"])
                  else base["projected_time_to_target_s"] if base else math.nan)
        speed = base_t / r["projected_time_to_target_s"] if r["projected_time_to_target_s"] else math.nan
        out.append(f"| {r['swarm']} | {r['system']} | {r['steps']} | {_fmt(r['samples_per_step'], '.0f')} | "
                   f"{_fmt(r['step_s'])} | "
                   f"{_fmt(r['loss_last'], '.4f')} | {_fmt(100 * r['loss_vs_ddp'], '+.1f')}% "
                   f"@{r['loss_vs_ddp_step']} | {_fmt(r['val_loss'], '.4f')} | "
                   f"{_fmt(r['sent_per_step'], '.3e')} | {_fmt(r['recv_per_step'], '.3e')} | "
                   f"{_fmt(fewer, '.1f')}x fewer | {shown} | {_fmt(speed, '.1f')}x |")
    return "\n".join(out) + "\n"


def mixed_table(summary: dict[str, Any]) -> str:
    """The mixed swarms' runs (peers that differ in link or compute) as markdown: per system, samples trained
    per second, time to the target loss and each peer's median micro-batches a round; "" without any."""
    rows = [r for r in summary["runs"] if r["mixed"]]
    if not rows:
        return ""
    out = ["| swarm | system | peers | rounds | samples/s | time to target (s) | loss at last step | "
           "micro-batches a round, per peer (median) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tt = r["time_to_target_s"]
        shown = _fmt(tt, ".1f") if not math.isnan(tt) else f"~{_fmt(r['projected_time_to_target_s'], '.0f')} (proj.)"
        micro = ", ".join(_fmt(m, "g") for m in r["micro_batches"])
        out.append(f"| {r['swarm']} | {r['system']} | {r['peers']} | {r['steps']} | {_fmt(r['samples_per_s'], '.1f')} "
                   f"| {shown} | {_fmt(r['loss_last'], '.4f')} | {micro} |")
    return "\n".join(out) + "\n"


def plot(runs: Sequence[Run], target: float, out_dir: Path) -> list[Path]:
    """loss_vs_step.png and loss_vs_time.png: one panel per swarm (a link speed, or a mixed swarm), one line per
    system."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    by_label = {r.swarm.label: r.swarm for r in runs}
    swarms = sorted(by_label.values(), key=lambda s: (s.mixed, -s.fastest, s.label))
    paths = []
    for axis, name in ((1, "loss_vs_step.png"), (2, "loss_vs_time.png")):
        fig, axes = plt.subplots(1, len(swarms), figsize=(5 * len(swarms), 3.8), dpi=100, squeeze=False)
        for ax, swarm in zip(axes[0], swarms, strict=True):
            for run in (r for r in runs if r.swarm.label == swarm.label):
                c = curve(run)
                if c[0]:
                    ax.plot(c[axis - 1] if axis == 1 else c[1], smooth(c[2]), label=SYSTEMS[run.system].label)
            ax.axhline(target, color="grey", linestyle=":", linewidth=1)
            ax.set_title(f"{swarm.label} per link" if not swarm.mixed else swarm.label, fontsize="small")
            ax.set_xlabel("step" if axis == 1 else "wall-clock seconds")
            if axis == 2:
                ax.set_xscale("log")
            ax.set_ylabel("training loss")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
