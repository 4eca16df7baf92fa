"""deploy/ without a Docker engine: the compose files and the Dockerfile parse, every command they run is
accepted by demonet's own parsers, and the paths, ports and names they share agree with one another."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import PurePosixPath
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from demonet.config import Config, load_config
from tests.deploy.common import (
    DEPLOY,
    ROOT,
    SECRETS_DIR,
    healthcheck_argv,
    interpolate,
    load_compose,
    load_dockerfile,
    parse_command,
)

DOCKERFILE = load_dockerfile(DEPLOY / "Dockerfile")
COMPOSE = load_compose(DEPLOY / "compose.yaml")  # no variables set: every default applies
SERVICES: dict[str, Any] = COMPOSE["services"]


def _argv(service: dict[str, Any]) -> list[str]:
    """What the container runs: the image's ENTRYPOINT, then the service's command (or the image's CMD)."""
    entrypoint = service.get("entrypoint", DOCKERFILE.entrypoint)
    return [*entrypoint, *service.get("command", DOCKERFILE.cmd)]


def _mount_targets(service: dict[str, Any]) -> list[str]:
    return [v.split(":")[1] if isinstance(v, str) else v["target"] for v in service.get("volumes", [])]


def _under_a_mount(path: str, service: dict[str, Any]) -> bool:
    return any(PurePosixPath(path).is_relative_to(t) for t in _mount_targets(service))


def _secret_file(path: str, service: dict[str, Any]) -> None:
    """`path` is one of the service's secrets, as compose mounts them, and the secret is defined."""
    p = PurePosixPath(path)
    assert p.parent == PurePosixPath(SECRETS_DIR), f"{path} is not a secret's mount point"
    names = [s if isinstance(s, str) else s["source"] for s in service.get("secrets", [])]
    assert p.name in names, f"{path}: the service does not list the secret {p.name!r}"
    assert "file" in COMPOSE["secrets"][p.name], f"secret {p.name} has no file"


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _run_config(coordinator: dict[str, Any]) -> Config:
    """The run config the coordinator service runs with: the file compose mounts, then its command's flags."""
    _, args = parse_command(_argv(coordinator))
    path = DEPLOY / COMPOSE["configs"][coordinator["configs"][0]["source"]]["file"]
    return load_config(path, {}, {"net": {"start_peers": args.start_peers, "min_peers": args.min_peers,
                                          "round_timeout_s": args.round_timeout_s}})


def _gitignored(path: str, patterns: list[str]) -> bool:
    """Whether a .gitignore of these patterns (no negations) ignores `path`, relative to its folder."""
    parts = PurePosixPath(path).parts
    for pattern in patterns:
        if pattern.endswith("/"):
            if any(fnmatch.fnmatch(part, pattern.rstrip("/")) for part in parts[:-1]):
                return True
        elif any(fnmatch.fnmatch(part, pattern) for part in parts):
            return True
    return False


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("${SET:-d} ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} $SET $$SET", env) == "v d d  v $SET"
    assert interpolate("${SET:+alt}|${UNSET:+alt}", env) == "alt|"
    with pytest.raises(ValueError, match="UNSET"):
        interpolate("${UNSET:?needed}", env)


def test_the_checks_refuse_what_the_cli_refuses() -> None:
    with pytest.raises(AssertionError, match="--bogus"):
        parse_command(["demonet", "peer", "--coordinator", "h:1", "--bogus"])
    with pytest.raises(AssertionError, match="--nope"):
        parse_command(["demonet", "coordinator", "--nope", "1"])
    with pytest.raises(AssertionError, match="invalid int"):
        parse_command(["demonet", "coordinator", "--metrics-port", "nine"])
    with pytest.raises(AssertionError, match="not one of the installed commands"):
        parse_command(["sh", "-c", "demonet status"])
    with pytest.raises(AssertionError, match="--listen"):
        parse_command(["demonet-health", "--listen", "h:1"])


def test_the_dockerfile_runs_a_coordinator_and_checks_it() -> None:
    command, args = parse_command([*DOCKERFILE.entrypoint, *DOCKERFILE.cmd])
    assert command == "coordinator"
    health, hargs = parse_command(DOCKERFILE.healthcheck)
    assert health == "health" and _port(hargs.coordinator) == _port(args.listen)
    assert args.listen.startswith("0.0.0.0:"), "a container must listen on all interfaces"
    assert PurePosixPath(args.state_dir).is_relative_to("/data")


def test_the_dockerfile_builds_one_small_non_root_image() -> None:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    # The default base: a slim Python image of a version demonet supports.
    base = DOCKERFILE.args["BASE_IMAGE"]
    assert base is not None
    repository, _, tag = base.partition(":")
    python, _, flavour = tag.partition("-")
    assert repository == "python" and flavour == "slim", base
    assert Version(python) in SpecifierSet(project["requires-python"]), (base, project["requires-python"])
    # The pinned torch is one pyproject accepts, and the build README.md tells users to install.
    pin = DOCKERFILE.args["TORCH_VERSION"]
    torch_req = next(r for r in map(Requirement, project["dependencies"]) if r.name == "torch")
    assert pin is not None and Version(pin) in torch_req.specifier, (pin, str(torch_req))
    assert set(re.findall(r"torch==([\w.+]+)", (ROOT / "README.md").read_text())) == {pin}
    # deploy/README.md's table of build arguments gives the Dockerfile's defaults.
    table = (DEPLOY / "README.md").read_text().split("Build arguments:", 1)[1].strip().split("\n\n", 1)[0]
    documented = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, re.M))
    assert {"BASE_IMAGE", "TORCH_VERSION", "TORCH_VARIANT"} <= set(documented), documented
    assert {name: DOCKERFILE.args.get(name) for name in documented} == documented
    assert len(DOCKERFILE.stages) >= 2 and all(s.startswith("${BASE_IMAGE}") for s in DOCKERFILE.stages)
    assert DOCKERFILE.user not in ("", "root", "0")
    text = (DEPLOY / "Dockerfile").read_text()
    assert not re.search(r"^\s*(ENV|ARG)\s+DEMONET_TOKEN", text, re.M), "the token must not be baked in"
    assert '"torch==${TORCH_VERSION}"' in text


