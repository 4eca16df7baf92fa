"""Every script in bench/ runs at its `--smoke` size and prints its table.

A smoke run checks that a maintainer can still rerun the script behind a figure of docs/benchmarks.md; its
numbers are not measurements and nothing here asserts them.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180

SCRIPTS = {
    "attacks.py": r"^aggregates\s+shared\s+(\d+\.\d+|inf)x\s+.*\{\"codes\": ",
    "cli_start.py": r"^\| demonet --help \| \d+\.\d+ \| no \| (met|NOT met) \|$",
    "coordinator_scale.py": r"^\s+4\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+\s+\d+$",
    "data_reads.py": r"^\| 128 \| 8 \| 40 \| [\d,]+ \| [\d,]+ \| \d+\.\d{3}x \| [\d,]+ \|",
    "dht_exchange_cpu.py": r"^\| 4 \| \d+\.\d+ \| \d+\.\d+ \| \d+\.\d+ \| \d+\.\d+ \| \d+\.\d+ \| [\d,]+ \| [\d,]+ \|$",
    "dht_round.py": r"^\| dht verify=0\.25 \| 2 \| \d+\.\d+ \| \d+\.\d+ \| \d+\.\d+x \|.*\| yes \|",
    "evidence.py": r"^(smoke: skipped, .+|\| 100 Mbit/s \| demonet \| 2 \| .*x fewer \|.*)$",
    "flexdemo.py": r"^bytes between nodes per step, per node: FlexDeMo \d+ B .* ratio \d+\.\dx",
    "graceful_stop.py": r"^\| this tree \| 1 \| \d+\.\d+ \| \d+\.\d+ \| \d+\.\d+ \|$",
    "idle_members.py": r"^20 fakes, max_idle_rounds=\d+\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+\s+22\s+0\s+2$",
    "mixed_links.py": r"^(smoke: skipped, .+|automatic\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+\s+agree\s+\d+)",
    "mixed_speed.py": r"^automatic\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+\s+(?:\d+\.\d s|-)\s+\d+\s+\d+\s+agree\s+\d",
    "optim_step.py": r"^ratio DeMo step / forward\+backward: \d+\.\d%$",
    "overlap_loss.py": r"^\| overlap \| \d+\.\d+ \| \d+\.\d+ \| \d+\.\d+x \| \d+\.\d+x \| 1 \|$",
    "robust_aggregate.py": r"^\s+4\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+\s+(met|NOT met)$",
    "round_latency.py": r"^\| 25 \| 1 \| this tree \| \d+\.\d+ \| \d+\.\d+ \| -?\d+\.\d+ \|$",
    "round_overhead.py": r"^\| 1 \| \d+ \| \d+\.\d+ \| \d+\.\d+ \| \d+\.\d+x \| \d+\.\d+ \| \d+\.\d+x \|.*\| yes \|",
    "step_ops.py": r"^ratio 8 blocks / 6 blocks: \d+\.\d\d \(bound [\d.]+\); \d+ ops at 6 blocks \(bound \d+\): met$",
    "signatures.py": r"^\| verify it \(coordinator\) \| \d+\.\d \|$",
    "task_vs_adamw.py": r"^loss at equal steps \(3\), demonet / AdamW, mean of the last \d+: \d+\.\d+",
    "value_coding.py": r"^\| one peer's \(fp32 values\) \| fp32 \| [\d,]+ \| [\d,]+ \| \d\.\d+ \|",
    "volunteer_join.py": r"^\| 3 \| [\d,]+ \| [\d,]+ \| \d+\.\d{3}x \| [\d,]+ \| [\d,]+ \|$",
    "wire_bytes.py": r"^fp32\s+entropy\s+real\s+[\d,]+\s+\d+\.\d%",
}
"""Each script, and a line of the table it prints (a figure, not only a header)."""
HELPERS = {"attackers.py"}
"""Modules of bench/ that a script imports; not scripts of their own."""


def test_every_bench_script_has_a_smoke_check() -> None:
    assert sorted(p.name for p in (ROOT / "bench").glob("*.py") if p.name not in HELPERS) == sorted(SCRIPTS)


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_the_script_runs_at_smoke_size_and_prints_its_table(script: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / script), "--smoke"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # the script's own processes too (demonet up's peers, a DHT peer's p2pd)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if timed_out:
        out, err = proc.communicate()
    assert not timed_out, f"{script} ran past {TIMEOUT_S} s\n{out[-3000:]}\n{err[-3000:]}"
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    assert re.search(SCRIPTS[script], out, re.MULTILINE), f"{script} printed no table line\n{out[-3000:]}"
