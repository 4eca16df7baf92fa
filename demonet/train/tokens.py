"""Token files (docs/data.md): a 256-byte header, then the raw little-endian token ids; the writer, a
memory-mapped reader, and per-peer batch streams that carry no state but a count.

Imports numpy, torch and the standard library: no tokenizer (demonet.train.tokenizer), optimizer, wire or
network code.

Shape legend: N = tokens in the file, B = batch, T = time (tokens).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["DTYPES", "HEADER_BYTES", "MAGIC", "VERSION", "TokenBatches", "TokenFile", "TokenHeader", "check_stream",
           "check_tokenizer", "check_vocab", "choose_dtype", "parse_header", "read_header", "resumed_count",
           "write_tokens"]

MAGIC = b"DEMOTOKS"
"""The first 8 bytes of every token file."""
VERSION = 1
"""The layout version this code reads and writes."""
HEADER_BYTES = 256
"""Tokens start at this offset (a multiple of every token size, so the memory map is aligned)."""
DTYPES = {"uint16": 2, "uint32": 4}
"""Token types by name, with their size in bytes (the header stores the size)."""

# magic, version, bytes per token, token count, vocab size; then the tokenizer's identity, UTF-8, NUL-padded.
_FIXED = struct.Struct("<8sIIQQ")
_NAME_BYTES = HEADER_BYTES - _FIXED.size
_NUMPY: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


@dataclass(frozen=True, kw_only=True)
class TokenHeader:
    """What a token file says about itself."""

    dtype: str
    """``uint16`` or ``uint32``."""
    num_tokens: int
    """Tokens after the header."""
    vocab_size: int
    """Every id in the file is below this."""
    tokenizer: str
    """The tokenizer's identity: ``bytes``, or a tokenizer directory's name and ``@`` and a hash of its
    tokenizer.json (the first 16 hex digits of its SHA-256)."""

    def pack(self) -> bytes:
        name = self.tokenizer.encode("utf-8")
        if len(name) > _NAME_BYTES:
            raise ValueError(f"tokenizer name should be at most {_NAME_BYTES} UTF-8 bytes, got {len(name)}")
        return _FIXED.pack(MAGIC, VERSION, DTYPES[self.dtype], self.num_tokens, self.vocab_size) + name.ljust(
            _NAME_BYTES, b"\0")


def choose_dtype(vocab_size: int, dtype: str | None = None) -> str:
    """The token type for a vocab: `dtype` if given and wide enough, else the narrowest that holds every id.

    Raises:
        ValueError: `dtype` is unknown, or too narrow for `vocab_size`.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size should be >= 1, got {vocab_size}")
    if dtype is None:
        return "uint16" if vocab_size <= 2**16 else "uint32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype should be one of {sorted(DTYPES)}, got {dtype!r}")
    if vocab_size > 2 ** (8 * DTYPES[dtype]):
        raise ValueError(f"a vocab of {vocab_size} ids does not fit {dtype} (at most {2 ** (8 * DTYPES[dtype])} ids); "
                         "use uint32")
    return dtype


def write_tokens(path: str | Path, chunks: Iterable[npt.ArrayLike], *, vocab_size: int, tokenizer: str,
                 dtype: str | None = None) -> TokenHeader:
    """Writes a token file from chunks of ids, streaming; the file appears only once complete (a temp file, then a
    rename), so a failure leaves no partial file behind.

    Args:
        path: the token file.
        chunks: 1-D integer arrays of ids in [0, vocab_size), written in order.
        vocab_size: the tokenizer's vocab.
        tokenizer: the tokenizer's identity (`demonet.train.tokenizer.Tokenizer.name`).
        dtype: ``uint16``, ``uint32`` or None for the narrowest that fits (`choose_dtype`).

    Returns:
        the header written.

    Raises:
        ValueError: a bad dtype for the vocab, a tokenizer name too long, or an id outside [0, vocab_size).
    """
    header = TokenHeader(dtype=choose_dtype(vocab_size, dtype), num_tokens=0, vocab_size=vocab_size,
                         tokenizer=tokenizer)
    header.pack()  # a name that does not fit fails before any file is made
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # `--out data/corpus.tok` in a fresh clone: data/ is made
    tmp = path.with_name(path.name + ".tmp")
    num_tokens = 0
    try:
        with open(tmp, "wb") as f:
            f.write(bytes(HEADER_BYTES))
            for chunk in chunks:
                ids = np.asarray(chunk)
                if ids.ndim != 1 or ids.dtype.kind not in "iu":
                    raise ValueError(f"chunks should be 1-D integer arrays, got {ids.dtype} {ids.shape}")
                if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                    raise ValueError(f"token ids should be in [0, {vocab_size}), got ids from {int(ids.min())} "
                                     f"to {int(ids.max())} after {num_tokens} tokens")
                f.write(ids.astype(_NUMPY[header.dtype]).tobytes())
                num_tokens += ids.size
            header = TokenHeader(dtype=header.dtype, num_tokens=num_tokens, vocab_size=vocab_size, tokenizer=tokenizer)
            f.seek(0)
            f.write(header.pack())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return header


