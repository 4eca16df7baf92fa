"""A run's token data, wherever it lives (docs/data.md): `open_tokens(path or URL)` checks the header and the
sidecar, and hands out each peer's batch stream: the shard walk over verified shards when the file has a sidecar,
random windows of the memory map for a local file without one.

Training layer: imports the token, shard, source and reader modules; no demonet service.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from .remote import DEFAULT_CACHE_BYTES, DEFAULT_RETRY, RetryPolicy, ShardCache, ShardReader, default_cache_dir, fetch
from .shards import SIDECAR_SUFFIX, ShardTable, pin_of, split_shards
from .sources import FileSource, Source, is_url, open_source
from .tokens import (
    HEADER_BYTES,
    TokenBatches,
    TokenFile,
    TokenHeader,
    check_tokenizer,
    check_vocab,
    parse_header,
    read_header,
)
from .walk import ShardBatches

__all__ = ["TokenData", "open_tokens"]

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class TokenData:
    """An opened token file: its header, and its verified shards (`reader`) or its memory map (`file`)."""

    location: str
    """The path or URL it was opened from."""
    header: TokenHeader
    reader: ShardReader | None
    """The shards, when the file has a sidecar."""
    file: TokenFile | None
    """The memory map of a local file without a sidecar."""

    @property
    def pin(self) -> str | None:
        """The digest of the header and the sidecar (`demonet.train.shards.pin_of`); None without a sidecar."""
        return self.reader.pin if self.reader is not None else None

    def check_vocab(self, vocab_size: int) -> None:
        check_vocab(self.header, self.location, vocab_size)

    def check_tokenizer(self, tokenizer: str) -> None:
        check_tokenizer(self.header, self.location, tokenizer)

    def batches(self, *, batch_size: int, seq_len: int, seed: int, rank: int = 0,
                part: Literal["train", "val"] = "train") -> Batches:
        """A peer's endless stream of (x, y) batches from the training part (the first 95%) or the validation part.

        With a sidecar: the shard walk over the part's shards (`ShardBatches`); without: random windows of the
        part's tokens (`TokenBatches`). Nothing is read until the first batch.

        Raises:
            ValueError: bad sizes, or a part too small for one window.
        """
        if self.reader is not None:
            train, val = split_shards(self.reader.table.num_shards)
            shards = train if part == "train" else val
            if not shards:
                raise ValueError(f"the token data at {self.location} has a single shard, so no validation part; make "
                                 "the sidecar with smaller shards (`demonet data shard FILE --shard-tokens N`)")
            return ShardBatches(self.reader, shards, batch_size=batch_size, seq_len=seq_len, seed=seed, rank=rank)
        assert self.file is not None
        tokens = self.file.split()[0 if part == "train" else 1]
        return TokenBatches(tokens, batch_size=batch_size, seq_len=seq_len, seed=seed, rank=rank)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def open_tokens(location: str | Path, *, pin: str | None = None, cache_dir: Path | None = None,
                cache_bytes: int = DEFAULT_CACHE_BYTES, retry: RetryPolicy = DEFAULT_RETRY) -> TokenData:
    """Opens a token file at a path, an ``http(s)://`` URL or another fsspec URL (``s3://``).

    Reads the header and the sidecar (``LOCATION.shards``): a URL needs one, a local path uses one if it is
    there. A URL's verified shards are cached under `cache_dir` / pin; with `pin` given and that folder holding
    the header and sidecar of that pin, nothing is fetched to open it.

    Args:
        location: the token file.
        pin: the pin the file must have (a run's); None: any.
        cache_dir: the cache of a URL's shards; None: `default_cache_dir()`.
        cache_bytes: the cache's size cap.
        retry: how failed reads are tried again.

    Raises:
        FileNotFoundError: no such file, or a URL without a sidecar.
        ValueError: a bad header or sidecar, one that does not match the other, or a pin other than `pin`.
        TokenDataError: the header or sidecar could not be read after the retries (a server down).
        ImportError: an fsspec URL whose package is not installed.
    """
    where = str(location)
    if not is_url(location):
        return _open_local(Path(where.removeprefix("file://")), where, pin)
    source = open_source(where)
    start_s = time.monotonic()
    root = cache_dir or default_cache_dir()
    raw = ShardCache(root, pin, cache_bytes).get_meta() if pin is not None else None
    if raw is None or pin_of(*raw) != pin:  # not saved yet, or a damaged copy
        raw = _fetch_meta(source, retry)
    header = parse_header(raw[0], where)
    table, found = _checked(raw, header, where, pin)
    cache = ShardCache(root, found, cache_bytes)
    cache.put_meta(*raw)
    reader = ShardReader(source, table, found, cache=cache, retry=retry, meta_s=time.monotonic() - start_s)
    return TokenData(where, header, reader, None)


def _open_local(path: Path, where: str, pin: str | None) -> TokenData:
    """A local file: its verified shards when it has a sidecar, else its memory map."""
    sidecar = Path(str(path) + SIDECAR_SUFFIX)
    if not sidecar.is_file():
        if pin is not None:
            raise ValueError(f"the token file {where} has no sidecar {sidecar}, so it cannot match the run's pin; "
                             "make it with `demonet data shard FILE`")
        file = TokenFile.open(path)
        return TokenData(where, file.header, None, file)
    start_s = time.monotonic()
    header = read_header(path)
    with open(path, "rb") as f:
        raw = (f.read(HEADER_BYTES), sidecar.read_bytes())
    table, found = _checked(raw, header, where, pin)
    return TokenData(where, header, ShardReader(FileSource(path), table, found, meta_s=time.monotonic() - start_s),
                     None)


def _checked(raw: tuple[bytes, bytes], header: TokenHeader, where: str, pin: str | None) -> tuple[ShardTable, str]:
    """The sidecar's table, checked against the header, and the pin, checked against `pin` when given."""
    table = ShardTable.unpack(raw[1], where + SIDECAR_SUFFIX)
    table.check_header(header, where)
    found = pin_of(*raw)
    if pin is not None and found != pin:
        raise ValueError(f"the token data at {where} has pin {found}, not the run's {pin}: the file or its sidecar "
                         "changed since the run started; serve the run's own file")
    return table, found


def _fetch_meta(source: Source, retry: RetryPolicy) -> tuple[bytes, bytes]:
    """A URL's header and sidecar, each read with the retries."""
    where = source.location
    sidecar = open_source(where + SIDECAR_SUFFIX)
    try:
        raw_header = fetch(f"the header of {where}", lambda: source.read(0, HEADER_BYTES), retry)
        try:
            raw_sidecar = fetch(f"the sidecar of {where}", sidecar.read_all, retry)
        except FileNotFoundError:
            raise FileNotFoundError(f"the token data at {where} has no sidecar {where}{SIDECAR_SUFFIX}: a URL is "
                                    "read shard by shard and needs one (`demonet data shard FILE`, then serve "
                                    "FILE.shards beside it)") from None
    finally:
        sidecar.close()
    return raw_header, raw_sidecar
