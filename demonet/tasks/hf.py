"""A Hugging Face causal language model as a run's task (`demonet export` writes a run's as a model directory).

`[train] task = "demonet.tasks.hf:causal_lm"` (or `--task`), with the `[task]` table::

    [task]
    model = "models/tiny-llama"   # a local directory: config.json alone pretrains, with weights fine-tunes
    tokens = "data/corpus.tok"    # a token file (`demonet data tokenize --tokenizer ...`)
    batch_size = 8
    seq_len = 128

`transformers` (the optional extra "hf") is imported when the task is built or a directory exported.
Nothing is fetched from the hub: every load is `local_files_only`, with HF_HUB_OFFLINE=1.

Shape legend: B = batch, T = time (tokens), V = vocab.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from demonet.train.task import Specs, Task, param_specs
from demonet.train.token_data import open_tokens

__all__ = ["COPIED_FILES", "TASK", "causal_lm", "model_config", "next_token_loss", "param_specs_of", "run_model_dir",
           "shipped_paths", "with_shipped_files"]

TASK = "demonet.tasks.hf:causal_lm"
"""This task's `--task` name, as a run config saves it."""
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")
"""What `demonet export` copies from the model directory into a model directory, where present, and what a
coordinator ships to its peers (`shipped_paths`): never weights."""


def _transformers() -> ModuleType:
    os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is first imported; local_files_only does the rest
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        import transformers
    except ImportError as e:
        raise ValueError("the Hugging Face task needs transformers: pip install 'demonet[hf]'") from e
    return transformers


def model_config(model_dir: str | Path) -> Any:
    """The `PretrainedConfig` of a local model directory, checked to be a causal language model's.

    Raises:
        ValueError: not a local directory, no or a bad config.json, an unknown model type, or a model
            type with no causal LM (`AutoModelForCausalLM`).
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model {str(model_dir)!r} is not a local directory (demonet never downloads from the hub: "
                         "give a folder with a config.json, e.g. one that save_pretrained wrote)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model directory {path} holds no config.json (a Hugging Face model directory: config.json "
                         "to pretrain, config.json and weights to fine-tune)")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_file} is not a JSON config ({type(e).__name__}: {e})") from e
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"{config_file} names no model_type (for example \"llama\")")
    tf = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{config_file}: unknown model type {model_type!r} (not an architecture of transformers "
                         f"{tf.__version__}; custom model code is never run)")
    config = tf.AutoConfig.from_pretrained(str(path), local_files_only=True)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{config_file}: model type {model_type!r} is not a causal language model "
                         "(AutoModelForCausalLM has no class for it)")
    return config


def next_token_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the model's logits at every position against the token after it."""
    x_BT, y_BT = batch
    logits_BTV = model(input_ids=x_BT, use_cache=False).logits
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), y_BT.flatten())  # (B*T, V) against (B*T,)


