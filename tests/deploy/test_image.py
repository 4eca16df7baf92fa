"""Opt-in: build deploy/Dockerfile with buildah (no Docker engine) from a local base image, then run the image.

    DEMONET_BUILDAH_BASE=localhost/python:3.11-slim \\
    DEMONET_BUILDAH_ARGS="--build-arg TORCH_INDEX= --build-arg PIP_FIND_LINKS=/wheels -v /opt/wheels:/wheels:ro" \\
    python -m pytest -q tests/deploy/test_image.py

DEMONET_BUILDAH_ARGS adds `buildah bud` arguments (a folder of wheels, a pip mirror); STORAGE_DRIVER picks
buildah's storage (vfs where overlay mounts are not allowed). deploy/README.md shows how to make a base.
The image is built in Docker's format: the OCI format has no HEALTHCHECK.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.common import DEPLOY, ROOT, load_dockerfile
from tests.integration.common import tiny_config

BASE = os.environ.get("DEMONET_BUILDAH_BASE", "")
TAG = "localhost/demonet:deploy-test"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not BASE, reason="opt-in: set DEMONET_BUILDAH_BASE to a local base image "
                                        "(e.g. localhost/python:3.11-slim)"),
    pytest.mark.skipif(shutil.which("buildah") is None, reason="buildah is not installed"),
]


def _buildah(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"buildah {' '.join(args)}: {out.stderr[-3000:]}")
    return out


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    if _buildah("images", "--quiet", BASE, check=False).returncode != 0:
        pytest.skip(f"no local image {BASE}")
    _buildah("bud", "--isolation", "chroot", "--format", "docker", "-f", str(DEPLOY / "Dockerfile"),
             "-t", TAG, "--build-arg", f"BASE_IMAGE={BASE}", *shlex.split(os.environ.get("DEMONET_BUILDAH_ARGS", "")),
             str(ROOT), timeout=1800)
    try:
        yield TAG
    finally:
        _buildah("rmi", "--force", TAG, check=False)


@pytest.fixture
def container(image: str) -> Iterator[str]:
    name = _buildah("from", "--pull-never", image).stdout.strip()
    try:
        yield name
    finally:
        _buildah("rm", name, check=False)


@pytest.mark.timeout(2400)
def test_image_config_matches_the_dockerfile(image: str) -> None:
    cfg = json.loads(_buildah("inspect", "--type", "image", image).stdout)
    oci, docker = cfg["OCIv1"]["config"], cfg["Docker"]["config"]
    dockerfile = load_dockerfile(DEPLOY / "Dockerfile")
    assert oci["User"] == dockerfile.user == "demonet"
    assert oci["Entrypoint"] == dockerfile.entrypoint and oci["Cmd"] == dockerfile.cmd
    assert docker["Healthcheck"]["Test"] == ["CMD", *dockerfile.healthcheck]
    assert not any(e.startswith("DEMONET_TOKEN") for e in oci.get("Env", []))


@pytest.mark.timeout(600)
def test_image_runs_a_short_run_as_non_root(container: str, tmp_path: Path) -> None:
    def run(*argv: str, volume: str = "") -> subprocess.CompletedProcess[str]:
        return _buildah("run", "--isolation", "chroot", *(["-v", volume] if volume else []), container, "--",
                        *argv, timeout=300, check=False)

    who = run("id", "-un")
    assert who.returncode == 0 and who.stdout.strip() == "demonet"
    version = run("python3", "-c", "import torch; print(torch.__version__)")
    assert version.stdout.startswith("2.13.0"), version.stderr
    down = run("demonet-health", "--coordinator", "127.0.0.1:1", "--timeout-s", "1")
    assert down.returncode == 1, down.stderr  # the HEALTHCHECK fails when nothing serves
    (tmp_path / "run.toml").write_text(tiny_config(round_timeout_s=30.0, steps=3))
    tmp_path.chmod(0o777)  # the container's user writes its run folder here
    up = run("demonet", "up", "--peers", "2", "--steps", "3", "--out", "/mnt/run", "--config", "/mnt/run.toml",
             "--no-progress", volume=f"{tmp_path}:/mnt")
    assert up.returncode == 0, up.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["peers"] == 2 and summary["digests_agree"]
