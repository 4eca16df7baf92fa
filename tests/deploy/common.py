"""Reading deploy/: the compose file with compose's variable interpolation, the Dockerfile's instructions,
and the commands they run checked against demonet's real argparse parsers."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import tomllib
from collections.abc import Mapping, Sequence
from contextlib import redirect_stderr
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SECRETS_DIR = "/run/secrets"
"""Where compose mounts a service's secrets (each as a file named after the secret)."""

_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
                  r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's interpolation: $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR:+alt}, $$."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("braced") or m.group("bare")
        op, arg = m.group("op"), m.group("arg") or ""
        value = env.get(name)
        unset_or_empty = not value
        if op in (":-", "-"):
            return arg if (unset_or_empty if op == ":-" else value is None) else str(value)
        if op in (":?", "?"):
            if unset_or_empty if op == ":?" else value is None:
                raise ValueError(f"required variable {name} is missing: {arg}")
            return str(value)
        if op in (":+", "+"):
            return arg if not (unset_or_empty if op == ":+" else value is None) else ""
        return value or ""

    return _VAR.sub(one, text)


def _walk(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_walk(v, env) for v in node]
    if isinstance(node, dict):
        return {k: _walk(v, env) for k, v in node.items()}
    return node


def load_compose(path: Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose file as compose sees it: YAML (anchors and merge keys resolved), then interpolated."""
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path}: not a mapping"
    return dict(_walk(data, env or {}))


@dataclass(frozen=True)
class Dockerfile:
    entrypoint: list[str]
    cmd: list[str]
    healthcheck: list[str]
    stages: list[str]
    """The FROM lines, as written."""
    args: dict[str, str | None]
    """ARG name -> default (None: no default), over all stages."""
    user: str


def load_dockerfile(path: Path) -> Dockerfile:
    """The instructions of a Dockerfile that decide what a container runs (exec forms only)."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, f"{path}: a continuation line at the end"
    found: dict[str, Any] = {"entrypoint": [], "cmd": [], "healthcheck": [], "stages": [], "args": {}, "user": ""}
    for line in lines:
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        if word == "FROM":
            found["stages"].append(rest)
        elif word == "ARG":
            name, eq, default = rest.partition("=")
            found["args"][name] = default if eq else None
        elif word == "USER":
            found["user"] = rest
        elif word in ("ENTRYPOINT", "CMD"):
            found[word.lower()] = _exec_form(word, rest)
        elif word == "HEALTHCHECK":
            head, sep, cmd = rest.partition("CMD ")
            assert sep, f"HEALTHCHECK without CMD: {line}"
            found["healthcheck"] = _exec_form("HEALTHCHECK CMD", cmd.strip())
    return Dockerfile(**found)


def _exec_form(what: str, text: str) -> list[str]:
    try:
        argv = json.loads(text)
    except json.JSONDecodeError:
        raise AssertionError(f"{what} should use the exec (JSON) form, got {text!r}") from None
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), f"{what}: {text!r}"
    return argv


# -- the commands against the CLI ----------------------------------------------------------------------


def console_scripts() -> dict[str, str]:
    """pyproject's [project.scripts]: command name -> "module:function"."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["project"]["scripts"])


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str], *, known: bool = False) -> Any:
    err = StringIO()
    try:
        with redirect_stderr(err):
            return parser.parse_known_args(list(argv)) if known else parser.parse_args(list(argv))
    except SystemExit:
        raise AssertionError(f"{parser.prog} rejects {list(argv)}: {err.getvalue().strip()}") from None


def parse_command(argv: Sequence[str]) -> tuple[str, argparse.Namespace]:
    """Parse a container's command line with the parsers the real entry point builds.

    Returns:
        (subcommand or script name, parsed flags).

    Raises:
        AssertionError: the program is not one of demonet's console scripts, or its parser refuses argv.
    """
    assert argv, "an empty command"
    program, args = argv[0], list(argv[1:])
    scripts = console_scripts()
    assert program in scripts, f"{program!r} is not one of the installed commands {sorted(scripts)}"
    module = importlib.import_module(scripts[program].split(":")[0])
    if module.__name__ == "demonet.cli":
        # What demonet.cli.main does: the top parser, then the coordinator's own flags.
        ns, rest = _parse(module._parser_for(args), args, known=True)
        if ns.command == "coordinator":
            from demonet import coordinator

            sub = argparse.ArgumentParser(prog="demonet coordinator")
            coordinator.add_arguments(sub)
            return "coordinator", _parse(sub, rest)
        assert not rest, f"demonet {ns.command} does not take {rest}"
        return str(ns.command), ns
    if module.__name__ == "demonet.health":
        return "health", _parse(module.parser(), args)
    if module.__name__ in ("demonet.peer", "demonet.coordinator"):
        sub = argparse.ArgumentParser(prog=program)
        module.add_arguments(sub)
        return module.__name__.rsplit(".", 1)[1], _parse(sub, args)
    raise AssertionError(f"no parser known for {program!r}")


def healthcheck_argv(test: Any) -> list[str]:
    """A compose healthcheck `test` as an argv (only the CMD form: no shell in between)."""
    assert isinstance(test, list) and test and test[0] == "CMD", f"healthcheck test should be [CMD, ...]: {test!r}"
    return [str(a) for a in test[1:]]
