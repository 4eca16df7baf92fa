"""The compose topology run as processes on separate "VMs": one network namespace per machine, real veth
links through a bridge. The commands, secrets, configs and volumes come from deploy/compose.yaml itself
(the service names resolve through DEMONET_COORDINATOR, as on VMs without compose's DNS)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from demonet.lab import netlab
from tests.deploy.common import DEPLOY, SECRETS_DIR, healthcheck_argv, load_compose, load_dockerfile, parse_command
from tests.integration.common import tiny_config

ok, why = netlab.available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not ok, reason=why)]

STEPS = 5
PORT = 7450
_PROGRAMS = {"demonet": "demonet", "demonet-health": "demonet.health"}  # run as `python -m` (the console scripts)


class Machine:
    """One VM: a lab host and its own disk (a folder standing in for the named volumes)."""

    def __init__(self, host: netlab.Host, disk: Path) -> None:
        self.host, self.disk = host, disk
        disk.mkdir(parents=True)

    def argv(self, service: dict[str, Any], compose: dict[str, Any], argv: list[str]) -> list[str]:
        """A container's argv as a process on this machine: programs by module, mounts by host paths."""
        files = {f"{SECRETS_DIR}/{name}": compose["secrets"][name]["file"] for name in service.get("secrets", [])}
        files |= {c["target"]: compose["configs"][c["source"]]["file"] for c in service.get("configs", [])}
        mounts = [v.split(":")[1] for v in service.get("volumes", [])]
        out = [sys.executable, "-m", _PROGRAMS[argv[0]]]
        for arg in argv[1:]:
            if arg in files:
                arg = str(files[arg])
            else:
                for target in mounts:
                    if PurePosixPath(arg).is_relative_to(target):
                        arg = str(self.disk / PurePosixPath(arg).relative_to(target))
            out.append(arg)
        return out

    def env(self, service: dict[str, Any]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEMONET_")}  # the token comes from the file
        env.update({str(k): str(v) for k, v in (service.get("environment") or {}).items()})
        env["PYTHONUNBUFFERED"] = "1"
        return env


def _wait_healthy(machine: Machine, argv: list[str], env: dict[str, str], proc: subprocess.Popen[Any],
                  timeout_s: float) -> None:
    """What `depends_on: condition: service_healthy` waits for: the healthcheck command exits 0."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the coordinator exited with {proc.returncode}"
        if machine.host.run(argv, env=env, capture_output=True, timeout=30).returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"the coordinator was not healthy within {timeout_s:.0f} s")


def test_compose_topology_on_three_machines(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("deploy-test-token\n")
    run_config = tmp_path / "run.toml"
    run_config.write_text(tiny_config(round_timeout_s=30.0, steps=STEPS, start_peers=2, heartbeat_timeout_s=30.0))
    dockerfile = load_dockerfile(DEPLOY / "Dockerfile")
    with netlab.Lab() as lab, ExitStack() as files:
        coord = Machine(lab.add_host("coordinator", mbit=100), tmp_path / "coordinator")
        peers = [Machine(lab.add_host(f"peer-{i}", mbit=100), tmp_path / f"peer-{i}") for i in range(2)]
        compose = load_compose(DEPLOY / "compose.yaml", {
            "DEMONET_COORDINATOR": f"{coord.host.addr}:{PORT}", "DEMONET_TOKEN_FILE": str(token),
            "DEMONET_RUN_CONFIG": str(run_config)})
        c_svc, p_svc = compose["services"]["coordinator"], compose["services"]["peer"]
        c_cmd = [*dockerfile.entrypoint, *c_svc["command"]]
        p_cmd = [*dockerfile.entrypoint, *p_svc["command"]]
        assert parse_command(c_cmd)[0] == "coordinator" and parse_command(p_cmd)[0] == "peer"

        c_log = files.enter_context(open(tmp_path / "coordinator.log", "w"))
        c_proc = coord.host.popen(coord.argv(c_svc, compose, c_cmd), env=coord.env(c_svc), cwd=coord.disk,
                                  stdout=c_log, stderr=subprocess.STDOUT)
        c_health = coord.argv(c_svc, compose, healthcheck_argv(c_svc["healthcheck"]["test"]))
        _wait_healthy(coord, c_health, coord.env(c_svc), c_proc, timeout_s=60)

        p_procs, p_logs = [], []
        for i, m in enumerate(peers):
            p_logs.append(files.enter_context(open(tmp_path / f"peer-{i}.log", "w")))
            p_procs.append(m.host.popen(m.argv(p_svc, compose, p_cmd), env=m.env(p_svc), cwd=m.disk,
                                        stdout=p_logs[-1], stderr=subprocess.STDOUT))
        # A peer's healthcheck, from its own machine: the coordinator answers across the link.
        p_health = peers[0].argv(p_svc, compose, healthcheck_argv(p_svc["healthcheck"]["test"]))
        assert peers[0].host.run(p_health, env=peers[0].env(p_svc), capture_output=True).returncode == 0

        deadline = time.monotonic() + 90
        for proc in p_procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        logs = {f"peer-{i}": (tmp_path / f"peer-{i}.log").read_text() for i in range(2)}
        assert [p.returncode for p in p_procs] == [0, 0], logs

        # Each machine's run folder (its own volume) holds its metrics; the digests agree round by round.
        digests: dict[int, set[str]] = {}
        for m in peers:
            files = list((m.disk / "run").glob("metrics-*.jsonl"))
            assert len(files) == 1, files
            rows = [json.loads(line) for line in files[0].read_text().splitlines()]
            assert [r["round"] for r in rows] == list(range(STEPS))
            assert all(r["contributors"] == 2 for r in rows)
            for r in rows:
                digests.setdefault(r["round"], set()).add(r["param_digest"])
            assert list((m.disk / "run").glob("peer-*.pt"))
        assert all(len(d) == 1 for d in digests.values()), digests
        assert (coord.disk / "coordinator").is_dir()  # the state dir on the coordinator's volume

        # docker stop: SIGTERM; the coordinator exits 0 and the peers' healthcheck turns unhealthy.
        c_proc.send_signal(signal.SIGTERM)
        assert c_proc.wait(timeout=30) == 0, (tmp_path / "coordinator.log").read_text()
        down = peers[1].host.run(peers[1].argv(p_svc, compose, healthcheck_argv(p_svc["healthcheck"]["test"])),
                                 env=peers[1].env(p_svc), capture_output=True, text=True)
        assert down.returncode == 1 and "UNAVAILABLE" in down.stderr, down.stderr
