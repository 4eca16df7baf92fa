"""A digest of named tensors, to check that peers hold bit-identical parameters.

Imports torch and hashlib only; the layers above compare digests, they never compute them otherwise. The bytes
hashed are the protocol's (docs/protocol.md, "The parameter digest"): nothing a language prints goes into them.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Iterable

import torch

__all__ = ["dtype_name", "legacy_param_digest", "param_digest", "tensor_header"]

assert sys.byteorder == "little", "tensors are hashed and sent as their raw bytes: little-endian hosts only"


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor on the host, contiguous (CUDA tensors are copied first)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


def dtype_name(dtype: torch.dtype) -> str:
    """The wire's name of a dtype: torch's without "torch." ("float32", "bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


def tensor_header(name: str, dtype: str, shape: tuple[int, ...], num_bytes: int) -> bytes:
    """What the digest hashes before a tensor's data: its name (UTF-8) and dtype name (ASCII), each after its
    length as a 4-byte little-endian integer; the number of dimensions (4 bytes) and each one (8 bytes); the
    number of data bytes (8 bytes). All integers little-endian and unsigned."""
    name_b, dtype_b = name.encode(), dtype.encode("ascii")
    return b"".join([struct.pack("<I", len(name_b)), name_b, struct.pack("<I", len(dtype_b)), dtype_b,
                     struct.pack(f"<I{len(shape)}Q", len(shape), *shape), struct.pack("<Q", num_bytes)])


def param_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 (first 128 bits) over each tensor's `tensor_header` and raw little-endian bytes, in the given order.

    Two sets of tensors have the same digest only if they hold the same bits (-0.0 and 0.0 differ,
    as do NaNs with different payloads). SHA-256 because CPUs hash it in hardware: 1.75 GB/s here,
    2.5x BLAKE2b. CUDA tensors are copied to the host first.

    Args:
        named_tensors: (name, tensor) pairs, e.g. ``model.named_parameters()``.

    Returns:
        32 lowercase hex digits.
    """
    h = hashlib.sha256()
    for name, tensor in named_tensors:
        t = _raw(tensor)
        # str(): a caller's own checks may name tensors by position (`enumerate(params)`); on the wire names are text
        h.update(tensor_header(str(name), dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size()))
        if t.numel():
            h.update(t.view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()[:32]


def legacy_param_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The digest of protocol version 1, which hashed Python's text of the dtype and shape: only to check a
    coordinator state saved by that version (its digest is recomputed with `param_digest` on load)."""
    h = hashlib.sha256()
    for name, tensor in named_tensors:
        t = _raw(tensor)
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()[:32]
