"""Byte-level training data that needs no download, and seeded per-peer batch streams.

Imports torch and the standard library only: no optimizer, wire or network code.

Shape legend: N = corpus bytes, B = batch, T = time (tokens).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from pathlib import Path
from typing import Any

import torch

__all__ = ["Batches", "data_seed", "default_corpus", "load_corpus", "split"]

# Used only when pydoc_data is missing (some distro Pythons strip it). Fixed order, so the
# fallback corpus is the same on every peer running the same Python.
_FALLBACK_MODULES = (
    "argparse",
    "collections",
    "dataclasses",
    "functools",
    "inspect",
    "json.decoder",
    "logging",
    "pathlib",
    "textwrap",
    "typing",
)

# Mixes rank into the seed so that (seed, rank) pairs land far apart; the 64-bit golden ratio.
_RANK_STRIDE = 0x9E3779B97F4A7C15


def default_corpus() -> bytes:
    """The built-in corpus: the help topics that ship with Python (English prose, ~450 KB).

    Topics are joined in sorted key order so every peer builds the same bytes. If
    `pydoc_data.topics` is missing, the sources of a fixed list of stdlib modules are used.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError:
        sources = [inspect.getsource(importlib.import_module(name)) for name in _FALLBACK_MODULES]
        return "\n\n".join(sources).encode("utf-8")
    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def load_corpus(path: str | None = None, *, min_bytes: int = 2) -> torch.Tensor:
    """Loads a corpus as bytes.

    Args:
        path: a file read as raw bytes, or None for `default_corpus()`.
        min_bytes: the fewest bytes that are of use (seq_len + 1 for one training sequence).

    Returns:
        (N,) uint8 tensor.

    Raises:
        FileNotFoundError: `path` does not exist or is not a file.
        ValueError: the corpus is shorter than `min_bytes`.
    """
    if path is None:
        raw, source = default_corpus(), "the default corpus"
    else:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"corpus file {path!r} not found")
        raw, source = file.read_bytes(), f"corpus file {path!r}"
    if len(raw) < min_bytes:
        raise ValueError(f"{source} should hold at least {min_bytes} bytes, got {len(raw)}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # (N,)


def split(data: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Splits a corpus into train and validation parts: the last `val_fraction` is validation.

    Args:
        data: (N,) corpus.
        val_fraction: share of the bytes for validation, in [0, 1).

    Returns:
        (train, val) views of `data`.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction should be in [0, 1), got {val_fraction!r}")
    if data.ndim != 1:
        raise ValueError(f"data should be 1-D, got shape {tuple(data.shape)}")
    num_train = len(data) - int(len(data) * val_fraction)
    return data[:num_train], data[num_train:]


class Batches:
    """An endless stream of (x, y) next-token batches drawn at random offsets.

    The stream is a function of (seed, rank) only, so a coordinator hands out a seed and nothing
    else has to travel. With `world > 1` the corpus is cut into `world` contiguous shards and
    rank r samples windows lying inside shard r, so peers never train on the same bytes.

    Example:
        >>> x_BT, y_BT = next(Batches(data, batch_size=8, seq_len=128, seed=0))
    """

    def __init__(
        self,
        data: torch.Tensor,
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        """Sets up the stream.

        Args:
            data: (N,) 1-D integer tensor of token ids (uint8 bytes from `load_corpus`).
            batch_size: sequences per batch.
            seq_len: tokens per sequence.
            seed: shared seed, >= 0.
            rank: this peer's index in [0, world).
            world: number of shards.
        """
        for name, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} should be an int >= {low}, got {value!r}")
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"world should be an int >= 1, got {world!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank should be an int in [0, {world}), got {rank!r}")
        if data.ndim != 1 or data.dtype.is_floating_point or data.dtype.is_complex:
            raise ValueError(f"data should be a 1-D integer tensor, got {data.dtype} {tuple(data.shape)}")
        shard_len = len(data) // world
        if shard_len < seq_len + 1:
            raise ValueError(
                f"data should hold at least world * (seq_len + 1) = {world * (seq_len + 1)} tokens, "
                f"got {len(data)}"
            )
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.rank = rank
        self.world = world
        shard_N = data[rank * shard_len : (rank + 1) * shard_len]  # (N / world,)
        # Every window of seq_len + 1 tokens as a view, one per start offset: no copy.
        self._windows = shard_N.unfold(0, seq_len + 1, 1)  # (N / world - seq_len, T + 1)
        self._generator = torch.Generator().manual_seed((seed * _RANK_STRIDE + rank) % 2**63)
        self.num_batches = 0
        """Batches drawn so far."""

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        offsets_B = torch.randint(len(self._windows), (self.batch_size,), generator=self._generator)  # (B,)
        xy_BT1 = self._windows[offsets_B].long()  # (B, T + 1)
        self.num_batches += 1
        return xy_BT1[:, :-1].contiguous(), xy_BT1[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream, so a resumed peer continues it where it stopped."""
        return {
            "seed": self.seed,
            "rank": self.rank,
            "world": self.world,
            "num_batches": self.num_batches,
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a position saved by `state_dict` of a stream with the same seed, rank and world."""
        for key in ("seed", "rank", "world"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"{key} should be {getattr(self, key)} to resume this stream, got {state[key]}"
                )
        self._generator.set_state(state["generator"])
        self.num_batches = int(state["num_batches"])


def data_seed(run_seed: int, peer_id: str) -> int:
    """A peer's own data stream seed: stable across reconnects, different for every peer."""
    return int.from_bytes(hashlib.blake2b(f"{run_seed}:{peer_id}".encode(), digest_size=8).digest(), "little") >> 1
