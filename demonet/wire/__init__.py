"""The wire format: what travels between peers, and the one place that converts it to and from protobuf.

Wire layer: imports the math layer's dataclasses and the generated protobuf module; never grpc,
asyncio or a transport. This module only re-exports:

- `codec`: `Payload` -> protobuf bytes (`encode`, `encode_many`); `inbound`: bytes -> `Payload` (`decode`, which
  validates inbound bytes first).
- `parts`: a serialized message as `PayloadPart` messages (`split`, `Reassembler`).
- `report`: byte accounting (`payload_bytes`, `index_bits_report`).
- `params` (imported on its own): the dense parameters a joining peer downloads.

The codecs behind `codec`: `_batch` (a batch of tensors at a time), `_indices` (index codings),
`_values` (value encodings and codings), `_bits` (bit plumbing) and `_layout` (enum maps, byte layout).
"""

from .codec import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRIES,
    INDEX_CODINGS,
    INLINE_DECODE_BYTES,
    INLINE_ENCODE_ENTRIES,
    MAX_CHUNK_ELEMS,
    MAX_DIMS,
    MAX_NAME_BYTES,
    MAX_TENSORS,
    VALUE_CODINGS,
    VERSION,
    Expected,
    encode,
    encode_many,
)
from .inbound import decode
from .parts import DEFAULT_PART_BYTES, MAX_PARTS, Reassembler, split
from .report import index_bits_report, payload_bytes

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_PART_BYTES",
    "INDEX_CODINGS",
    "INLINE_DECODE_BYTES",
    "INLINE_ENCODE_ENTRIES",
    "MAX_CHUNK_ELEMS",
    "MAX_DIMS",
    "MAX_NAME_BYTES",
    "MAX_PARTS",
    "MAX_TENSORS",
    "VALUE_CODINGS",
    "VERSION",
    "Expected",
    "Reassembler",
    "decode",
    "encode",
    "encode_many",
    "index_bits_report",
    "payload_bytes",
    "split",
]
