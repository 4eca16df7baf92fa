"""What `demonet.wire` shares between encoding, decoding and byte accounting: the protobuf enum maps, the
byte layout one tensor's message must have, and the grouping of tensors into codec batches.

Imports the generated protobuf module, numpy, torch and the codec modules; never grpc or a transport.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from demonet._proto import demonet_pb2 as pb
from demonet.optim.payload import ENCODINGS
from demonet.optim.payload import num_chunks as chunk_count

from ._bits import num_bytes
from ._indices import index_row_bits
from ._values import value_sizes

DIGEST_BYTES = 32
"""SHA-256: a payload's trailer, a part's payload digest."""
# Protobuf enum values are typed Any here: the generated stubs give each enum its own int subclass.
ENCODING_TO_PB: dict[str, Any] = {e: pb.ValueEncoding.Value(f"VALUE_ENCODING_{e.upper()}") for e in ENCODINGS}
PB_TO_ENCODING: dict[int, str] = {v: k for k, v in ENCODING_TO_PB.items()}
PACKED: Any = pb.INDEX_CODING_PACKED
CODING_NAME: dict[int, str] = {
    PACKED: "packed",
    pb.INDEX_CODING_ELIAS_FANO: "elias_fano",
    pb.INDEX_CODING_BITMAP: "bitmap",
}
CODING_PB: dict[str, Any] = {name: coding for coding, name in CODING_NAME.items()}


@dataclass(frozen=True, slots=True)
class Layout:
    """What one tensor's message must hold, from its metadata alone (no tensor op)."""

    num_chunks: int
    k: int
    n: int
    index_bits: int
    index_bytes: int
    value_bytes: int
    scale_bytes: int


def index_bits(coding: int, num_chunks: int, k: int, n: int) -> int:
    return num_chunks * index_row_bits(CODING_NAME[coding], n, k)


def tensor_layout(coding: int, encoding: str, shape: tuple[int, ...], chunk: tuple[int, int], k: int) -> Layout:
    num_chunks, n = chunk_count(shape, chunk), chunk[0] * chunk[1]
    value_bytes, scale_bytes = value_sizes(encoding, num_chunks, k)
    bits = index_bits(coding, num_chunks, k, n)
    return Layout(num_chunks, k, n, bits, num_bytes(bits), value_bytes, scale_bytes)


def batches(keys: list[tuple[int, ...]]) -> list[list[int]]:
    """Positions grouped by key, in first-seen order: the codecs take each group in one go."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def to_numpy(tensors: list[torch.Tensor], dtype: torch.dtype) -> np.ndarray:
    """The tensors concatenated along dim 0, on the CPU (one copy from a device); may share their memory."""
    with torch.no_grad():
        if len(tensors) > 1:
            same = len({x.device for x in tensors}) == 1
            tensors = [torch.cat(tensors if same else [x.cpu() for x in tensors])]
        return tensors[0].detach().to(device="cpu", dtype=dtype).contiguous().numpy()
