"""`demonet health` (the image's HEALTHCHECK) against a real coordinator: 0 while it serves, 1 when it does not
answer or is not serving what was asked, 2 on bad arguments; plaintext and TLS."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from demonet import cli, health
from demonet.config import load_config
from demonet.coordinator import CoordinatorOptions, serve
from tests.integration.common import tiny_config
from tests.procs import free_port

pytestmark = pytest.mark.slow


async def _start(tmp: Path, tls: tuple[bytes, bytes] | None = None) -> tuple[asyncio.Task[None], str]:
    (tmp / "run.toml").write_text(tiny_config(round_timeout_s=5.0, steps=3))
    cfg = load_config(tmp / "run.toml", {})
    listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(cfg, CoordinatorOptions(token="t", state_dir=None, total_rounds=3),
                                     listen="127.0.0.1:0", tls=tls, on_listening=listening.set_result))
    return task, await asyncio.wait_for(listening, 30)


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


@pytest.fixture
async def coordinator(tmp_path: Path) -> AsyncIterator[str]:
    task, address = await _start(tmp_path)
    try:
        yield address
    finally:
        await _stop(task)


async def test_serving_coordinator(coordinator: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert await asyncio.to_thread(health.main, ["--coordinator", coordinator]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert await asyncio.to_thread(health.main, ["--coordinator", coordinator, "--service",
                                                 "demonet.v1.Coordinator"]) == 0
    assert await asyncio.to_thread(health.main, ["--coordinator", coordinator, "--service", "nope"]) == 1
    assert capsys.readouterr().out.strip().endswith("SERVICE_UNKNOWN")
    # The same command through the `demonet` entry point.
    assert await asyncio.to_thread(cli.main, ["health", "--coordinator", coordinator]) == 0


async def test_down_or_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dead = f"127.0.0.1:{free_port()}"
    assert await asyncio.to_thread(health.main, ["--coordinator", dead, "--timeout-s", "2"]) == 1
    assert dead in capsys.readouterr().err
    assert health.main(["--timeout-s", "0"]) == 2
    assert health.main(["--tls-root-cert", str(tmp_path / "missing.pem")]) == 2
    assert "missing.pem" in capsys.readouterr().err

    task, address = await _start(tmp_path)
    assert await asyncio.to_thread(health.main, ["--coordinator", address]) == 0
    await _stop(task)
    assert await asyncio.to_thread(health.main, ["--coordinator", address, "--timeout-s", "2"]) == 1
    assert f"{address}: " in capsys.readouterr().err


def test_standalone_command_is_light() -> None:
    """The container's HEALTHCHECK runs `demonet-health`: it must not import torch (seconds per check)."""
    code = "import sys, demonet.health; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    dead = f"127.0.0.1:{free_port()}"
    down = subprocess.run([sys.executable, "-m", "demonet.health", "--coordinator", dead,
                           "--timeout-s", "1"], capture_output=True, text=True, timeout=60)
    assert down.returncode == 1 and dead in down.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_tls_coordinator(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=coordinator", "-addext",
                    "subjectAltName=DNS:coordinator"], check=True, capture_output=True, timeout=60)
    task, address = await _start(tmp_path, tls=(cert.read_bytes(), key.read_bytes()))
    try:
        ask = ["--coordinator", address, "--timeout-s", "3"]
        assert await asyncio.to_thread(health.main, ask) == 1  # plaintext to a TLS port
        assert await asyncio.to_thread(health.main, [*ask, "--tls-root-cert", str(cert)]) == 1  # wrong name
        assert await asyncio.to_thread(health.main, [*ask, "--tls-root-cert", str(cert),
                                                     "--tls-server-name", "coordinator"]) == 0
    finally:
        await _stop(task)
