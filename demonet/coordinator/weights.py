"""The canonical parameters as a safetensors file: `demonet export` writes a saved state's (or, for a Hugging Face
task, a model folder), `demonet coordinator --init` starts from one.

No network. `safetensors` is the optional extra "hf", imported only when a file is read or written.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from demonet.errors import WeightsFileError
from demonet.wire.digest import legacy_param_digest, param_digest

from .state import STATE_FILE, ClosedAggregate

__all__ = ["SavedParams", "export", "export_pretrained", "read_init", "read_state", "write_safetensors"]


@dataclass(frozen=True)
class SavedParams:
    """The parameters of a saved coordinator state, at the start of its open round."""

    params: dict[str, torch.Tensor]  # in the state's order, the order of the digest
    round: int
    digest: str
    config: dict[str, Any] = field(default_factory=dict)
    """The run's config as the state saved it (`Config.to_dict()`); empty if it has none."""


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
    current = param_digest(params.items())
    if digest != current and digest != legacy_param_digest(params.items()):  # a state saved by protocol 1
        raise WeightsFileError(f"{path} is damaged: its parameters do not match their digest {digest}")
    digest = current
    config = body.get("config")
    return SavedParams({n: t.detach().contiguous() for n, t in params.items()}, round, digest,
                       config if isinstance(config, dict) else {})


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
    _safetensors_torch()  # before anything else: say how to install it
    if out.exists() and not force:
        raise WeightsFileError(f"{out} exists; --force overwrites it")
    if out.is_dir():
        raise WeightsFileError(f"{out} is a folder")
    saved = read_state(state_dir)
    write_safetensors(saved.params, out,
                      {"format": "pt", "demonet.round": str(saved.round), "demonet.digest": saved.digest})
    return saved


def write_safetensors(params: Mapping[str, torch.Tensor], out: Path, metadata: dict[str, str]) -> None:
    """Write named tensors to safetensors file `out`: next to it, then renamed over it.

    Raises:
        WeightsFileError: no safetensors package, or `out` cannot be written.
    """
    st = _safetensors_torch()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        st.save_file(dict(params), str(tmp), metadata=metadata)
        os.replace(tmp, out)
    except OSError as e:
        raise WeightsFileError(f"cannot write {out}: {e}") from e
    finally:
        tmp.unlink(missing_ok=True)


def export_pretrained(saved: SavedParams, out: Path, model_dir: Path, *, force: bool = False) -> list[Path]:
    """Write folder `out` that `AutoModelForCausalLM.from_pretrained(out)` loads: `model_dir`'s config.json (and
    its generation and tokenizer files, where present) and the saved parameters as model.safetensors.

    The parameters are checked against the model's names and shapes first (`demonet.tasks.hf`). A tied
    parameter (`lm_head.weight` that is `model.embed_tokens.weight`) is in the state once, under the name
    `named_parameters` gives it, which is how `save_pretrained` writes it too. Each file is written next to
    its place and renamed over it.

    Returns:
        the files written.

    Raises:
        WeightsFileError: a bad model folder, parameters that are not its model's, `out` is a file, or a file
            to write exists and not `force`.
    """
    from demonet.tasks.hf import COPIED_FILES, param_specs_of
    from demonet.train.task import first_difference, param_specs

    _safetensors_torch()
    try:
        specs = param_specs_of(model_dir)
    except ValueError as e:
        raise WeightsFileError(str(e)) from e
    difference = first_difference(param_specs(saved.params), specs)
    if difference is not None:
        raise WeightsFileError(f"the saved parameters are not those of the model in {model_dir} (with the state "
                               f"as 'this model': {difference})")
    if out.exists() and not out.is_dir():
        raise WeightsFileError(f"{out} is a file; a Hugging Face model is a folder")
    copied = [name for name in COPIED_FILES if (model_dir / name).is_file()]
    targets = [out / name for name in (*copied, "model.safetensors")]
    for target in targets:
        if target.exists() and not force:
            raise WeightsFileError(f"{target} exists; --force overwrites it")
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(saved.params, out / "model.safetensors",
                      {"format": "pt", "demonet.round": str(saved.round), "demonet.digest": saved.digest})
    for name in copied:
        tmp = out / f".{name}.{os.getpid()}.tmp"
        try:
            shutil.copyfile(model_dir / name, tmp)
            os.replace(tmp, out / name)
        except OSError as e:
            raise WeightsFileError(f"cannot write {out / name}: {e}") from e
        finally:
            tmp.unlink(missing_ok=True)
    return targets


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