def read_header(path: str | Path) -> TokenHeader:
    """Reads and checks a token file's header against the file's size.

    Raises:
        FileNotFoundError: no such file.
        ValueError: naming the file: not a token file (magic), another version, an unknown token size, a zero
            vocab, or a size that does not match the token count (a truncated file or trailing bytes).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file {str(path)!r} not found")
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    return parse_header(raw, str(path), path.stat().st_size)


def parse_header(raw: bytes, where: str, size: int | None = None) -> TokenHeader:
    """Checks a token file's first 256 bytes (`raw`), and its size in bytes when known (`size`).

    Raises:
        ValueError: naming `where`, as `read_header`.
    """
    if len(raw) < len(MAGIC) or raw[: len(MAGIC)] != MAGIC:
        raise ValueError(f"{where} is not a demonet token file (it should start with {MAGIC!r}); "
                         "write one with `demonet data tokenize`")
    if len(raw) < HEADER_BYTES:
        raise ValueError(f"{where} is truncated: {size if size is not None else len(raw)} bytes, shorter than the "
                         f"{HEADER_BYTES}-byte header")
    magic, version, itemsize, num_tokens, vocab_size = _FIXED.unpack_from(raw)
    if version != VERSION:
        raise ValueError(f"{where} is token file version {version}; this demonet reads version {VERSION}")
    dtype = next((name for name, n in DTYPES.items() if n == itemsize), None)
    if dtype is None:
        raise ValueError(f"{where} has tokens of {itemsize} bytes; they should be 2 (uint16) or 4 (uint32)")
    if vocab_size < 1:
        raise ValueError(f"{where} has a vocab size of {vocab_size}; it should be >= 1")
    if size is not None and size != HEADER_BYTES + num_tokens * itemsize:
        what = "truncated" if size < HEADER_BYTES + num_tokens * itemsize else "longer than its header says"
        raise ValueError(f"{where} is {what}: {size} bytes, but the header says {num_tokens} {dtype} tokens "
                         f"({HEADER_BYTES + num_tokens * itemsize} bytes with the header)")
    try:
        name = raw[_FIXED.size : HEADER_BYTES].rstrip(b"\0").decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{where} has a tokenizer name that is not UTF-8") from None
    return TokenHeader(dtype=dtype, num_tokens=num_tokens, vocab_size=vocab_size, tokenizer=name)


def check_vocab(header: TokenHeader, where: str, vocab_size: int) -> None:
    """Raises ValueError unless a model with `vocab_size` ids covers every id the file at `where` may hold."""
    if header.vocab_size > vocab_size:
        raise ValueError(f"model.vocab_size should be >= {header.vocab_size}, the vocab of the token file "
                         f"{where} (tokenizer {header.tokenizer}); got {vocab_size}")


def check_tokenizer(header: TokenHeader, where: str, tokenizer: str) -> None:
    """Raises ValueError unless the file at `where` was made with `tokenizer` (its identity; empty: any)."""
    if tokenizer and header.tokenizer != tokenizer:
        raise ValueError(f"the token file {where} was made with tokenizer {header.tokenizer!r}; the "
                         f"run's is {tokenizer!r} (make it again with `demonet data tokenize` and that tokenizer)")


@dataclass(frozen=True)
class TokenFile:
    """A checked token file and its tokens, memory-mapped read-only (nothing is read until used).

    Example:
        >>> train_N, val_N = TokenFile.open("corpus.tok").split()
    """

    path: Path
    header: TokenHeader
    tokens: npt.NDArray[np.unsignedinteger[Any]]
    """(N,) the ids."""

    @classmethod
    def open(cls, path: str | Path) -> TokenFile:
        """Raises what `read_header` raises."""
        header = read_header(path)
        dtype = _NUMPY[header.dtype]
        if header.num_tokens == 0:  # mmap cannot map zero bytes
            return cls(Path(path), header, np.zeros(0, dtype=dtype))
        tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(header.num_tokens,))
        return cls(Path(path), header, tokens)

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError unless a model with `vocab_size` ids covers every id the file may hold."""
        check_vocab(self.header, str(self.path), vocab_size)

    def check_tokenizer(self, tokenizer: str) -> None:
        """Raises ValueError unless the file was made with `tokenizer` (its identity; empty: any)."""
        check_tokenizer(self.header, str(self.path), tokenizer)

    def split(self, val_fraction: float = 0.05) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """(train, val) views: the last `val_fraction` of the tokens is validation, as `demonet.train.data.split`."""
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction should be in [0, 1), got {val_fraction!r}")
        num_train = len(self.tokens) - int(len(self.tokens) * val_fraction)
        return self.tokens[:num_train], self.tokens[num_train:]


