"""The wire layer for dense named tensors: the canonical parameters a joining peer downloads.

Part of the wire layer with demonet/wire/codec.py: the only modules that touch protobuf messages of
tensors. Imports the math layer's digest; nothing networked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from google.protobuf.message import DecodeError

from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload

from .digest import dtype_name, param_digest

__all__ = ["MAX_PARAMETER_BYTES", "PROTOCOL", "decode_parameters", "encode_parameters", "protocol_mismatch"]

PROTOCOL = 3
"""The protocol version (docs/protocol.md, "Versions"): `Parameters.version`, and `protocol` in a JoinRequest and
its JoinReply. 3: the submit statement signs `train_s`; 2: the parameter digest hashes length-prefixed canonical
bytes; 1 hashed Python's text of the dtype and shape."""

MAX_PARAMETER_BYTES = 8 * 2**30
"""Largest serialized Parameters message accepted (protobuf itself stops at 2 GiB per message)."""

_DTYPES = {dtype_name(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def encode_parameters(named: Iterable[tuple[str, torch.Tensor]], *, round: int, digest: str | None = None) -> bytes:
    """Serialize named tensors (in order) as a `Parameters` message with their digest.

    `digest`: their `param_digest`, if the caller already has it (it is computed otherwise).
    """
    tensors = [(name, t.detach().to("cpu").contiguous()) for name, t in named]
    msg = pb.Parameters(version=PROTOCOL, round=round, param_digest=digest or param_digest(tensors))
    for name, t in tensors:
        dtype = dtype_name(t.dtype)
        if dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} is not one of {sorted(_DTYPES)}")
        data = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        msg.tensors.add(name=name, shape=list(t.shape), dtype=dtype, data=data)
    return msg.SerializeToString()


def decode_parameters(data: bytes, *, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
                      ) -> tuple[int, dict[str, torch.Tensor]]:
    """Parse and validate a `Parameters` message against the model.

    Args:
        data: the serialized message.
        expected: name -> (shape, dtype) of every parameter, in the model's order.

    Returns:
        (round, tensors by name in the model's order).

    Raises:
        InvalidPayload: anything wrong (size, version, names, shapes, dtypes, byte counts, non-finite
            values, digest); nothing is returned then.
    """
    if len(data) > MAX_PARAMETER_BYTES:
        raise InvalidPayload(f"parameters: {len(data)} bytes is over the cap of {MAX_PARAMETER_BYTES}")
    msg = pb.Parameters()
    try:
        msg.ParseFromString(data)
    except DecodeError as e:
        raise InvalidPayload(f"parameters: not a Parameters message ({e})") from None
    if msg.version != PROTOCOL:
        why = protocol_mismatch(msg.version, sender="their sender", receiver="this peer")
        raise InvalidPayload(f"parameters: {why}")
    names = [t.name for t in msg.tensors]
    if names != list(expected):
        missing = sorted(set(expected) - set(names))[:3]
        extra = sorted(set(names) - set(expected))[:3]
        raise InvalidPayload(f"parameters: tensors do not match the model: {_first_difference(names, list(expected))} "
                             f"(missing {missing}, unknown {extra})")
    out: dict[str, torch.Tensor] = {}
    for t in msg.tensors:
        shape, dtype = expected[t.name]
        if tuple(t.shape) != tuple(shape) or _DTYPES.get(t.dtype) != dtype:
            raise InvalidPayload(f"parameters: {t.name} is {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")
        numel = 1
        for s in shape:
            numel *= s
        if len(t.data) != numel * dtype.itemsize:
            raise InvalidPayload(f"parameters: {t.name} holds {len(t.data)} bytes, expected {numel * dtype.itemsize}")
        tensor = torch.frombuffer(bytearray(t.data), dtype=dtype).reshape(shape) if numel else torch.zeros(shape,
                                                                                                          dtype=dtype)
        if not bool(torch.isfinite(tensor).all()):
            raise InvalidPayload(f"parameters: {t.name} holds NaN or Inf")
        out[t.name] = tensor
    if param_digest(out.items()) != msg.param_digest:
        raise InvalidPayload("parameters: digest does not match the tensors")
    return msg.round, out


def protocol_mismatch(version: int, *, sender: str, receiver: str) -> str:
    """Why a message of protocol `version` is refused, naming both versions (0 on the wire is version 1, which
    had no such field)."""
    return (f"{sender} speaks demonet protocol {version or 1} and {receiver} protocol {PROTOCOL}: run one demonet "
            "version on the coordinator and every peer (docs/protocol.md, Versions)")


def _first_difference(names: list[str], expected: list[str]) -> str:
    """Where two lists of parameter names first differ, in words (the model's side is `expected`)."""
    for i, (got, want) in enumerate(zip(names, expected, strict=False)):
        if got != want:
            return f"parameter {i} is {want!r} in the model, {got!r} in the parameters"
    n = min(len(names), len(expected))
    if len(names) > n:
        return f"the parameters have {len(names) - n} more than the model, from {names[n]!r}"
    return f"the model has {len(expected) - n} more than the parameters, from {expected[n]!r}"
