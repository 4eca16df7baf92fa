"""The shard walk (docs/data.md): a peer's batches from a token file with a sidecar, read shard by shard so that
every shard it fetches is used up by consecutive batches; a pure function of (seed, rank, index).

Imports numpy, torch and the shard reader: no network code of its own (the reader's source does the reading).

Shape legend: B = batch, T = time (tokens), W = T + 1 (a window).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import struct
from typing import Any

import numpy as np
import torch

from .remote import ShardReader
from .tokens import check_stream, resumed_count

__all__ = ["ShardBatches"]


class ShardBatches:
    """An endless stream of (x, y) next-token batches that walks the shards of `shards` in a per-epoch order.

    Each shard holds ``tokens // (seq_len + 1)`` windows, back to back from its start (the rest of the shard, less
    than a window, is not used). Epoch e visits every shard of `shards` once, in the order of the BLAKE2b hash of
    (seed, rank, e, shard); the stream of windows is each visited shard's windows in turn, and batch n is windows
    [n * B, (n + 1) * B) of it. So batches are the same whether the shards come from a local file or a server, a
    fetched shard is used up by consecutive batches, and a stream's only state is its count of batches.

    Example:
        >>> x_BT, y_BT = next(ShardBatches(reader, range(10), batch_size=8, seq_len=128, seed=0))
    """

    def __init__(self, reader: ShardReader, shards: range, *, batch_size: int, seq_len: int, seed: int,
                 rank: int = 0) -> None:
        """Sets up the stream; nothing is read until the first batch.

        Args:
            reader: the token file's verified shards.
            shards: the shards this stream walks (`demonet.train.shards.split_shards`).
            batch_size: sequences per batch.
            seq_len: tokens per sequence.
            seed: the peer's data seed (`demonet.train.data.data_seed`), in [0, 2**64).
            rank: the peer's index, in [0, 2**64); peers with one seed and different ranks walk different orders.

        Raises:
            ValueError: bad sizes, or no shard of `shards` holds a window of seq_len + 1 tokens.
        """
        check_stream(batch_size=batch_size, seq_len=seq_len, seed=seed, rank=rank)
        table = reader.table
        self._windows = {s: table.tokens_of(s) // (seq_len + 1) for s in shards}
        self._shards = [s for s in shards if self._windows[s] > 0]
        if not self._shards:
            raise ValueError(f"the token data at {reader.source.location} has no shard of seq_len + 1 = {seq_len + 1} "
                             f"tokens to walk ({len(shards)} shards of at most {table.shard_tokens} tokens): use a "
                             "shorter seq_len, or make the sidecar with larger shards (`demonet data shard FILE "
                             "--shard-tokens N`)")
        self.batch_size, self.seq_len, self.seed, self.rank = batch_size, seq_len, seed, rank
        self.reader = reader
        self._per_epoch = sum(self._windows[s] for s in self._shards)
        self._orders: dict[int, tuple[list[int], list[int]]] = {}  # epoch: (shard order, windows before each)
        self.num_batches = 0
        """Batches drawn so far: the index of the next draw."""

    def __iter__(self) -> ShardBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch(self.num_batches)
        self.num_batches += 1
        # The next batch's shards are fetched while this one trains.
        self.reader.prefetch(sorted({s for s, _ in self.windows(self.num_batches)}))
        return batch

    def windows(self, index: int) -> list[tuple[int, int]]:
        """Batch `index`'s windows as (shard, first token within the shard), B of them."""
        out = []
        for j in range(index * self.batch_size, (index + 1) * self.batch_size):
            epoch, within = divmod(j, self._per_epoch)
            order, before = self._order(epoch)
            at = bisect.bisect_right(before, within) - 1
            out.append((order[at], (within - before[at]) * (self.seq_len + 1)))
        return out

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch `index` of this stream: (x, y), both (B, T) int64, y the tokens after x.

        Raises:
            TokenDataError: a shard it needs could not be read and verified.
        """
        width = self.seq_len + 1
        rows = [self.reader.shard(s)[start : start + width] for s, start in self.windows(index)]
        xy_BW = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T + 1)
        return xy_BW[:, :-1].contiguous(), xy_BW[:, 1:].contiguous()

    def _order(self, epoch: int) -> tuple[list[int], list[int]]:
        if epoch not in self._orders:
            order = sorted(self._shards, key=lambda s: hashlib.blake2b(
                struct.pack("<QQQQ", self.seed, self.rank, epoch % 2**64, s), digest_size=8).digest())
            before = [0, *itertools.accumulate(self._windows[s] for s in order)][:-1]
            if len(self._orders) >= 2:  # a batch spans at most two epochs
                del self._orders[min(self._orders)]
            self._orders[epoch] = (order, before)
        return self._orders[epoch]

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream, so a resumed peer continues it where it stopped."""
        return {"seed": self.seed, "rank": self.rank, "num_batches": self.num_batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues at a position saved by `state_dict` of a stream with the same seed and rank."""
        self.num_batches = resumed_count(state, seed=self.seed, rank=self.rank)
