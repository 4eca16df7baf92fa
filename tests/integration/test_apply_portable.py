"""The apply gives the same bits under every CPU kernel level and thread count (and on CUDA, where there is one).

The sign base has two paths to the same bits: a float32 GEMM whose sign is checked against its error
bound (where float32 GEMMs are IEEE) and the exact float64 decode (elsewhere); both are run.

Each setting runs `tests/apply_check.py` in its own process, since ATen picks its kernels when it
loads. The digests cover every base (sign, sgd, adamw) after several aggregates of varying widths,
with weight decay, on tiled, padded, 1-D, 4-D, bfloat16 and 0-d parameters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.apply_check import apply_digests

ROOT = Path(__file__).resolve().parents[2]
_LEVELS = ("DEFAULT", "AVX2", "AVX512")


def _settings() -> list[dict[str, str]]:
    """Kernel settings this CPU can run: every ATen level up to its own, and MKL/oneDNN held to SSE4."""
    own = torch.backends.cpu.get_cpu_capability()
    levels = _LEVELS[: _LEVELS.index(own) + 1] if own in _LEVELS else ("DEFAULT",)
    out = [{"ATEN_CPU_CAPABILITY": level.lower(), "THREADS": threads} for level in levels for threads in ("1", "2")]
    out.append({"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41",
                "THREADS": "1"})
    out.append({"THREADS": "2", "PRECISION": "medium"})  # float32 GEMMs may use bf16: the sign base's exact path
    return out


def _run(setting: dict[str, str], device: str = "cpu") -> dict[str, object]:
    env = {**os.environ, **{k: v for k, v in setting.items() if k not in ("THREADS", "PRECISION")},
           "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "tests" / "apply_check.py"), "--threads", setting.get("THREADS", "1"),
           "--device", device, "--matmul-precision", setting.get("PRECISION", "highest")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_apply_digests_agree_under_every_kernel_level_and_thread_count() -> None:
    settings = _settings()
    with ThreadPoolExecutor(max_workers=2) as pool:  # one process per setting; each waits on its own child
        runs = list(zip(settings, pool.map(_run, settings), strict=True))
    want = apply_digests()  # this process: the machine's own kernels, its own thread count
    for setting, got in runs:
        assert got["digests"] == want, f"{setting} ({got['capability']}, {got['threads']} threads)"
    # The kernel levels were really in force: the children report the level they were given.
    seen = {str(got["capability"]) for _, got in runs}
    assert "DEFAULT" in seen and torch.backends.cpu.get_cpu_capability() in seen


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_apply_digests_agree_between_cpu_and_cuda() -> None:
    assert _run({"THREADS": "2"}, device="cuda")["digests"] == apply_digests()