def test_the_build_context_keeps_what_the_dockerfile_copies() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def kept(path: str) -> bool:
        keep = True
        for pat in patterns:  # the last matching pattern wins, as in Docker
            neg = pat.startswith("!")
            pat = pat.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pat) or path.startswith(pat + "/"):
                keep = neg
        return keep

    copies = re.findall(r"^COPY\s+(?!--from)(.+)$", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert copies
    for line in copies:
        for src in line.split()[:-1]:
            assert (ROOT / src).exists(), src
            assert kept(src.rstrip("/")), f"{src} is excluded by .dockerignore"
    assert not kept(".git") and not kept("runs") and not kept("deploy/token")


def test_compose_coordinator_service() -> None:
    svc = SERVICES["coordinator"]
    command, args = parse_command(_argv(svc))
    assert command == "coordinator"
    _secret_file(args.token_file, svc)
    assert args.config in [c["target"] for c in svc["configs"]]
    config = COMPOSE["configs"][svc["configs"][0]["source"]]["file"]
    cfg = load_config(DEPLOY / config, {})  # the shipped run config is valid for coordinator mode
    assert cfg.optim.base != "adamw"
    assert _under_a_mount(args.state_dir, svc), "the coordinator's state must live on a volume"
    published = {int(p.rsplit(":", 1)[1]) for p in svc["ports"]}
    assert {_port(args.listen), args.metrics_port} <= published
    health, hargs = parse_command(healthcheck_argv(svc["healthcheck"]["test"]))
    assert health == "health" and _port(hargs.coordinator) == _port(args.listen)
    assert svc["restart"] == "on-failure"


def test_compose_peer_service_reaches_the_coordinator() -> None:
    svc, coord = SERVICES["peer"], SERVICES["coordinator"]
    command, args = parse_command(_argv(svc))
    assert command == "peer"
    _, cargs = parse_command(_argv(coord))
    host, port = args.coordinator.rsplit(":", 1)
    assert host == "coordinator" and int(port) == _port(cargs.listen)
    _secret_file(args.token_file, svc)
    assert _under_a_mount(args.out, svc), "the run folder must live on a volume"
    # The image compose builds by default carries the torch build the peers' default device needs.
    variant = svc["build"]["args"]["TORCH_VARIANT"]
    assert (variant == "cpu") == (args.device == "cpu"), (variant, args.device)
    health, hargs = parse_command(healthcheck_argv(svc["healthcheck"]["test"]))
    assert health == "health" and hargs.coordinator == args.coordinator
    assert svc["depends_on"]["coordinator"]["condition"] == "service_healthy"
    # The first round waits for start_peers peers: fewer replicas would never start the run.
    start_peers = _run_config(coord).net.start_peers
    assert int(svc["deploy"]["replicas"]) >= start_peers, (svc["deploy"]["replicas"], start_peers)
    assert svc["restart"] == "on-failure"
    for name in [*_mount_targets(svc), *_mount_targets(coord)]:
        assert name.startswith("/"), name
    for vol in [*svc["volumes"], *coord["volumes"]]:
        assert vol.split(":")[0] in COMPOSE["volumes"], vol


def test_compose_variables_reach_the_commands() -> None:
    env = {"DEMONET_COORDINATOR": "10.0.0.5:7450", "DEMONET_DEVICE": "cuda:1", "DEMONET_TOKEN_FILE": "/srv/tok"}
    svc = load_compose(DEPLOY / "compose.yaml", env)
    _, args = parse_command(_argv(svc["services"]["peer"]))
    assert args.coordinator == "10.0.0.5:7450" and args.device == "cuda:1"
    assert svc["secrets"]["demonet_token"]["file"] == "/srv/tok"


def test_prometheus_profile_scrapes_the_metrics_port() -> None:
    prom = SERVICES["prometheus"]
    # The docs (compose.yaml's header, deploy/README.md) start it with `--profile NAME`: NAME must be its profile.
    docs = (DEPLOY / "compose.yaml").read_text() + (DEPLOY / "README.md").read_text()
    documented = set(re.findall(r"--profile (\S+)", docs))
    assert documented and documented == set(prom["profiles"]), (documented, prom["profiles"])
    # The file mounted where Prometheus reads its config (--config.file) scrapes the metrics port.
    config_file = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    mounted = {v.split(":")[1]: v.split(":")[0] for v in prom["volumes"]}
    assert config_file in mounted, (config_file, prom["volumes"])
    scrape = yaml.safe_load((DEPLOY / mounted[config_file]).read_text())
    targets = [t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    _, cargs = parse_command(_argv(SERVICES["coordinator"]))
    assert targets == [f"coordinator:{cargs.metrics_port}"]


def test_gpu_override_reserves_gpus_for_cuda_peers() -> None:
    gpu = load_compose(DEPLOY / "compose.gpu.yaml")["services"]["peer"]
    _, args = parse_command(_argv(gpu))
    assert args.device == "cuda"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
    base = SERVICES["peer"]
    assert {k: v for k, v in vars(args).items() if k != "device"} == {
        k: v for k, v in vars(parse_command(_argv(base))[1]).items() if k != "device"}


def test_the_secret_files_are_not_committed() -> None:
    """Every file a compose file reads a secret from by default (the token, the TLS key) is git-ignored."""
    patterns = [p for p in (DEPLOY / ".gitignore").read_text().split("\n") if p.strip() and not p.startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "_gitignored does not follow negations"
    secrets = {**COMPOSE["secrets"], **load_compose(DEPLOY / "compose.tls.yaml")["secrets"]}
    assert {"demonet_token", "demonet_tls_key"} <= set(secrets)
    for name, secret in secrets.items():
        path = PurePosixPath(secret["file"])
        assert not path.is_absolute(), f"secret {name}: {path} is not in deploy/"
        assert _gitignored(str(path), patterns), f"secret {name}: deploy/{path} is not git-ignored"


def test_tls_override_serves_and_verifies_tls() -> None:
    tls = load_compose(DEPLOY / "compose.tls.yaml")
    secrets = {**COMPOSE["secrets"], **tls["secrets"]}
    merged = {**COMPOSE, "secrets": secrets}
    coord, peer = tls["services"]["coordinator"], tls["services"]["peer"]
    _, cargs = parse_command(_argv(coord))
    _, pargs = parse_command(_argv(peer))
    for path, svc in ((cargs.tls_cert, coord), (cargs.tls_key, coord), (cargs.token_file, coord),
                      (pargs.tls_root_cert, peer), (pargs.token_file, peer)):
        p = PurePosixPath(path)
        assert p.parent == PurePosixPath(SECRETS_DIR) and p.name in svc["secrets"] and p.name in merged["secrets"]
    assert pargs.tls_root_cert == cargs.tls_cert
    assert "demonet_tls_key" not in peer["secrets"], "peers never get the private key"
    _, ch = parse_command(healthcheck_argv(coord["healthcheck"]["test"]))
    _, ph = parse_command(healthcheck_argv(peer["healthcheck"]["test"]))
    assert ch.tls_root_cert == cargs.tls_cert and ch.tls_server_name == "coordinator"
    assert ph.tls_root_cert == pargs.tls_root_cert and ph.coordinator == pargs.coordinator
    # Apart from TLS, the same commands as the plain compose file.
    plain_c = vars(parse_command(_argv(SERVICES["coordinator"]))[1])
    assert {k: v for k, v in vars(cargs).items() if not k.startswith("tls_")} == {
        k: v for k, v in plain_c.items() if not k.startswith("tls_")}
