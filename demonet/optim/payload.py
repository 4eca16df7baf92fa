"""Plain dataclasses for DeMo's sparse payloads and the value encodings they go through.

Math layer: imports torch only. Protobuf conversion lives in `demonet.wire`, never here.

Shape legend: C = chunks of one tensor, K = coefficients kept per chunk.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["ENCODINGS", "Compressed", "Expected", "Payload", "matrix_shape", "num_chunks", "quantize", "quantize_rows",
           "to_host"]

Expected = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
"""A model's parameters as name -> (shape, dtype), in order: what a parameter download must fit."""

ENCODINGS = ("fp32", "bf16", "fp16", "int8", "sign")
"""Value encodings. Each one is applied by the sender before error feedback, so what the sender
subtracts from its momentum is exactly what receivers decode:

- ``fp32``: values as they are (the reference).
- ``bf16``: values rounded to bfloat16 (8-bit mantissa, fp32's range).
- ``fp16``: values scaled by one power of two per tensor (exact) and rounded to float16, so the
  small magnitudes of a momentum with the learning rate folded in do not underflow.
- ``int8``: per-chunk scale ``bf16(max|v| / 127)``, values rounded to integers in [-127, 127].
- ``sign``: 1 bit per value, ``sign(v) * bf16(mean|v|)`` per chunk (error-feedback signSGD,
  Karimireddy et al. 2019). The quantization residual stays in the momentum.
"""

_FP16_TARGET_EXP = 14  # the largest |value| maps into [2^13, 2^14): far from fp16's max of 65504


@dataclass(frozen=True, slots=True, eq=False)
class Compressed:
    """One tensor's kept DCT coefficients.

    Attributes:
        idx: (C, K) int64. Index of a coefficient inside its chunk, row-major over the chunk's
            (h, w) frequencies: ``i * w + j``. Unique within a row. Rows are chunks in row-major
            order over the (padded) grid of chunks.
        val: (C, K) float. The coefficient values, after the value encoding's round trip. In an
            aggregate, a row may hold padding entries whose value is exactly 0.
        shape: the parameter's shape.
        chunk: (h, w), the chunk shape. A 1-D or 0-D parameter has h == 1.
        scale: the encoding's scale, exactly as it travels: (C, 1) for ``int8`` and ``sign``, a
            0-d power of two for ``fp16``; None for the others.
    """

    idx: torch.Tensor
    val: torch.Tensor
    shape: tuple[int, ...]
    chunk: tuple[int, int]
    scale: torch.Tensor | None = None

    @property
    def totalk(self) -> int:
        """Coefficients per chunk (h * w)."""
        return self.chunk[0] * self.chunk[1]

    @property
    def k(self) -> int:
        """Entries per chunk."""
        return int(self.idx.shape[-1])


@dataclass(frozen=True, slots=True, eq=False)
class Payload:
    """What one peer sends for one step, or the merged aggregate of a round.

    Attributes:
        tensors: one `Compressed` per parameter, keyed by parameter name, in the optimizer's order.
        encoding: the value encoding `val` went through (one of `ENCODINGS`).
    """

    tensors: Mapping[str, Compressed]
    encoding: str = "fp32"

    def numel(self) -> int:
        """Number of (index, value) entries."""
        return sum(c.idx.numel() for c in self.tensors.values())

    def topk(self) -> int:
        """Coefficients per chunk sent: the largest tensor's (a smaller chunk sends all it has); 0 when empty."""
        return max((int(c.idx.shape[-1]) for c in self.tensors.values()), default=0)


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
"""One side stream per CUDA device for `to_host`'s copies."""


