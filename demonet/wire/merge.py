"""The one merge of a round's payloads, as the coordinator and every DHT slice owner do it.

Wire layer: the math's `aggregate_clipped`, the values rounded through the aggregate's encoding,
encoded as peers download it, and the same values as the others will decode them, so that the
merger applies exactly what they do (without decoding its own bytes). Both modes defend against
poisoned but well-formed updates the same way: a payload (or a slice's part of one) above
`MergeRules.max_norm` is refused when it is decoded, and each one above the round's median norm is
scaled down to it before the merge.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from demonet import wire
from demonet.errors import InvalidPayload
from demonet.optim import Compressed, Payload, aggregate_clipped, quantize

from ._indices import sort_rows

__all__ = ["INLINE_MERGE_ENTRIES", "MergeRules", "Merged", "check_samples", "decode_contribution", "merge",
           "sample_weights"]

INLINE_MERGE_ENTRIES = 1 << 14
"""A DHT slice's merge of up to this many entries in all, its parts decoded as they arrived, is made on the
event loop that awaits it (about 3 ms of one core at 10k entries of the embedded default model, most of it
a cost per tensor). At the end of a round every owner and verifier merges at once: for a 4-peer round's
slices (10k entries) a trip to a worker thread cost more than the merge, waiting for the cores and the GIL;
for an 8-peer round's (20k entries, 8 parts) the thread did as well or better
(docs/benchmarks.md#merges-on-the-event-loop)."""

_UNSCALED = ("fp32", "bf16")  # encodings whose rounding is elementwise, without a scale: rounded a block at a time


@dataclass(frozen=True)
class MergeRules:
    """How a round's payloads become its aggregate (the `[net]` settings of the run)."""

    topk: int
    """Merged coefficients kept per chunk (the largest means): the aggregate does not grow with the peers."""
    encoding: str = "bf16"
    """Value encoding of the merged payload."""
    clip: bool = True
    """Scale every payload whose norm exceeds the round's median norm down to it."""
    max_norm: float | None = 1e6
    """Refuse an inbound payload whose values' L2 norm exceeds this (None: no bound)."""
    max_sample_ratio: float = 16.0
    """Weight each payload by its samples, at most this many times the median of the others' (0: unweighted)."""
    max_samples: int = 1 << 32
    """A payload claiming more samples than this is refused (`check_samples`; `[net] max_samples_per_round`)."""

    def __post_init__(self) -> None:
        if self.topk < 1:
            raise ValueError(f"topk should be >= 1, got {self.topk}")
        if self.encoding not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"encoding should be fp32, bf16 or fp16, got {self.encoding!r}")
        if self.max_norm is not None and not self.max_norm > 0:
            raise ValueError(f"max_norm should be > 0 or None, got {self.max_norm}")
        if not (self.max_sample_ratio == 0 or self.max_sample_ratio >= 1):
            raise ValueError(f"max_sample_ratio should be 0 (off) or >= 1, got {self.max_sample_ratio}")
        if self.max_samples < 1:
            raise ValueError(f"max_samples should be >= 1, got {self.max_samples}")

    @classmethod
    def from_config(cls, cfg: Any) -> MergeRules:
        """The rules of a run config (`demonet.config.Config`)."""
        net = cfg.net
        return cls(topk=net.aggregate_topk or cfg.optim.compression_topk, encoding=net.aggregate_encoding,
                   clip=net.clip_to_median_norm, max_norm=net.max_payload_norm or None,
                   max_sample_ratio=net.max_sample_ratio, max_samples=net.max_samples_per_round)


@dataclass(frozen=True)
class Merged:
    """A merged round (or slice), ready to serve."""

    data: bytes
    """The encoded aggregate, as peers download it."""
    payload: Payload
    """What peers decode from `data`: the merger applies exactly this."""
    factors: tuple[float, ...]
    """Each payload's clip factor in (0, 1], in the order given (1.0: not clipped)."""
    weights: tuple[float, ...] = ()
    """Each payload's weight in the merge, in the order given (its samples, capped); () where unweighted."""
    capped: tuple[bool, ...] = ()
    """Whether each payload's samples were above its cap (`sample_weights`)."""


