"""The coordinator's canonical state: named parameters, the round's aggregate, its snapshot and state file.

No network and no asyncio: the gRPC servicer calls these from `asyncio.to_thread`. The model code
is used once, to create the initial named tensors; after that the state is only tensors. When the
state file is written is `demonet.coordinator.persist`'s business.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from demonet.config import Config
from demonet.optim import DeMo, LrSchedule, Payload
from demonet.train.task import build_task
from demonet.wire import params as wire_params
from demonet.wire.digest import legacy_param_digest, param_digest
from demonet.wire.merge import MergeRules, merge

from .rounds import ClosedRound

__all__ = ["CanonicalState", "ClosedAggregate", "write_state"]

logger = logging.getLogger(__name__)

STATE_FILE = "coordinator-state.pt"


@dataclass(frozen=True)
class ClosedAggregate:
    """A closed round as peers download it."""

    round: int
    aborted: bool
    contributors: tuple[str, ...]
    param_digest: str  # canonical, after applying ("" from `merge_round` until `advance`)
    data: bytes  # the serialized aggregate Payload (empty when aborted)
    clipped: tuple[str, ...] = ()  # contributors whose payload norm was clipped to the round's median
    capped: tuple[str, ...] = ()  # contributors whose samples were capped in the merge's weights
    weights: tuple[float, ...] = ()  # each contributor's weight in the merge (its samples, capped); () unweighted
    next_round_s: float = 0.0  # the length of the round after (`demonet.wire.pace`); 0: lockstep


class CanonicalState:
    """The parameters every peer must hold at the start of the open round, and how they advance."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        model = build_task(cfg).model  # seeded: the same init as `demonet train` and every peer
        self.params = {name: p.detach().clone().requires_grad_(True) for name, p in model.named_parameters()}
        o = cfg.optim
        # Only apply() is used: the coordinator has no gradients. The momentum buffers it allocates
        # are the price of reusing DeMo's exact decode and base step (bit-identical to the peers').
        self.opt = DeMo.from_settings(list(self.params.items()), o)
        self.lr = LrSchedule.from_settings(o, cfg.train.steps)  # round r's lr, as every peer's (`StepOptions`)
        self.specs = self.opt.param_specs()
        self.rules = MergeRules.from_config(cfg)
        self.digest = param_digest(self.params.items())
        self._blob: tuple[int, bytes] | None = None

    def set_params(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Start from these parameters instead of the seeded init (`demonet coordinator --init`): the same names,
        shapes and dtypes as `params` (`demonet.coordinator.weights.read_init` checks a file's)."""
        with torch.no_grad():
            for name, p in self.params.items():
                t = tensors[name]
                assert (t.shape, t.dtype) == (p.shape, p.dtype), f"{name}: copy_ would broadcast or cast"
                p.copy_(t)
        self.digest = param_digest(self.params.items())
        self._blob = None

    def parameters_blob(self, round: int) -> bytes:
        """The serialized `Parameters` at the start of `round` (cached until the next apply)."""
        if self._blob is None or self._blob[0] != round:
            self._blob = (round, wire_params.encode_parameters(self.params.items(), round=round, digest=self.digest))
        return self._blob[1]

    def close(self, outcome: ClosedRound, payloads: list[Payload], samples: list[int] | None = None
              ) -> ClosedAggregate:
        """`merge_round`, then `advance`: the closed round with its digest."""
        closed, applied = self.merge_round(outcome, payloads, samples)
        if applied is None:
            return closed
        return replace(closed, param_digest=self.advance(closed.round, applied))

    def merge_round(self, outcome: ClosedRound, payloads: list[Payload], samples: list[int] | None = None
                    ) -> tuple[ClosedAggregate, Payload | None]:
        """The round as `Rounds.outcome` decided it, as peers download it, and what `advance` applies;
        changes no state. An aborted round applies nothing (None) and keeps the digest; otherwise the
        contributors' payloads are merged (in `outcome.contributors` order), the values rounded as peers
        will decode them, and the aggregate's `param_digest` is empty until `advance` computes it. `samples`: each
        contributor's samples, its weight in the merge (`demonet.wire.merge.sample_weights`)."""
        round, contributors = outcome.round, outcome.contributors
        if outcome.aborted:
            return ClosedAggregate(round, True, contributors, self.digest, b""), None
        merged = merge(payloads, step=round, rules=self.rules, expected=self.specs, samples=samples,
                       value_coding="deflate")  # downloaded by every peer; compared by none byte for byte
        clipped = tuple(p for p, f in zip(contributors, merged.factors, strict=True) if f < 1.0)
        for peer, factor in zip(contributors, merged.factors, strict=True):
            if factor < 0.01:  # far above the others: worth a line in the log
                logger.warning("[coordinator round=%d] %s's payload norm is %.3g times the median: clipped",
                               round, peer, 1 / factor)
        capped = tuple(p for p, c in zip(contributors, merged.capped, strict=False) if c)
        for peer in capped:
            logger.warning("[coordinator round=%d] %s claimed more samples than the cap: its weight is capped",
                           round, peer)
        return (ClosedAggregate(round, False, contributors, "", merged.data, clipped, capped, merged.weights),
                merged.payload)

    def advance(self, round: int, applied: Payload) -> str:
        """Apply round `round`'s merged aggregate (`merge_round`'s payload) to the parameters, with that
        round's learning rate; returns the new canonical digest."""
        self.opt.apply(applied, lr=self.lr(round))
        self.digest = param_digest(self.params.items())
        self._blob = None
        return self.digest

    def snapshot(self) -> dict[str, Any]:
        """The state file's body as of now, its tensors cloned: the next round's apply changes the live
        parameters (and the optimizer's buffers) in place, while a snapshot waits for its write. The
        caller adds the rounds' state, the last aggregate and the counters of the same closed round.
        One copy of the parameters: far cheaper than the apply before it and than the write."""
        body: dict[str, Any] = {"config": self.cfg.to_dict(),
                                "params": {n: p.detach().clone() for n, p in self.params.items()},
                                "digest": self.digest}
        if self.cfg.optim.base == "adamw":
            body["optimizer"] = _cloned(self.opt.state_dict())
        return body

    def save(self, state_dir: Path, extra: dict[str, Any]) -> None:
        """Write the state now (`snapshot` plus `extra`), atomically: see `write_state`."""
        write_state(state_dir, {**self.snapshot(), **extra})

    def load(self, state_dir: Path) -> dict[str, Any] | None:
        """Restore saved parameters; returns the saved extras, or None if there is no state file.

        Raises:
            ValueError: the saved run has another configuration, or the file is damaged.
        """
        path = state_dir / STATE_FILE
        if not path.exists():
            return None
        body = torch.load(path, map_location="cpu", weights_only=False)
        if body.get("config") != self.cfg.to_dict():
            raise ValueError(f"{path} belongs to a run with another configuration; use another --state-dir")
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(body["params"][name])
        if "optimizer" in body:
            self.opt.load_state_dict(body["optimizer"])
        self.digest = param_digest(self.params.items())
        saved = body["digest"]
        if self.digest != saved:
            if saved != legacy_param_digest(self.params.items()):
                raise ValueError(f"{path}: parameters do not match their digest")
            # Saved by protocol version 1: its digests hashed Python's text. The last round's aggregate carries
            # the state's digest: it is the new one now (older rounds' send a peer that asks to resync).
            logger.info("[coordinator] %s was saved by protocol version 1: its digest %s is %s now", path,
                        saved[:12], self.digest[:12])
            body["aggregates"] = [replace(a, param_digest=self.digest) if a.param_digest == saved else a
                                  for a in body.get("aggregates", [])]
        self._blob = None
        logger.info("[coordinator] resumed from %s", path)
        return dict(body)


def write_state(state_dir: Path, body: dict[str, Any]) -> None:
    """Write a state file's body atomically (a temp file renamed over the old one): kill -9 at any moment
    leaves the old file or the new one, never a mix.

    Raises:
        OSError, RuntimeError: the file could not be written (torch.save's zip writer raises RuntimeError
            for a full disk); the old file is still there.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / (STATE_FILE + ".tmp")
    torch.save(body, tmp)
    os.replace(tmp, state_dir / STATE_FILE)


def _cloned(obj: Any) -> Any:
    """`obj` with every tensor in it (in dicts, lists and tuples) cloned."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cloned(v) for v in obj)
    return obj
