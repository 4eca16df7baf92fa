"""A token file's shards (docs/data.md): the sidecar `FILE.shards` that lists each shard's SHA-256, the pin that
names a file and its sidecar in one digest, and the train/validation split in shards.

Imports numpy and the standard library only: no torch, no network (demonet.train.sources reads the bytes).
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .tokens import HEADER_BYTES, TokenHeader, read_header

__all__ = ["DEFAULT_SHARD_TOKENS", "SHARDS_MAGIC", "SIDECAR_SUFFIX", "ShardMismatch", "ShardTable", "TokenDataError",
           "pin_of", "split_shards", "write_shards"]

SHARDS_MAGIC = b"DEMOSHRD"
"""The first 8 bytes of every sidecar."""
SIDECAR_SUFFIX = ".shards"
"""A token file's sidecar is its path or URL with this appended."""
DEFAULT_SHARD_TOKENS = 65_536
"""Tokens per shard unless told otherwise: 128 KiB of uint16 ids, 256 KiB of uint32."""
_VERSION = 1
# magic, version, bytes per token, tokens per shard, token count; then one SHA-256 (32 bytes) per shard.
_FIXED = struct.Struct("<8sIIQQ")
_DIGEST_BYTES = 32


class TokenDataError(RuntimeError):
    """Token data that could not be read whole and verified (after the retries): the peer stops rather than train
    on bytes it cannot trust. Not a `DemonetError`: no round boundary catches it."""


class ShardMismatch(TokenDataError):
    """One shard's bytes are not the ones its sidecar lists (corrupted, truncated or swapped); `index` names it."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True, kw_only=True)
class ShardTable:
    """A sidecar's contents: how the token ids are cut into shards and each shard's SHA-256."""

    itemsize: int
    """Bytes per token (2 or 4), as the token file's header says."""
    shard_tokens: int
    """Tokens per shard; the last shard holds the rest (1 to `shard_tokens` tokens)."""
    num_tokens: int
    """Tokens in the file, as its header says."""
    digests: tuple[bytes, ...]
    """The SHA-256 of each shard's bytes, in order."""

    @property
    def num_shards(self) -> int:
        return len(self.digests)

    def tokens_of(self, index: int) -> int:
        """Tokens in shard `index`."""
        return min(self.shard_tokens, self.num_tokens - index * self.shard_tokens)

    def byte_range(self, index: int) -> tuple[int, int]:
        """(offset in the token file, length) of shard `index`'s bytes."""
        if not 0 <= index < self.num_shards:
            raise IndexError(f"shard {index} is not one of the {self.num_shards} shards")
        return HEADER_BYTES + index * self.shard_tokens * self.itemsize, self.tokens_of(index) * self.itemsize

    def verify(self, index: int, data: bytes, where: str) -> None:
        """Raises ShardMismatch unless `data` are shard `index`'s bytes (length, then SHA-256)."""
        _, length = self.byte_range(index)
        if len(data) != length:
            raise ShardMismatch(f"shard {index} of {where} is truncated: {len(data)} of its {length} bytes", index)
        if hashlib.sha256(data).digest() != self.digests[index]:
            raise ShardMismatch(f"shard {index} of {where} does not match its SHA-256 in the sidecar (corrupted "
                                "or changed since the sidecar was made)", index)

    def check_header(self, header: TokenHeader, where: str) -> None:
        """Raises ValueError unless this table was made for a file with `header`'s token type and count."""
        if (self.itemsize, self.num_tokens) != (_ITEMSIZE[header.dtype], header.num_tokens):
            raise ValueError(f"the sidecar of {where} is for {self.num_tokens} tokens of {self.itemsize} bytes, but "
                             f"the file holds {header.num_tokens} {header.dtype} tokens; make it again with "
                             "`demonet data shard FILE`")

    def pack(self) -> bytes:
        return _FIXED.pack(SHARDS_MAGIC, _VERSION, self.itemsize, self.shard_tokens, self.num_tokens) + b"".join(
            self.digests)

    @classmethod
    def unpack(cls, raw: bytes, where: str) -> ShardTable:
        """Reads a sidecar's bytes.

        Raises:
            ValueError: naming `where`: not a sidecar, another version, a bad shard size or a length that does
                not match its shard count.
        """
        if len(raw) < _FIXED.size or raw[: len(SHARDS_MAGIC)] != SHARDS_MAGIC:
            raise ValueError(f"{where} is not a demonet shard list (it should start with {SHARDS_MAGIC!r}); "
                             "make one with `demonet data shard FILE`")
        _, version, itemsize, shard_tokens, num_tokens = _FIXED.unpack_from(raw)
        if version != _VERSION:
            raise ValueError(f"{where} is shard list version {version}; this demonet reads version {_VERSION}")
        if itemsize not in (2, 4) or shard_tokens < 1:
            raise ValueError(f"{where} has {itemsize}-byte tokens in shards of {shard_tokens}: it should have 2 or "
                             "4 bytes a token and at least 1 token a shard")
        num_shards = math.ceil(num_tokens / shard_tokens)
        if len(raw) != _FIXED.size + num_shards * _DIGEST_BYTES:
            raise ValueError(f"{where} is {len(raw)} bytes; {num_shards} shards take "
                             f"{_FIXED.size + num_shards * _DIGEST_BYTES} (truncated or not a shard list)")
        body = raw[_FIXED.size:]
        digests = tuple(body[i : i + _DIGEST_BYTES] for i in range(0, len(body), _DIGEST_BYTES))
        return cls(itemsize=itemsize, shard_tokens=shard_tokens, num_tokens=num_tokens, digests=digests)


