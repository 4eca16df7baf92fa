"""`demonet coordinator --init FILE.safetensors` as a real process: it serves the file's parameters, refuses a
file that does not fit the model (exit 2, nothing served), and a saved state wins over it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from demonet.config import load_config
from demonet.coordinator.state import CanonicalState
from demonet.transport.grpc import GrpcClient
from demonet.wire.digest import param_digest
from tests.integration.common import listening_line, tiny_config
from tests.procs import Reaper

pytestmark = pytest.mark.slow

TOKEN = "test-token"
START_TIMEOUT_S = 90.0  # importing torch and building the model on a loaded 2-core machine


def _model_params(tmp: Path) -> dict[str, torch.Tensor]:
    """The tiny run's seeded parameters, in the model's order (what the coordinator builds from run.toml)."""
    (tmp / "run.toml").write_text(tiny_config(round_timeout_s=30.0, steps=5))
    cfg = load_config(tmp / "run.toml", {}, {})
    return {n: p.detach().clone() for n, p in CanonicalState(cfg).params.items()}


def _perturbed(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {n: p + 0.05 * torch.randn(p.shape, generator=gen) for n, p in params.items()}


def _argv(tmp: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "demonet", "coordinator", "--listen", "127.0.0.1:0", "--config",
            str(tmp / "run.toml"), *extra]


def _start(tmp: Path, reaper: Reaper, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    proc = reaper.add(subprocess.Popen(_argv(tmp, *extra), stdout=subprocess.PIPE,
                                       stderr=reaper.open(tmp / "coordinator.log", "a"),
                                       env={**os.environ, "DEMONET_TOKEN": TOKEN}))
    line = listening_line(proc, START_TIMEOUT_S)
    assert line.startswith("listening on "), (tmp / "coordinator.log").read_text()
    return proc, line.split()[-1]


async def _canonical(address: str, params: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
    """The digest `Status` reports, and the parameters a joiner downloads."""
    client = GrpcClient(address, token=TOKEN, peer_id="probe", reconnect_timeout_s=10.0)
    try:
        digest = (await client.status()).param_digest
        info = await client.join()
        expected = {n: (tuple(p.shape), p.dtype) for n, p in params.items()}
        _, tensors, _ = await client.get_parameters(info.round, expected)
        return digest, tensors
    finally:
        await client.close()


def test_coordinator_serves_the_init_file(tmp_path: Path, reap_children: Reaper) -> None:
    init = _perturbed(_model_params(tmp_path))
    save_file(dict(reversed(list(init.items()))), str(tmp_path / "init.safetensors"))  # file order is free
    proc, address = _start(tmp_path, reap_children, "--init", str(tmp_path / "init.safetensors"))
    try:
        digest, tensors = asyncio.run(_canonical(address, init))
    finally:
        reap_children.stop([proc], 15.0)
    assert digest == param_digest(init.items())
    assert all(torch.equal(tensors[n], t) for n, t in init.items())
    log = (tmp_path / "coordinator.log").read_text()
    assert "initial parameters from" in log and digest[:12] in log, log


@pytest.mark.parametrize("change", ["missing", "shape"])
def test_coordinator_refuses_an_init_file_that_does_not_fit(tmp_path: Path, change: str) -> None:
    params = _model_params(tmp_path)
    name = list(params)[4]
    if change == "missing":
        del params[name]
    else:
        params[name] = torch.zeros(7, 3)
    save_file(params, str(tmp_path / "init.safetensors"))
    proc = subprocess.run(_argv(tmp_path, "--init", str(tmp_path / "init.safetensors"), "--state-dir",
                                str(tmp_path / "state")),
                          capture_output=True, text=True, timeout=START_TIMEOUT_S,
                          env={**os.environ, "DEMONET_TOKEN": TOKEN})
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "listening on" not in proc.stdout
    assert f"'{name}'" in proc.stderr and "demonet coordinator: --init" in proc.stderr, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert not (tmp_path / "state").exists()


def test_a_saved_state_wins_over_init(tmp_path: Path, reap_children: Reaper) -> None:
    params = _model_params(tmp_path)
    saved = CanonicalState(load_config(tmp_path / "run.toml", {}, {}))
    saved.set_params(_perturbed(params))
    saved.save(tmp_path / "state", {"rounds": {"round": 3, "members": [], "joiners": []}, "counters": {}})
    save_file({n: t * 3 for n, t in params.items()}, str(tmp_path / "init.safetensors"))
    proc, address = _start(tmp_path, reap_children, "--init", str(tmp_path / "init.safetensors"),
                           "--state-dir", str(tmp_path / "state"))
    try:
        digest, _ = asyncio.run(_canonical(address, params))
    finally:
        reap_children.stop([proc], 15.0)
    assert digest == saved.digest
    log = (tmp_path / "coordinator.log").read_text()
    assert "ignored: resuming from the state saved in" in log, log
