"""Run configuration: frozen sections loaded from TOML, then DEMONET_* env vars, then CLI flags.

Imports the math layer's option checks and its own [net] section (`demonet.config_net`, re-exported here) only
(no layer above it); library classes take explicit arguments, entry points read this.
Precedence: CLI > env > TOML > defaults. Env names are DEMONET_<SECTION>_<FIELD>, e.g.
DEMONET_OPTIM_LR=0.001 or DEMONET_TRAIN_PEERS=8.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demonet.config_net import NetConfig, _check
from demonet.optim import BASES, CHUNK_POLICIES, ENCODINGS, check_lr, check_schedule

__all__ = ["PRECISIONS", "TOKEN_ENV", "Config", "ModelConfig", "NetConfig", "OptimConfig", "TrainConfig", "load_config",
           "load_token"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a `GPT`."""

    vocab_size: int = 256
    """Number of token ids; 256 for the byte-level corpus."""
    seq_len: int = 128
    """Longest sequence the position embedding covers."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads per block; must divide d_model."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of d_model."""
    tie_weights: bool = True
    """Share the token embedding with the output head (GPT-2 / OLMo weight tying)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} should be a positive int, got {value!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model should be a multiple of n_heads, got d_model={self.d_model} n_heads={self.n_heads}"
            )
        if not isinstance(self.tie_weights, bool):
            raise ValueError(f"tie_weights should be a bool, got {self.tie_weights!r}")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The DeMo optimizer."""

    lr: float = 3e-3
    """Learning rate, > 0 (`demonet.optim.check_lr`); folded into the momentum, as the reference does."""
    compression_decay: float = 0.999
    """Momentum decay beta, in [0, 1)."""
    compression_topk: int = 32
    """DCT coefficients kept per chunk: the most a payload may send (a larger k is refused), and the k of every
    payload where `adaptive_topk` is off."""
    adaptive_topk: bool = True
    """In rounds by the clock, each peer sends as many coefficients per chunk as its measured uplink carries in
    a quarter of the round, between `min_compression_topk` and `compression_topk` (docs/coordinator.md#links);
    off, or in lockstep rounds: `compression_topk`."""
    min_compression_topk: int = 0
    """The floor of an adapted k (a smaller one is refused); 0: compression_topk / 8, rounded up."""
    compression_chunk: int = 64
    """Target chunk side."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    base: str = "sign"
    """Base optimizer on the decoded aggregate: sign, sgd or adamw."""
    alpha: float = 1.0
    """Momentum subtraction coefficient in (0, 1]."""
    encoding: str = "fp32"
    """Value encoding: fp32, bf16, fp16, int8 or sign."""
    chunk_policy: str = "pad"
    """``pad`` never collapses awkward dimensions to tiny chunks; ``reference`` is bloc97's rule."""
    warmup_rounds: int = 0
    """Rounds of linear warmup, from lr / warmup_rounds in round 0 to lr; 0: none (`demonet.optim.LrSchedule`).
    Off by default: 5 to 20 rounds did not remove the one-round loss spikes of the sign base, and 10 rounds
    ended 9% higher in validation loss over five seeds (docs/benchmarks.md, Learning-rate warmup)."""
    schedule: str = "constant"
    """After the warmup: ``constant`` (lr) or ``cosine`` (from lr down to lr_min over decay_rounds, then lr_min)."""
    lr_min: float = 0.0
    """The cosine's floor, in [0, lr]."""
    decay_rounds: int = 0
    """The cosine's length in rounds; 0: the rest of the run (train.steps - warmup_rounds)."""

    @property
    def topk_floor(self) -> int:
        """The smallest k a payload may send (`min_compression_topk`, or its default)."""
        return self.min_compression_topk or -(-self.compression_topk // 8)

    def __post_init__(self) -> None:
        check_lr(self.lr)  # the optimizer's own rule
        _check(0 <= self.compression_decay < 1, "compression_decay should be in [0, 1)")
        _check(self.compression_topk > 0, "compression_topk should be > 0")
        _check(0 <= self.min_compression_topk <= self.compression_topk,
               f"min_compression_topk should be in [0, compression_topk = {self.compression_topk}] (0: "
               f"compression_topk / 8), got {self.min_compression_topk}")
        _check(self.compression_chunk > 0, "compression_chunk should be > 0")
        _check(self.weight_decay >= 0, "weight_decay should be >= 0")
        _check(self.base in BASES, f"base should be one of {BASES}")
        _check(0 < self.alpha <= 1, "alpha should be in (0, 1]")
        _check(self.encoding in ENCODINGS, f"encoding should be one of {ENCODINGS}")
        _check(self.chunk_policy in CHUNK_POLICIES, f"chunk_policy should be one of {CHUNK_POLICIES}")
        check_schedule(self.lr, self.warmup_rounds, self.schedule, self.lr_min, self.decay_rounds)


PRECISIONS = ("fp32", "bf16")
"""`TrainConfig.precision`: the forward and backward's dtype."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The training loop."""

    peers: int = 4
    """Peers in the local cluster."""
    steps: int = 200
    """Optimizer steps (rounds)."""
    batch_size: int = 8
    """Sequences per peer per step."""
    seq_len: int = 128
    """Tokens per sequence (at most the model's seq_len)."""
    seed: int = 0
    """Seed of the model init and of every peer's data stream."""
    corpus: str = ""
    """A text file to train on; empty for the embedded corpus (Python's own help topics)."""
    tokens: str = ""
    """A token file to train on (`demonet data tokenize`, docs/data.md) instead of a corpus's bytes; empty for
    none. model.vocab_size should cover the file's vocab."""
    tokenizer: str = ""
    """The tokenizer every peer's token file must have been made with (its identity as the file's header
    names it: ``bytes``, or ``NAME@HASH``); empty: not checked. A coordinator whose run has `tokens` sets
    it from its own file, so a peer whose file came from another tokenizer is refused before it joins."""
    tokens_pin: str = ""
    """The pin every peer's `tokens` must have (the digest of its header and shard hashes, docs/data.md);
    empty: not checked. A coordinator sets it from its own file, so a file swapped on a server is refused."""
    eval_every: int = 50
    """Steps between validation losses; 0 for none."""
    out: str = "runs/demo"
    """Run folder: config.json, metrics.jsonl, summary.json."""
    device: str = "cpu"
    """cpu, cuda or cuda:N."""
    task: str = ""
    """MODULE:FUNCTION returning a `demonet.Task` (called with the [task] table); empty: the built-in GPT."""
    precision: str = "fp32"
    """Forward and backward in ``fp32``, or ``bf16`` under torch.autocast (parameters, gradients and
    DeMo's state stay float32)."""
    max_grad_norm: float = 0.0
    """Clip each peer's gradient to this L2 norm before compress; 0: no clipping."""

    def __post_init__(self) -> None:
        _check(not self.task or (self.task.count(":") == 1 and all(self.task.split(":"))),
               f"task should be MODULE:FUNCTION, got {self.task!r}")
        _check(self.peers >= 1, "peers should be >= 1")
        _check(self.steps >= 1, "steps should be >= 1")
        _check(self.batch_size >= 1, "batch_size should be >= 1")
        _check(self.seq_len >= 1, "seq_len should be >= 1")
        _check(self.seed >= 0, "seed should be >= 0")
        _check(self.eval_every >= 0, "eval_every should be >= 0")
        _check(not (self.corpus and self.tokens), "train.corpus and train.tokens should not both be set")
        _check(self.precision in PRECISIONS, f"precision should be one of {PRECISIONS}, got {self.precision!r}")
        _check(self.max_grad_norm >= 0, f"max_grad_norm should be >= 0 (0: off), got {self.max_grad_norm}")


@dataclass(frozen=True, kw_only=True)
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    net: NetConfig = field(default_factory=NetConfig)
    task: dict[str, Any] = field(default_factory=dict)
    """The [task] table: keyword arguments of the task function (train.task)."""

    def __post_init__(self) -> None:
        _check(self.train.seq_len <= self.model.seq_len, "train.seq_len should be <= model.seq_len")

    @classmethod
    def from_dict(cls, data: Mapping[str, Mapping[str, Any]]) -> Config:
        """Rebuild a config from `to_dict()` output (e.g. the JSON a coordinator hands its peers)."""
        return load_config(None, {}, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS: dict[str, type[Any]] = {"model": ModelConfig, "optim": OptimConfig, "train": TrainConfig, "net": NetConfig}


def _convert(section: str, name: str, raw: Any, kind: type[Any]) -> Any:
    if kind is bool and isinstance(raw, str):
        if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"{section}.{name} should be a bool, got {raw!r}")
        return raw.lower() in ("1", "true", "yes")
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{section}.{name} should be a {kind.__name__}, got {raw!r}") from None
    if kind in (int, float) and isinstance(raw, bool):
        raise ValueError(f"{section}.{name} should be a {kind.__name__}, got {raw!r}")
    return value


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Config:
    """Build a `Config`.

    Args:
        path: a TOML file with [model], [optim], [train] and [net] tables, or None.
        env: environment variables (DEMONET_<SECTION>_<FIELD>); pass os.environ to use them.
        overrides: {section: {field: value}} from the command line (None values are ignored).

    Raises:
        ValueError: unknown sections or fields, values of the wrong type or out of range.
        FileNotFoundError: the TOML file does not exist.
    """
    merged: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    task: dict[str, Any] = {}
    if path is not None:
        with open(path, "rb") as f:
            data = tomllib.load(f)
        for section, values in data.items():
            if section == "task" and isinstance(values, dict):
                task.update(values)
                continue
            if section not in _SECTIONS or not isinstance(values, dict):
                raise ValueError(f"{path}: unknown section [{section}]; expected one of {sorted([*_SECTIONS, 'task'])}")
            merged[section].update(values)
    for key, raw in (env or {}).items():
        if key.startswith("DEMONET_") and key.count("_") >= 2:
            section, _, name = key[len("DEMONET_"):].lower().partition("_")
            if section in _SECTIONS:
                merged[section][name] = raw
    for section, values in (overrides or {}).items():
        if section == "task":  # free-form: the task function's keyword arguments
            task.update(values)
            continue
        merged[section].update({k: v for k, v in values.items() if v is not None})
    built = {}
    for section, cls in _SECTIONS.items():
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for name, raw in merged[section].items():
            if name not in fields:
                raise ValueError(f"unknown setting {section}.{name}; expected one of {sorted(fields)}")
            kind = type(fields[name].default)
            kwargs[name] = _convert(section, name, raw, kind)
        built[section] = cls(**kwargs)
    return Config(**built, task=task)


TOKEN_ENV = "DEMONET_TOKEN"
"""The environment variable that holds the run token when no token file is given."""


def load_token(token_file: str | None, env: Mapping[str, str]) -> str:
    """The run token: the first line of `token_file`, else the DEMONET_TOKEN environment variable.

    Raises:
        ValueError: neither gives a non-empty token, or the file cannot be read.
    """
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise ValueError(f"cannot read the token file {token_file!r}: {e.strerror}") from None
        if not token:
            raise ValueError(f"the token file {token_file!r} is empty")
        return token
    token = env.get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(f"no token: pass --token-file FILE or set {TOKEN_ENV} (a `demonet up` run keeps its token "
                         "in OUT/token; `demonet status --dashboard URL` needs none)")
    return token