_ITEMSIZE = {"uint16": 2, "uint32": 4}


def pin_of(header: bytes, sidecar: bytes) -> str:
    """The pin of a token file: the SHA-256, in hex, of its 256-byte header followed by its sidecar's bytes.

    The sidecar lists every shard's SHA-256, so the pin names every byte of the file: a coordinator that sends
    it lets a peer refuse a file, or a server, that changed.

    Raises:
        ValueError: `header` is not 256 bytes.
    """
    if len(header) != HEADER_BYTES:
        raise ValueError(f"header should be the {HEADER_BYTES} bytes a token file starts with, got {len(header)}")
    return hashlib.sha256(header + sidecar).hexdigest()


def write_shards(path: str | Path, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> tuple[ShardTable, str]:
    """Writes `path`'s sidecar (`path` + ``.shards``, replaced if it exists, complete or not at all).

    Returns:
        the table written, and the file's pin.

    Raises:
        ValueError: a bad shard size, or what `read_header` raises for a file that is not a token file.
    """
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or not 1 <= shard_tokens < 2**40:
        raise ValueError(f"shard_tokens should be an int in [1, 2**40), got {shard_tokens!r}")
    header = read_header(path)
    itemsize = _ITEMSIZE[header.dtype]
    digests = []
    with open(path, "rb") as f:
        raw_header = f.read(HEADER_BYTES)
        for _ in range(math.ceil(header.num_tokens / shard_tokens)):
            digests.append(hashlib.sha256(f.read(shard_tokens * itemsize)).digest())
    table = ShardTable(itemsize=itemsize, shard_tokens=shard_tokens, num_tokens=header.num_tokens,
                       digests=tuple(digests))
    sidecar = Path(str(path) + SIDECAR_SUFFIX)
    tmp = sidecar.with_name(sidecar.name + ".tmp")
    try:
        tmp.write_bytes(table.pack())
        os.replace(tmp, sidecar)
    finally:
        tmp.unlink(missing_ok=True)
    return table, pin_of(raw_header, table.pack())


def split_shards(num_shards: int, val_fraction: float = 0.05) -> tuple[range, range]:
    """(train, val) shard indices: the last `val_fraction` of the shards, rounded up, is validation; a file of one
    shard has no validation part (all of it trains).

    Raises:
        ValueError: `val_fraction` outside [0, 1).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction should be in [0, 1), got {val_fraction!r}")
    num_val = math.ceil(num_shards * val_fraction) if num_shards > 1 else 0
    return range(num_shards - num_val), range(num_shards - num_val, num_shards)
