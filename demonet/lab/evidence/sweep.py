"""`demonet bench`'s sweep: every system on every swarm, each run saved as it ends and read back for a report.

A bench module: the standard library, tqdm, and the package's `run_system`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from . import SYSTEMS, BenchSetup, Run, Swarm, run_system

__all__ = ["load_runs", "run_bench", "save_run"]


def run_bench(setup: BenchSetup, systems: list[str], swarms: list[Swarm], out: Path,
              progress: bool = True) -> list[Run]:
    """Every system on every swarm, one after the other, each in its own lab."""
    from tqdm import tqdm

    runs = []
    for swarm in swarms:
        for name in systems:
            bar = tqdm(total=setup.steps, desc=f"{name} @ {swarm.label}", unit="step", disable=not progress)

            def update(done: int, bar: Any = bar) -> None:
                bar.update(max(0, min(done, setup.steps) - bar.n))

            try:
                run = run_system(SYSTEMS[name], setup, swarm, out / f"{name}-{swarm.folder}", on_step=update)
            finally:
                bar.close()
            save_run(run)
            runs.append(run)
    return runs


def save_run(run: Run) -> None:
    """``<run.out>/run.json``: the records and samples, so the report can be made again (`load_runs`)."""
    data = dataclasses.asdict(run)
    data.update(out=str(run.out), final_params=str(run.final_params) if run.final_params else None)
    (run.out / "run.json").write_text(json.dumps(data))


def load_runs(out: Path) -> list[Run]:
    """The runs `run_bench` saved under `out`, in the order they ran."""
    runs = []
    for path in out.glob("*/run.json"):
        data = json.loads(path.read_text())
        data.update(out=Path(data["out"]), final_params=Path(data["final_params"]) if data["final_params"] else None,
                    samples={h: [tuple(x) for x in v] for h, v in data["samples"].items()})
        runs.append(Run(**data))
    return sorted(runs, key=lambda r: r.launched_at)
