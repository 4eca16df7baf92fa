"""The canonical parameters as a safetensors file: `demonet export` writes a saved state's, `demonet coordinator
--init` starts from one.

No network. `safetensors` is the optional extra "hf", imported only when a file is read or written.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from demonet.wire.digest import param_digest

from .state import STATE_FILE, ClosedAggregate

__all__ = ["SavedParams", "WeightsFileError", "export", "read_init", "read_state"]


class WeightsFileError(ValueError):
    """A state folder or a safetensors file that cannot be used; the message names the file and why."""


@dataclass(frozen=True)
class SavedParams:
    """The parameters of a saved coordinator state, at the start of its open round."""

    params: dict[str, torch.Tensor]  # in the state's order, the order of the digest
    round: int
    digest: str


def _safetensors_torch() -> ModuleType:
    try:
        import safetensors.torch
    except ImportError as e:
        raise WeightsFileError("safetensors files need the safetensors package: pip install 'demonet[hf]' "
                               "(or pip install safetensors)") from e
    return safetensors.torch


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def read_state(state_dir: Path) -> SavedParams:
    """The parameters in `state_dir`/coordinator-state.pt, checked against the digest saved with them.

    Raises:
        WeightsFileError: no such folder or file, or the file is damaged or not a coordinator state.
    """
    path = state_dir / STATE_FILE
    if not state_dir.is_dir():
        raise WeightsFileError(f"{state_dir}: no such folder")
    if not path.is_file():
        raise WeightsFileError(f"{path}: no coordinator state here (a coordinator with --state-dir writes it "
                               "after every round)")
    try:
        # weights_only: the unpickler builds tensors, containers and the one class a state holds.
        with torch.serialization.safe_globals([ClosedAggregate]):
            body = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load has no error contract (EOFError, OSError, KeyError, ...)
        raise WeightsFileError(f"{path} is damaged or not a coordinator state ({_first_line(e)})") from e
    params, digest = _field(body, "params", dict, path), _field(body, "digest", str, path)
    round = _field(_field(body, "rounds", dict, path), "round", int, path)
    if not params or not all(isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in params.items()):
        raise WeightsFileError(f"{path} is damaged: its params are not named tensors")
    if param_digest(params.items()) != digest:
        raise WeightsFileError(f"{path} is damaged: its parameters do not match their digest {digest}")
    return SavedParams({n: t.detach().contiguous() for n, t in params.items()}, round, digest)


def _field(body: Any, key: str, kind: type, path: Path) -> Any:
    if not isinstance(body, dict) or not isinstance(body.get(key), kind):
        raise WeightsFileError(f"{path} is damaged or not a coordinator state (no {key!r})")
    return body[key]


def export(state_dir: Path, out: Path, *, force: bool = False) -> SavedParams:
    """Write the parameters saved in `state_dir` to `out` as safetensors (names as in the state).

    The file is written next to `out` and renamed over it, so a failure leaves no partial `out`.

    Raises:
        WeightsFileError: a bad state (see `read_state`), `out` exists and not `force`, or it cannot be written.
    """
    st = _safetensors_torch()
    if out.exists() and not force:
        raise WeightsFileError(f"{out} exists; --force overwrites it")
    if out.is_dir():
        raise WeightsFileError(f"{out} is a folder")
    saved = read_state(state_dir)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    metadata = {"format": "pt", "demonet.round": str(saved.round), "demonet.digest": saved.digest}
    try:
        st.save_file(saved.params, str(tmp), metadata=metadata)
        os.replace(tmp, out)
    except OSError as e:
        raise WeightsFileError(f"cannot write {out}: {e}") from e
    finally:
        tmp.unlink(missing_ok=True)
    return saved


def read_init(path: Path, expected: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of safetensors file `path`, in the order of `expected`, which they must match exactly.

    Raises:
        WeightsFileError: the file cannot be read, or its first difference from `expected` (a missing or an
            extra name, another shape or dtype) or its first non-finite tensor.
    """
    st = _safetensors_torch()
    if not path.is_file():
        raise WeightsFileError(f"--init {path}: no such file")
    try:
        given = st.load_file(str(path), device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError, OSError, ...
        raise WeightsFileError(f"--init {path} is not a readable safetensors file ({_first_line(e)})") from e
    for name, want in expected.items():
        if name not in given:
            raise WeightsFileError(f"--init {path}: the model's {name!r} is missing from the file")
        got = given[name]
        if (got.shape, got.dtype) != (want.shape, want.dtype):
            raise WeightsFileError(f"--init {path}: {name!r} is {got.dtype} {tuple(got.shape)} in the file, "
                                   f"{want.dtype} {tuple(want.shape)} in the model")
        if not bool(torch.isfinite(got).all()):
            raise WeightsFileError(f"--init {path}: {name!r} holds NaN or infinite values")
    extra = sorted(set(given) - set(expected))
    if extra:
        raise WeightsFileError(f"--init {path}: {extra[0]!r} is not a parameter of the model "
                               f"({len(extra)} extra names)")
    return {name: given[name] for name in expected}
