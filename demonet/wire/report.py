"""Byte accounting of the wire format: a payload's size on the wire, and its index bits against the floor.

Wire layer: imports the codec modules and the math layer's dataclasses; never grpc or a transport.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from demonet.optim.payload import Compressed, Payload

from ._indices import entropy_codings, floor_bits, sort_rows
from ._layout import CODING_PB, PACKED, index_bits, to_numpy
from .codec import encode

__all__ = ["index_bits_report", "payload_bytes"]


def _entropy_coding(c: Compressed) -> Any:
    idx_RK = to_numpy([c.idx], torch.int64)
    sorted_RK, _ = sort_rows(idx_RK, idx_RK)
    return CODING_PB[entropy_codings(sorted_RK, c.totalk, [int(c.idx.shape[0])])[0]]


def payload_bytes(payload: Payload, *, index_coding: str = "packed", step: int = 0) -> int:
    """Bytes on the wire: exactly ``len(encode(payload, step=step, index_coding=index_coding))``."""
    return len(encode(payload, step=step, index_coding=index_coding))


def _over(bits: float, floor: float) -> float:
    return bits / floor if floor > 0 else (math.inf if bits > 0 else 1.0)


def index_bits_report(payload: Payload) -> dict[str, Any]:
    """Index bits of both codings against the floor sum over chunks of log2(C(h*w, k)).

    Returns:
        ``{"num_indices", "floor_bits", "packed_bits", "entropy_bits", "<coding>_bits_per_index",
        "floor_bits_per_index", "<coding>_over_floor", "tensors": {name: the same per tensor}}``.
    """

    def row(num: int, floor: float, packed: int, entropy: int) -> dict[str, Any]:
        per = max(num, 1)
        return {
            "num_indices": num,
            "floor_bits": floor,
            "packed_bits": packed,
            "entropy_bits": entropy,
            "floor_bits_per_index": floor / per,
            "packed_bits_per_index": packed / per,
            "entropy_bits_per_index": entropy / per,
            "packed_over_floor": _over(packed, floor),
            "entropy_over_floor": _over(entropy, floor),
        }

    tensors: dict[str, Any] = {}
    for name, c in payload.tensors.items():
        num_chunks, n, k = c.idx.shape[0], c.totalk, c.k
        coding = _entropy_coding(c)
        tensors[name] = row(
            num_chunks * k,
            num_chunks * floor_bits(n, k),
            index_bits(PACKED, num_chunks, k, n),
            index_bits(coding, num_chunks, k, n),
        )
    keys = ("num_indices", "floor_bits", "packed_bits", "entropy_bits")
    report = row(*(sum(t[key] for t in tensors.values()) for key in keys))
    report["tensors"] = tensors
    return report