def sample_weights(samples: Sequence[int], max_ratio: float) -> tuple[list[float], list[bool]]:
    """Each payload's weight in the merge: its sample count, at most `max_ratio` times the median of the other
    payloads' counts (the lower middle of an even count). A payload alone is not capped. Returns the weights
    and, for each, whether it was capped. The same rule for the coordinator and every DHT slice owner.

    A peer that trained 4 micro-batches weighs 4 times one that trained 1; a peer that claims 10^9 samples
    weighs `max_ratio` times the median of the others, and no more.
    """
    counts = list(samples)
    weights, capped = [], []
    for i, n in enumerate(counts):
        others = sorted(counts[:i] + counts[i + 1:])
        cap = max_ratio * others[(len(others) - 1) // 2] if others else float(n)
        weights.append(float(min(n, cap)))
        capped.append(n > cap)
    return weights, capped


def check_samples(samples: int, most: int) -> None:
    """Refuse a payload's claimed sample count outside [1, `most`] (the run's `max_samples_per_round`): the
    same bound for a coordinator's Submit and a DHT slice owner's part.

    Raises:
        InvalidPayload: the count is 0, negative, or above `most`.
    """
    if not 1 <= samples <= most:
        raise InvalidPayload(f"samples should be between 1 and the run's max_samples_per_round ({most}), "
                             f"got {samples}")


def decode_contribution(data: bytes, *, expected: Mapping[str, Any], rules: MergeRules) -> tuple[int, Payload]:
    """Validate and decode a peer's payload (or its part of a slice) for a merge; raises `InvalidPayload`."""
    return wire.decode(data, expected=expected, max_norm=rules.max_norm)


def merge(payloads: Sequence[Payload], *, step: int, rules: MergeRules, expected: Mapping[str, Any],
          value_coding: str = "plain", samples: Sequence[int] | None = None) -> Merged:
    """Merge validated payloads (same tensors, in `expected`'s order) into the round's aggregate.

    Each coefficient is averaged over the peers that sent it, after median-norm clipping (with
    `rules.clip`); the `rules.topk` largest means per chunk are kept, rounded through
    `rules.encoding`, and encoded with entropy-coded indices and `value_coding`'s values. Deterministic:
    the same payloads in the same order give the same payload on every machine, except that clipping's
    factors come from a float64 sum of squares. With ``plain`` values (the default) they give the same
    bytes too, which is what DHT mode's verifiers compare; ``deflate`` (the coordinator's aggregate, which
    nobody compares byte for byte) depends on the zlib build's choices.

    `samples`: each payload's sample count (`sample_weights` bounds them with `rules.max_sample_ratio`); each
    coefficient is then the samples-weighted mean of the payloads that sent it. None, or a ratio of 0: every
    payload weighs the same.

    `Merged.payload` is not decoded from `Merged.data`, yet it is what `wire.decode(data, expected=...)`
    returns, bit for bit: see `_as_received`.
    """
    weights: list[float] | None = None
    capped: list[bool] = []
    if samples is not None and rules.max_sample_ratio > 0:
        weights, capped = sample_weights(list(samples), rules.max_sample_ratio)
    # Equal weights are the unweighted mean: merged without the products (the common case, peers alike), so
    # the close pays for weights only where they differ, and an equal round has the unweighted bits.
    by = weights if weights is not None and len(set(weights)) > 1 else None
    if rules.encoding in _UNSCALED and len(payloads) > 1:  # rounded a block of tensors at a time, in the merge
        merged, factors = aggregate_clipped(payloads, topk=rules.topk, clip=rules.clip,
                                            rounding=functools.partial(_rounded, encoding=rules.encoding),
                                            weights=by)
        sent = Payload(tensors=merged.tensors, encoding=rules.encoding)
    else:
        merged, factors = aggregate_clipped(payloads, topk=rules.topk, clip=rules.clip, weights=by)
        tensors = {}
        for name, c in merged.tensors.items():
            val, scale = quantize(c.val.float(), rules.encoding)
            tensors[name] = Compressed(idx=c.idx, val=val, shape=c.shape, chunk=c.chunk, scale=scale)
        sent = Payload(tensors=tensors, encoding=rules.encoding)
    data = wire.encode(sent, step=step, index_coding="entropy", value_coding=value_coding)
    return Merged(data=data, payload=_as_received(sent, expected), factors=tuple(factors),
                  weights=tuple(weights or ()), capped=tuple(capped))


def _rounded(val: torch.Tensor, *, encoding: str) -> torch.Tensor:
    """Merged values as `quantize` rounds them through an encoding of `_UNSCALED` (float32)."""
    return quantize(val.float(), encoding)[0]


def _as_received(sent: Payload, expected: Mapping[str, Any]) -> Payload:
    """What a peer decodes from ``wire.encode(sent, index_coding="entropy")``, without decoding it.

    The two agree bit for bit because `wire.encode` (1) sorts each row by index with `_indices.sort_rows`,
    the very function used here, before it codes the indices losslessly; (2) refuses values whose
    decoded bits differ from `val` (`_values.encode_values` compares them, so `val`, which went
    through `quantize`, is what receivers get); (3) sends an fp16 scale as its float32 bits. Decode
    also returns the tensors in `expected`'s order, on the CPU. tests/unit/test_merge.py checks it.
    """
    cs = {name: sent.tensors[name] for name in expected}
    by_k: dict[int, list[str]] = {}  # tensors with the same k are sorted in one go, as encode batches them
    for name, c in cs.items():
        by_k.setdefault(c.k, []).append(name)
    tensors = {}
    for names in by_k.values():
        rows = [int(cs[name].idx.shape[0]) for name in names]
        idx_RK = torch.cat([cs[name].idx for name in names]).detach().to("cpu", torch.int64).numpy()  # (R, K)
        val_RK = torch.cat([cs[name].val for name in names]).detach().to("cpu", torch.float32).numpy()  # (R, K)
        idx_RK, val_RK = sort_rows(idx_RK, val_RK)
        parts = zip(names, torch.split(torch.from_numpy(idx_RK), rows), torch.split(torch.from_numpy(val_RK), rows),
                    strict=True)
        for name, idx_CK, val_CK in parts:
            c = cs[name]
            scale = None if c.scale is None else c.scale.detach().to("cpu", torch.float32)
            tensors[name] = Compressed(idx=idx_CK, val=val_CK, shape=tuple(c.shape), chunk=c.chunk, scale=scale)
    tensors = {name: tensors[name] for name in expected}
    return Payload(tensors=tensors, encoding=sent.encoding)