def to_host(payload: Payload) -> tuple[Payload, torch.cuda.Event | None]:
    """A copy of a payload in pinned host memory, for the exchange to encode while training goes on.

    On a CUDA device the copies run on a side stream that first waits for the work queued so far
    (the compress that made the payload), and they do not wait for work queued after them: the next
    round's forward and backward. Returns (the host payload, the event to wait for before reading it).
    Encoding the device payload instead would copy on the device's default stream, behind every
    kernel queued since, and the exchange would wait for the next round's compute. A payload already
    on the CPU is returned as it is, with no event.

    Call it on the thread that queued the compress, and keep the device payload until the event has
    completed (the round in flight holds it, to settle or restore it).
    """
    tensors = [t for c in payload.tensors.values() for t in (c.idx, c.val, c.scale) if t is not None]
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    if not devices:
        return payload, None
    if len(devices) > 1:
        raise ValueError(f"a payload should be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(device))

    # One pinned buffer and one copy per dtype (the indices, the values), not one per tensor: a payload
    # has a few tensors per parameter, and each copy is a launch on the training thread.
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    views: dict[int, torch.Tensor] = {}
    with torch.cuda.stream(stream):
        for dtype, group in by_dtype.items():
            flat = torch.cat([t.reshape(-1).to(device) for t in group])  # made on the side stream, freed there
            buffer = torch.empty(flat.numel(), dtype=dtype, device="cpu", pin_memory=True)
            buffer.copy_(flat, non_blocking=True)
            for t, view in zip(group, buffer.split([t.numel() for t in group]), strict=True):  # type: ignore[no-untyped-call]
                views[id(t)] = view.view(t.shape)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(stream)
    copied = {name: Compressed(idx=views[id(c.idx)], val=views[id(c.val)], shape=c.shape, chunk=c.chunk,
                               scale=None if c.scale is None else views[id(c.scale)])
              for name, c in payload.tensors.items()}
    return Payload(copied, encoding=payload.encoding), ready


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view DeMo chunks: (n,) -> (1, n), () -> (1, 1), (a, b, ...) -> (a, b * ...)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def num_chunks(shape: tuple[int, ...], chunk: tuple[int, int]) -> int:
    """Chunks of a tensor: Y * X over its 2-D view, a ragged edge padded to a whole chunk."""
    rows, cols = matrix_shape(shape)
    return -(-rows // chunk[0]) * -(-cols // chunk[1])


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def quantize(val_CK: torch.Tensor, encoding: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Round values through an encoding.

    Args:
        val_CK: (C, K) values.
        encoding: one of `ENCODINGS`.

    Returns:
        (values as receivers will decode them, same dtype as `val_CK`; the scale that travels, or
        None). With the scale the wire is exact: ``val / scale`` is an integer in [-127, 127] for
        ``int8``, +-1 for ``sign``; ``val / scale`` is a float16 for ``fp16``.
    """
    if encoding == "fp32":
        return val_CK, None
    if encoding == "bf16":
        return _round_bf16(val_CK), None
    if encoding == "fp16":
        amax = float(val_CK.abs().max()) if val_CK.numel() else 0.0
        if amax == 0.0 or not math.isfinite(amax):
            exp = 0
        else:
            # amax / 2^exp in [2^13, 2^14); the bound keeps 2^-exp finite in fp32 for tiny values
            # (below ~1e-34 they then round to fp16 zeros, which is what they are worth).
            exp = max(math.frexp(amax)[1] - _FP16_TARGET_EXP, -126)
        scale = torch.tensor(math.ldexp(1.0, exp), dtype=torch.float32)
        deq = (val_CK * math.ldexp(1.0, -exp)).to(torch.float16).to(val_CK.dtype) * math.ldexp(1.0, exp)
        return deq, scale
    if encoding == "int8":
        scale_C1 = _round_bf16(val_CK.abs().amax(dim=-1, keepdim=True).float() / 127.0)
        safe_C1 = torch.where(scale_C1 > 0, scale_C1, torch.ones_like(scale_C1))
        q_CK = torch.round(val_CK.float() / safe_C1).clamp_(-127, 127)
        return (q_CK * scale_C1).to(val_CK.dtype), scale_C1
    if encoding == "sign":
        scale_C1 = _round_bf16(val_CK.abs().mean(dim=-1, keepdim=True).float())
        sign_CK = torch.where(val_CK < 0, -1.0, 1.0)
        return (sign_CK * scale_C1).to(val_CK.dtype), scale_C1
    raise ValueError(f"encoding should be one of {ENCODINGS}, got {encoding!r}")


def quantize_rows(val_BK: torch.Tensor, encoding: str, slot_B: torch.Tensor,
                  num_slots: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`quantize` of every tensor of a bucket at once: the same values and scales, in a fixed number of ops.

    Args:
        val_BK: (B, K) values of the bucket's chunks, tensor after tensor.
        encoding: one of `ENCODINGS`.
        slot_B: (B,) int64, the tensor (0 .. num_slots - 1) each row belongs to (``fp16`` only: its scale
            is one per tensor).
        num_slots: the tensors in the bucket.

    Returns:
        (the values; the scales: (B, 1) for ``int8`` and ``sign``, a tensor's rows slice it; (num_slots,)
        for ``fp16``, a tensor's scale is its entry; None for the others).
    """
    if encoding != "fp16":
        return quantize(val_BK, encoding)  # per-chunk scales or none: a bucket's rows quantize as its tensors'
    amax_S = val_BK.new_zeros(num_slots).scatter_reduce_(0, slot_B, val_BK.abs().amax(dim=1), "amax")
    _, e_S = torch.frexp(amax_S)
    # as `quantize`: amax / 2^exp in [2^13, 2^14), at least 2^-126, and 1 where amax is 0 or not finite
    exp_S = torch.where((amax_S == 0) | ~amax_S.isfinite(), 0, (e_S - _FP16_TARGET_EXP).clamp_(min=-126))
    scale_S = _pow2_float32(exp_S)
    exp_B1 = exp_S[slot_B].unsqueeze(1)
    deq_BK = (val_BK * _pow2_float32(-exp_B1).to(val_BK.dtype)).to(torch.float16).to(val_BK.dtype)
    return deq_BK.mul_(_pow2_float32(exp_B1).to(val_BK.dtype)), scale_S


def _pow2_float32(exp: torch.Tensor) -> torch.Tensor:
    """2.0 ** exp in float32 from its bits, exactly, for integer exponents in [-126, 127]."""
    return ((exp.to(torch.int32) + 127) << 23).view(torch.float32)
