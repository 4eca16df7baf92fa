"""What the round loop needs of a peer's torch side: `Replica`, and `Overlapping` for overlapped rounds.

A `demonet.train.trainer.Trainer` and a FlexDeMo rank (`demonet.flex.shard`) are both; `demonet.loop.RoundLoop`
drives either. Protocols only: imports torch and the math layer's payload (a transport's round result is a
`Settled` by its shape, not by an import).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from demonet.optim import Expected, Payload

__all__ = ["Expected", "Overlapping", "Replica", "Settled", "Spanning"]


class Settled(Protocol):
    """What a replica applies of a round's outcome (`demonet.transport.RoundResult` is one)."""

    @property
    def round(self) -> int: ...
    @property
    def aggregate(self) -> Payload | None:
        """What every member applies; None when the round was aborted."""
    @property
    def kept(self) -> Payload | None:
        """What of this peer's payload the aggregate holds, when that is not simply the aggregate."""


class Replica(Protocol):
    """The torch side of a peer, as the loop uses it (blocking calls: the loop runs them in a thread)."""

    def expected(self) -> Expected: ...
    def named_parameters(self) -> list[tuple[str, torch.Tensor]]: ...
    def digest(self) -> str: ...
    def load(self, tensors: dict[str, torch.Tensor]) -> None: ...
    def train_step(self, until: float | None = None) -> tuple[float, Payload]: ...
    def forward_backward(self, until: float | None = None) -> float:
        """The round's forward and backward: with `until` (a `time.perf_counter()` cut-off), as many
        micro-batches as end by then, at least one; without, the replica's fixed number."""
    def samples(self) -> int:
        """How many samples the last `forward_backward`'s gradient is the mean of: the payload's weight."""
    def micro_batches(self) -> int:
        """How many micro-batches the last `forward_backward` trained."""
    def compress(self, undoable: bool = False, topk: int | None = None) -> Payload: ...
    def drop_gradients(self) -> None: ...
    def restore(self, payload: Payload) -> None: ...
    def settle(self, payload: Payload | None, result: Settled, contributed: bool) -> None: ...
    def save(self, meta: dict[str, Any]) -> None: ...
    def saved(self) -> dict[str, Any] | None: ...
    def resume(self, *, momentum: bool) -> None: ...


class Overlapping(Replica, Protocol):
    """A replica that can train a round while the previous one's exchange runs (`[net] overlap = 1`):
    an undoable `compress`, and a lookahead (`demonet.optim.DeMo.lookahead`) that `settle`, `restore` and
    `load` replace."""

    def undo_compress(self) -> None: ...
    def commit_compress(self) -> None: ...
    def hold(self) -> None: ...
    def lookahead(self, payload: Payload, round: int) -> None: ...
    def canonical_parameters(self) -> list[tuple[str, torch.Tensor]]: ...


@runtime_checkable
class Spanning(Replica, Protocol):
    """A replica whose micro-batch can run across rounds (a DHT peer slower than a round by its compute,
    `demonet.loop.spanning`): on a copy of its parameters taken as the micro-batch starts, while the rounds go on
    applying their aggregates to the replica itself."""

    def span_begin(self) -> None: ...
    def span_micro_batch(self) -> tuple[float, float]: ...
    def span_take(self) -> None: ...
    def span_rows(self) -> int: ...
