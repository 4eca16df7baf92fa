"""Value encodings of `demonet.wire`: fp32, bf16, fp16, int8 and sign values with their scales, and the
lossless top-plane coding of their bytes.

Imports numpy, torch (bf16 rounding only), zlib and `_bits`; never protobuf.

Shape legend: R = rows (chunks) of a batch, K = entries per row, T = tensors of a batch.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch

from ._bits import Blobs, bad, cut, join, num_bytes, pack, unpack


def value_sizes(encoding: str, num_chunks: int, k: int) -> tuple[int, int]:
    """(value bytes, scale bytes) of one tensor."""
    num = num_chunks * k
    if encoding == "fp32":
        return 4 * num, 0
    if encoding == "bf16":
        return 2 * num, 0
    if encoding == "fp16":
        return 2 * num, 4
    if encoding == "int8":
        return num, 2 * num_chunks
    if encoding == "sign":
        return num_bytes(num), 2 * num_chunks
    raise ValueError(f"unknown encoding {encoding!r}")


VALUE_WIDTH = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes a value of these encodings takes: the ones whose bytes can be split into planes."""
_DEFLATE_LEVEL = 1  # zlib's fastest: levels 3 and 6 took 1.3x and 1.8x the time for 0.4% and 0.9% fewer bytes
_DEFLATE_MIN_VALUES = 512  # fewer gain a few bytes for a zlib call each way (layer norms, biases)


def top_plane_deflate(values: bytes, width: int) -> bytes | None:
    """`values` (little-endian values of `width` bytes) as byte planes, the top one (sign and high exponent
    bits) deflated: proto/demonet.proto, VALUE_CODING_TOP_PLANE_DEFLATE. None where that is not smaller, or
    where there are too few values to be worth it."""
    if len(values) < _DEFLATE_MIN_VALUES * width:
        return None
    planes_WN = np.frombuffer(values, np.uint8).reshape(-1, width).T  # (width, values)
    packer = zlib.compressobj(_DEFLATE_LEVEL, zlib.DEFLATED, -15)  # raw DEFLATE: no header, no checksum
    top = packer.compress(planes_WN[-1].tobytes()) + packer.flush()
    if len(top) >= planes_WN.shape[1]:  # the top plane did not shrink
        return None
    return planes_WN[:-1].tobytes() + top


def top_plane_inflate(coded: bytes, width: int, size: int) -> bytes:
    """The `size` plain bytes of `coded` (`top_plane_deflate`'s output), else ValueError: the lower planes
    must be whole and the top plane's stream must end exactly at `size` / `width` bytes, with nothing after it."""
    num = size // width
    low = num * (width - 1)
    if size % width or len(coded) < low:
        raise ValueError(f"holds {len(coded)} bytes, fewer than the {low} of its lower byte planes")
    unpacker = zlib.decompressobj(-15)
    try:
        top = unpacker.decompress(coded[low:], num + 1)  # never more than one byte past the plane
    except zlib.error as e:
        raise ValueError(f"the top byte plane is not a DEFLATE stream ({e})") from None
    if len(top) != num or not unpacker.eof or unpacker.unused_data or unpacker.unconsumed_tail:
        raise ValueError(f"the top byte plane should inflate to exactly {num} bytes and end there")
    planes_WN = np.empty((width, num), np.uint8)
    planes_WN[:-1] = np.frombuffer(coded, np.uint8, count=low).reshape(width - 1, num)
    planes_WN[-1] = np.frombuffer(top, np.uint8)
    return planes_WN.T.tobytes()  # (values, width): the values' bytes in order


