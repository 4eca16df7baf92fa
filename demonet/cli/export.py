"""`demonet export`: a coordinator's saved canonical parameters as a safetensors file (`--out NAME.safetensors`),
or as a folder: model.safetensors in it, and for a run of the Hugging Face task (`demonet.tasks.hf:causal_lm`)
the model's config files too, so that `from_pretrained` loads it.

Reads the state folder only (never a running coordinator); the work is in demonet.coordinator.weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from demonet.coordinator.weights import SavedParams

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `demonet export` flags."""
    parser.add_argument("--state-dir", required=True, help="a coordinator's --state-dir (coordinator-state.pt)")
    parser.add_argument("--out", required=True,
                        help="a file NAME.safetensors, or else a folder to write model.safetensors into (for a "
                             "Hugging Face model, with its config: a folder from_pretrained loads)")
    parser.add_argument("--hf-config", metavar="MODELDIR",
                        help="write a Hugging Face model folder with MODELDIR's config.json (default: the run's "
                             "[task] model, when the run trains demonet.tasks.hf:causal_lm)")
    parser.add_argument("--force", action="store_true", help="overwrite what --out holds")


def run(args: argparse.Namespace) -> int:
    """Run `demonet export`; returns the exit code (2 on a bad state folder, model folder or --out; nothing
    written)."""
    from demonet.coordinator.weights import export, export_pretrained, read_state
    from demonet.errors import WeightsFileError
    from demonet.tasks.hf import run_model_dir

    out, state_dir = Path(args.out), Path(args.state_dir)
    print(f"exporting {state_dir} to {out} ...", file=sys.stderr, flush=True)
    try:
        saved = None
        model_dir = args.hf_config
        if model_dir is None and out.suffix != ".safetensors":
            saved = read_state(state_dir)
            model_dir = run_model_dir(saved.config)
            if model_dir is not None and not Path(model_dir).is_dir():
                raise WeightsFileError(f"the run's [task] model {model_dir!r} is not a folder here; give the model "
                                       "folder with --hf-config MODELDIR")
        if model_dir is None and out.suffix == ".safetensors":
            saved = export(state_dir, out, force=args.force)
            what = str(out)
        elif model_dir is None:
            assert saved is not None  # read above, to find the run's model
            what = str(_export_folder(saved, out, force=args.force))
        else:
            saved = saved or read_state(state_dir)
            written = export_pretrained(saved, out, Path(model_dir), force=args.force)
            what = f"{out} ({', '.join(p.name for p in written)}) with the config of {model_dir}"
    except WeightsFileError as e:
        print(f"demonet export: {e}", file=sys.stderr)
        return 2
    num_bytes = sum(t.numel() * t.element_size() for t in saved.params.values())
    print(f"wrote {what}: {len(saved.params)} tensors, {num_bytes / 2**20:.1f} MiB; the parameters at the start "
          f"of round {saved.round}, digest {saved.digest}")
    return 0


def _export_folder(saved: SavedParams, out: Path, *, force: bool) -> Path:
    """Write `saved` as `out`/model.safetensors, making the folder; returns the file written.

    Raises:
        WeightsFileError: `out` is a file, or the file exists and not `force` (nothing written either way).
    """
    from demonet.coordinator.weights import write_safetensors
    from demonet.errors import WeightsFileError

    if out.exists() and not out.is_dir():
        raise WeightsFileError(f"{out} is a file; name a NAME.safetensors file or a folder")
    target = out / "model.safetensors"
    if target.exists() and not force:
        raise WeightsFileError(f"{target} exists; --force overwrites it")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        write_safetensors(saved.params, target,
                          {"format": "pt", "demonet.round": str(saved.round), "demonet.digest": saved.digest})
    except WeightsFileError:
        if created:
            out.rmdir()
        raise
    return target