class TokenBatches:
    """An endless stream of (x, y) next-token batches at pseudo-random offsets of a 1-D token array.

    Draw n is a function of (seed, rank, n) alone, so the stream's only state is the count of draws: a
    restarted peer continues with `load_state_dict` of a count (its round times its micro-batches per round)
    and nothing else, and no data lists travel. Offsets come from BLAKE2b, the same on every machine.

    Example:
        >>> x_BT, y_BT = next(TokenBatches(tokens_N, batch_size=8, seq_len=128, seed=0))
    """

    def __init__(self, tokens: npt.NDArray[Any], *, batch_size: int, seq_len: int, seed: int, rank: int = 0) -> None:
        """Sets up the stream.

        Args:
            tokens: (N,) integer ids, e.g. a `TokenFile`'s memory map or a part of its `split`.
            batch_size: sequences per batch.
            seq_len: tokens per sequence.
            seed: the peer's data seed (`demonet.train.data.data_seed`), in [0, 2**64).
            rank: the peer's index, in [0, 2**64); peers with one seed and different ranks draw different batches.
        """
        check_stream(batch_size=batch_size, seq_len=seq_len, seed=seed, rank=rank)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"tokens should be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        if len(tokens) < seq_len + 1:
            raise ValueError(f"tokens should hold at least seq_len + 1 = {seq_len + 1} ids, got {len(tokens)}")
        self.batch_size, self.seq_len, self.seed, self.rank = batch_size, seq_len, seed, rank
        self._tokens = tokens
        self._num_windows = len(tokens) - seq_len  # start offsets of seq_len + 1 tokens
        self.num_batches = 0
        """Batches drawn so far: the index of the next draw."""

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch(self.num_batches)
        self.num_batches += 1
        return batch

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw `index` of this stream: (x, y), both (B, T) int64, y the tokens after x."""
        offsets_B = [int.from_bytes(hashlib.blake2b(struct.pack("<QQQQ", self.seed, self.rank, index, b),
                                                    digest_size=8).digest(), "little") % self._num_windows
                     for b in range(self.batch_size)]
        xy_BT1 = torch.from_numpy(np.stack([self._tokens[o : o + self.seq_len + 1] for o in offsets_B])
                                  .astype(np.int64))  # (B, T + 1)
        return xy_BT1[:, :-1].contiguous(), xy_BT1[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream, so a resumed peer continues it where it stopped."""
        return {"seed": self.seed, "rank": self.rank, "num_batches": self.num_batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues at a position saved by `state_dict` of a stream with the same seed and rank."""
        self.num_batches = resumed_count(state, seed=self.seed, rank=self.rank)


def check_stream(*, batch_size: int, seq_len: int, seed: int, rank: int) -> None:
    """Raises ValueError unless a batch stream's sizes and seeds are ints in range (one rule for both streams)."""
    for name, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("seed", seed, 0),
                             ("rank", rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**64:
            raise ValueError(f"{name} should be an int in [{low}, 2**64), got {value!r}")


def resumed_count(state: dict[str, Any], *, seed: int, rank: int) -> int:
    """The batch count a stream with `seed` and `rank` continues at, from a `state_dict`; raises ValueError for a
    state of another stream or a bad count."""
    for key, value in (("seed", seed), ("rank", rank)):
        if state[key] != value:
            raise ValueError(f"{key} should be {value} to resume this stream, got {state[key]}")
    num_batches = state["num_batches"]
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
        raise ValueError(f"num_batches should be an int >= 0, got {num_batches!r}")
    return num_batches