def _bf16_codes(x: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 codes of float32 values, rounded to nearest even as torch rounds."""
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _bf16_values(codes: np.ndarray) -> np.ndarray:
    return (codes.astype(np.uint32) << 16).view(np.float32)  # exact


def _dequantize(codes_RK: np.ndarray, scale_R: np.ndarray | None, encoding: str) -> np.ndarray:
    """What receivers compute from the codes; encode checks its values against it, bit for bit."""
    if encoding == "fp32":
        return codes_RK
    if encoding == "bf16":
        return _bf16_values(codes_RK)
    assert scale_R is not None
    scale_R1 = scale_R.reshape(-1, 1)
    if encoding == "fp16":  # exact float16 -> float32, then times the power of two
        val_RK: np.ndarray = codes_RK.astype(np.float32) * scale_R1
    elif encoding == "int8":  # -128 carries -0.0
        val_RK = np.where(codes_RK == -128, np.float32(-0.0), codes_RK.astype(np.float32) * scale_R1)
    else:  # sign bits
        val_RK = np.where(codes_RK.astype(bool), np.float32(-1.0), np.float32(1.0)) * scale_R1
    return val_RK


def check_scales(scale: np.ndarray, encoding: str, rows: Sequence[int]) -> None:
    """fp16: (T,) finite powers of two, as `quantize` makes them; int8 and sign: (R,) finite and >= 0."""
    if encoding == "fp16":
        bad_T = ~(np.isfinite(scale) & (scale > 0) & (np.frexp(scale)[0] == 0.5))
        if bad_T.any():
            raise bad(bad_T, [1] * len(rows), f"fp16 scale {float(scale[bad_T][0])!r} is not a finite power of two")
    elif not (np.isfinite(scale) & (scale >= 0)).all():
        raise bad(~(np.isfinite(scale) & (scale >= 0)), rows, f"{encoding} scales should be finite and >= 0")


def check_finite(val_RK: np.ndarray, rows: Sequence[int], message: str) -> None:
    if not np.isfinite(val_RK).all():
        raise bad(~np.isfinite(val_RK), rows, message)


@np.errstate(all="ignore")  # off-grid values overflow fp16 codes: the bit check catches them
def encode_values(
    val_RK: np.ndarray, scale: np.ndarray | None, encoding: str, rows: Sequence[int]
) -> tuple[list[bytes], list[bytes]]:
    """(value blobs, scale blobs) of a batch whose values went through `quantize`, else BadTensor.

    `scale` is what `quantize` returned, float32: (T,) for fp16, (R,) for int8 and sign.
    """
    k, codes_RK, scales, scale_R = val_RK.shape[1], val_RK, [b""] * len(rows), None
    if encoding == "bf16":
        codes_RK = (val_RK.view(np.uint32) >> 16).astype(np.uint16)  # exact for values on the grid
    elif encoding == "fp16":
        assert scale is not None
        scales, scale_R = cut(scale.tobytes(), [4] * len(rows)), np.repeat(scale, rows)
        codes_RK = (val_RK / scale_R.reshape(-1, 1)).astype(np.float16)
    elif encoding in ("int8", "sign"):
        assert scale is not None
        bf16_R = _bf16_codes(scale)
        scales, scale_R = cut(bf16_R.tobytes(), [2 * r for r in rows]), _bf16_values(bf16_R)
        if encoding == "int8":
            safe_R1 = np.where(scale_R > 0, scale_R, np.float32(1.0)).reshape(-1, 1)
            q_RK = np.clip(np.round(val_RK / safe_R1), -127, 127)
            q_RK[(val_RK == 0) & np.signbit(val_RK)] = -128  # -128 carries -0.0
            codes_RK = q_RK.astype(np.int8)
        else:
            codes_RK = np.signbit(val_RK).astype(np.uint8)
    if encoding != "fp32":  # error feedback is exact only if receivers decode the very bits the sender subtracted
        off_RK = _dequantize(codes_RK, scale_R, encoding).view(np.int32) != val_RK.view(np.int32)
        if off_RK.any():
            raise bad(off_RK, rows, f"val is not on the {encoding} grid; pass what quantize() returned")
    if encoding == "sign":
        return pack(codes_RK, rows), scales
    return cut(codes_RK.tobytes(), [r * k * codes_RK.itemsize for r in rows]), scales


@np.errstate(all="ignore")  # a hostile fp16 scale overflows to inf: the finite check catches it
def decode_values(
    values: Blobs, scales: Blobs, encoding: str, rows: Sequence[int], k: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """((R, K) float32 values, the scales: (T,) for fp16, (R,) for int8 and sign, else None).

    Byte lengths and padding bits were checked by the caller; scales and values are checked here.
    """
    num_rows = sum(rows)
    scale = scale_R = None
    if encoding in ("fp16", "int8", "sign"):
        scale = scale_R = join(scales, "<f4") if encoding == "fp16" else _bf16_values(join(scales, "<u2"))
        check_scales(scale, encoding, rows)
        if encoding == "fp16":
            scale_R = np.repeat(scale, rows)
    if encoding == "sign":
        codes_RK = unpack(values, rows, k)
    else:
        dtype = {"fp32": "<f4", "bf16": "<u2", "fp16": "<f2", "int8": "i1"}[encoding]
        codes_RK = join(values, dtype).reshape(num_rows, k)
    val_RK = _dequantize(codes_RK, scale_R, encoding)
    check_finite(val_RK, rows, "values are not all finite")
    return val_RK, scale