def causal_lm(model: str, tokens: str, batch_size: int = 8, seq_len: int = 128, tokenizer: str = "",
              tokens_pin: str = "") -> Task:
    """A causal LM from a local directory, trained on windows of a token file with the next-token loss.

    With only a config.json in `model`, the model is built from it (`AutoModelForCausalLM.from_config`) after
    demonet seeds torch with the run seed, so every process starts from the same parameters; with weights
    there too, they are loaded (`from_pretrained(model, local_files_only=True)`) to fine-tune. The parameters
    are float32. Each peer draws `batch_size` windows of `seq_len` + 1 tokens per batch from the file's first
    95% (`TokenData.batches`, with the peer's seed); `tokens` is a path or a URL (docs/data.md). `tokenizer`
    (the identity a token file's header names, e.g. ``bytes`` or ``NAME@HASH``) holds every peer to token files
    of that tokenizer; empty: any.

    Raises:
        ValueError: a bad model directory (see `model_config`), a bad token file, a token file whose vocab is
            larger than the model's or made with another `tokenizer`, `seq_len` beyond the model's positions, or
            bad sizes.
    """
    config = model_config(model)
    token_file = open_tokens(tokens, pin=tokens_pin or None)
    token_file.check_tokenizer(tokenizer)
    _check_model_tokenizer(Path(model), token_file.header.tokenizer, tokens)
    vocab_size = getattr(config, "vocab_size", None)
    if isinstance(vocab_size, int) and token_file.header.vocab_size > vocab_size:
        raise ValueError(f"{Path(model) / 'config.json'}: vocab_size should be >= {token_file.header.vocab_size}, "
                         f"the vocab of the token file {tokens} (tokenizer {token_file.header.tokenizer}); "
                         f"got {vocab_size}")
    max_positions = getattr(config, "max_position_embeddings", None)
    if isinstance(max_positions, int) and isinstance(seq_len, int) and seq_len > max_positions:
        raise ValueError(f"seq_len should be at most {max_positions}, the max_position_embeddings of "
                         f"{Path(model) / 'config.json'}; got {seq_len}")
    token_file.batches(batch_size=batch_size, seq_len=seq_len, seed=0)  # checks the sizes now, not in a peer
    tf = _transformers()
    if any((Path(model) / name).is_file() for name in _WEIGHTS):
        net = tf.AutoModelForCausalLM.from_pretrained(str(model), local_files_only=True)
    else:
        net = tf.AutoModelForCausalLM.from_config(config)
    net.float().train()  # from_pretrained leaves eval mode (no dropout), and may load another dtype

    def batches(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return token_file.batches(batch_size=batch_size, seq_len=seq_len, seed=seed)

    return Task(model=net, batches=batches, loss=next_token_loss)


def _check_model_tokenizer(model_dir: Path, named: str, tokens: str) -> None:
    """The model folder's tokenizer.json, where it has one, is the tokenizer a token file's header names as
    ``NAME@HASH`` (`demonet data tokenize`: HASH is 16 hex digits of its SHA-256); other names say no hash.

    Raises:
        ValueError: another tokenizer (the ids would mean other tokens to this model's vocab).
    """
    _, _, want = named.rpartition("@")
    file = model_dir / "tokenizer.json"
    if len(want) != 16 or any(c not in "0123456789abcdef" for c in want) or not file.is_file():
        return
    got = hashlib.sha256(file.read_bytes()).hexdigest()[:16]
    if got != want:
        raise ValueError(f"the token file {tokens} was made with tokenizer {named}, but {file} hashes to {got}: "
                         "tokenize the corpus with this tokenizer (demonet data tokenize --tokenizer "
                         f"{model_dir}), or put the tokenizer the file was made with in the model folder")


def param_specs_of(model_dir: str | Path) -> Specs:
    """The (name, shape, "float32") of the parameters of the model a directory configures, as `causal_lm`
    builds it, from a model on the meta device (no memory, no weights read).

    Raises:
        ValueError: a bad model directory (see `model_config`).
    """
    config = model_config(model_dir)
    with torch.device("meta"):
        skeleton = _transformers().AutoModelForCausalLM.from_config(config).float()
    return param_specs(skeleton.named_parameters())


def run_model_dir(config: Mapping[str, Any]) -> str | None:
    """The `[task] model` of a saved run config (`Config.to_dict()`) that trains this task; else None."""
    train, table = config.get("train"), config.get("task")
    if not isinstance(train, Mapping) or train.get("task") != TASK or not isinstance(table, Mapping):
        return None
    model = table.get("model")
    return model if isinstance(model, str) else None


def shipped_paths(config: Mapping[str, Any]) -> dict[str, Path]:
    """The files a coordinator of this task ships to its peers, by name: the `COPIED_FILES` its model folder holds
    (a saved run config, `Config.to_dict()`); {} for a run of another task.

    Raises:
        ValueError: a run of this task whose model folder holds no config.json (see `model_config`).
    """
    model_dir = run_model_dir(config)
    if model_dir is None:
        return {}
    paths = {name: Path(model_dir) / name for name in COPIED_FILES if (Path(model_dir) / name).is_file()}
    if "config.json" not in paths:
        model_config(model_dir)  # raises, naming what is wrong
    return paths


def with_shipped_files(config: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    """A saved run config of this task (`Config.to_dict()`) whose `[task] model` is `folder`, this peer's copy of
    the files its coordinator ships, in place of the coordinator's own path. `[task] tokens` stays as given: a
    URL, or a path that must then be on this machine too.

    Raises:
        ValueError: `tokens` is a local path this machine does not have (the fix is named).
    """
    table = dict(config.get("task") or {})
    tokens = table.get("tokens")
    if isinstance(tokens, str) and "://" not in tokens and not Path(tokens).exists():
        raise ValueError(f"the run's token file {tokens!r} ([task] tokens) is a path that is not on this machine: "
                         "serve the token file over http(s) or s3 and set [task] tokens to its URL (or copy the "
                         "file to that path here)")
    return {**config, "task": {**table, "model": str(folder.resolve())}}


def pin_task_tokens(config: Mapping[str, Any]) -> dict[str, Any]:
    """A saved run config (`Config.to_dict()`) of this task with `[task] tokens_pin` set from its token file's
    sidecar, where it has one and the pin is not set: the coordinator's file pins the run's, and each peer's
    copy (a URL, or a path of its own) must have that pin; a run of another task, unchanged.

    Raises:
        ValueError: the token file cannot be read, or has another pin than a set one.
    """
    table = config.get("task")
    if run_model_dir(config) is None or not isinstance(table, Mapping) or table.get("tokens_pin"):
        return dict(config)
    tokens = table.get("tokens")
    pin = open_tokens(tokens).pin if isinstance(tokens, str) else None
    return dict(config) if pin is None else {**config, "task": {**table, "tokens_pin": pin}}
