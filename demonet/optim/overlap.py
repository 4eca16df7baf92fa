"""What DeMo keeps for overlapped rounds (`[net] overlap = 1`): the lookahead and the undoable compress.

An overlapped peer trains round r+1 from the parameters after its own round-r update (`lookahead`),
and compresses round r+1's gradient before round r's outcome is known (`compress(undoable=True)`).
Both are replaced to the bit when the outcome comes: `apply`/`restore` undo the lookahead first, and
`undo_compress` puts the momentum back when round r is lost. Each keeps one copy of what it changes
(the parameters and Adam's state; the momentum), in buffers reused from round to round.

A mixin of `demonet.optim.DeMo`, which supplies the buckets, the slots, the state and `_apply`.
Imports torch only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .buckets import Bucket, Slot, local_tensor
from .payload import Payload


class OverlapState:
    """The lookahead (`hold`, `lookahead`, `undo_lookahead`) and the undoable compress (`undo_compress`,
    `commit_compress`, `momentum_before_compress`) of `demonet.optim.DeMo`."""

    _buckets: list[Bucket]
    _slots: list[Slot]
    state: Any

    if TYPE_CHECKING:  # DeMo's
        def _check_payload(self, payload: Payload) -> None: ...
        def _apply(self, aggregate: Payload, lr: float | None) -> None: ...

    def _init_overlap(self) -> None:
        self._held: list[torch.Tensor] | None = None  # what a lookahead changed (`lookahead`), live tensors
        self._held_copy: list[torch.Tensor] = []  # their bits from before it, buffers kept between rounds
        self._ahead = False  # the lookahead was applied (not only held)
        self._kept: list[torch.Tensor] | None = None  # the momentum buffers an undoable `compress` changed
        self._kept_copy: list[torch.Tensor] = []  # their bits from before it (plus every `restore` since)

    # -- the lookahead ---------------------------------------------------------------------------------

    def _changed_by_apply(self) -> list[torch.Tensor]:
        """Every tensor an `apply` writes: the parameters (local shards), Adam's moments, its step counts."""
        out = [local_tensor(slot.param) for slot in self._slots]
        for bucket in self._buckets:
            if bucket.exp_avg_BN is not None and bucket.exp_avg_sq_BN is not None:
                out += [bucket.exp_avg_BN, bucket.exp_avg_sq_BN]
        out += [self.state[slot.param]["step"] for slot in self._slots if "step" in self.state[slot.param]]
        return out

    @torch.no_grad()
    def hold(self) -> None:
        """Keep a copy of what an apply writes (the parameters, and Adam's state), for a `lookahead`.

        From here until the lookahead is undone, `held_parameters` gives the parameters as they are now,
        also while the lookahead is being applied in another thread.
        """
        if self._held is not None:
            raise RuntimeError("a lookahead is already held: apply or restore the previous round first")
        live = self._changed_by_apply()
        if [(t.shape, t.dtype, t.device) for t in live] != [(t.shape, t.dtype, t.device) for t in self._held_copy]:
            self._held_copy = [torch.empty_like(t) for t in live]
        torch._foreach_copy_(self._held_copy, live)
        self._held = live

    @torch.no_grad()
    def lookahead(self, update: Payload, lr: float | None = None) -> None:
        """Apply `update` now, as a stand-in for an aggregate still on its way, keeping what it changes.

        An overlapped peer applies its own payload (``aggregate([payload])``) at once and trains the
        next round from there; the next `apply` (the real aggregate) or `restore` (the round was lost)
        first puts the parameters and the base optimizer's state back to their exact bits from before
        (`undo_lookahead`). The momentum is untouched: `compress` already took out what was sent.
        The copy is taken here unless `hold` took it already.
        """
        if self._ahead:
            raise RuntimeError("a lookahead is already held: apply or restore the previous round first")
        self._check_payload(update)
        if self._held is None:
            self.hold()
        self._ahead = True
        self._apply(update, lr)

    @torch.no_grad()
    def undo_lookahead(self) -> bool:
        """Put back the bits a held `lookahead` changed; False if none was held."""
        if self._held is None:
            return False
        torch._foreach_copy_(self._held, self._held_copy)
        self._held, self._ahead = None, False
        return True

    def held_parameters(self) -> dict[str, torch.Tensor] | None:
        """The parameters (local shards) from before a held lookahead, by name; None if none is held.
        Read-only views, valid until the lookahead is undone."""
        if self._held is None:
            return None
        return {slot.name: t for slot, t in zip(self._slots, self._held_copy, strict=False)}

    # -- the undoable compress -------------------------------------------------------------------------

    @torch.no_grad()
    def _keep_momentum(self) -> None:
        if self._kept is not None:
            raise RuntimeError("an undoable compress is pending: commit or undo it first")
        live = [bucket.momentum_BN for bucket in self._buckets]
        if [(t.shape, t.dtype, t.device) for t in live] != [(t.shape, t.dtype, t.device) for t in self._kept_copy]:
            self._kept_copy = [torch.empty_like(t) for t in live]
        torch._foreach_copy_(self._kept_copy, live)
        self._kept = live

    @torch.no_grad()
    def undo_compress(self) -> None:
        """Put the momentum back as it was before the pending undoable `compress`, with every `restore`
        since: as if that compress had never run (its gradients are gone all the same)."""
        if self._kept is None:
            raise RuntimeError("no undoable compress is pending")
        torch._foreach_copy_(self._kept, self._kept_copy)
        self._kept = None

    def commit_compress(self) -> None:
        """Keep the pending undoable `compress`: its payload is on its way."""
        self._kept = None

    def momentum_before_compress(self) -> _BeforeCompress:
        """A context in which, while an undoable `compress` is pending, the momentum (`state[p]["momentum"]`)
        shows what `undo_compress` would give, e.g. for a checkpoint of the round that compress belongs to;
        the live momentum is back on exit."""
        return _BeforeCompress(self._kept, self._kept_copy)

    def _kept_momentum(self) -> dict[int, torch.Tensor]:
        """While an undoable compress is pending: the copy of each momentum buffer, by the buffer's id (a
        `restore` adds to both, so that the undo keeps it); else empty."""
        if self._kept is None:
            return {}
        return {id(m): c for m, c in zip(self._kept, self._kept_copy, strict=True)}


class _BeforeCompress:
    """`OverlapState.momentum_before_compress`: swaps the kept copy in for the duration (a plain class:
    the math layer imports torch and the stdlib's math only)."""

    def __init__(self, live: list[torch.Tensor] | None, kept: list[torch.Tensor]) -> None:
        self.live, self.kept = live, kept
        self.aside: list[torch.Tensor] = []

    def __enter__(self) -> None:
        if self.live is not None:
            with torch.no_grad():
                self.aside = [t.clone() for t in self.live]
                torch._foreach_copy_(self.live, self.kept)

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.live, self.aside)
            self.aside = []
