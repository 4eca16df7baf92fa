"""The DeMo step launches a fixed number of kernels, whatever the model's depth (docs/optimizer.md).

Counted with `tests.op_count` (views and metadata-only ops excluded) on stacks of identical transformer blocks:
a step that went back to per-tensor work would add an op or more for each of the 8-block stack's 72 extra tensors.
"""

from __future__ import annotations

import pytest
import torch

from demonet.optim import DeMo
from demonet.optim.buckets import ACCELERATOR_BUCKET_CAP_MB, CPU_BUCKET_CAP_MB, default_bucket_cap_mb
from demonet.optim.payload import quantize, quantize_rows
from tests.op_count import stack_model, step_ops

SLACK_OPS = 30
"""What the counts of two depths may differ by: the sign base's decode re-sums, exactly, the entries its float32
GEMM leaves too near zero, a set of about 20 ops in a bucket that has any (data-dependent). Far below the 72 ops
that one per-tensor op would add."""


@pytest.mark.parametrize(("base", "encoding"), [("sign", "fp32"), ("sgd", "int8"), ("adamw", "fp16"),
                                                ("sign", "sign"), ("sgd", "bf16")])
def test_the_step_launches_as_many_kernels_for_8_blocks_as_for_2(base: str, encoding: str) -> None:
    totals = []
    for blocks in (2, 8):
        compress, apply = step_ops(stack_model(blocks, d_model=32), base=base, encoding=encoding,
                                   bucket_cap_mb=ACCELERATOR_BUCKET_CAP_MB)
        totals.append((compress.total(), apply.total()))
    (c2, a2), (c8, a8) = totals
    assert c2 > 0 and a2 > 0
    assert c8 == c2  # compress has no data-dependent branch
    assert abs(a8 - a2) <= SLACK_OPS, totals


def test_an_accelerator_gets_large_buckets_and_a_cpu_small_ones() -> None:
    assert default_bucket_cap_mb(torch.device("cpu")) == CPU_BUCKET_CAP_MB
    assert default_bucket_cap_mb(torch.device("meta")) == ACCELERATOR_BUCKET_CAP_MB
    sizes = {}
    for device in ("cpu", "meta"):  # meta: the buckets of a device that is not the CPU, and no memory
        params = [(f"w{i}", torch.nn.Parameter(torch.empty(1024, 1024, device=device))) for i in range(3)]
        sizes[device] = [b.num_blocks for b in DeMo(params)._buckets]
    assert sizes == {"cpu": [256] * 3, "meta": [768]}  # 4 MiB is one 1024 x 1024 float32 tensor
    with pytest.raises(ValueError, match="bucket_cap_mb should be > 0 or None, got 0"):
        DeMo([torch.nn.Parameter(torch.zeros(4))], bucket_cap_mb=0.0)


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "fp16", "int8", "sign"])
def test_a_bucket_quantizes_to_the_bits_of_its_tensors_quantized_one_by_one(encoding: str) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = [3, 1, 4, 2]
    parts = [torch.randn(n, 5, generator=gen) * 10.0 ** (4 * i - 6) for i, n in enumerate(rows)]
    parts[1].zero_()  # fp16: a tensor of zeros keeps the scale 1
    parts[3][0, 0] = 3e-38  # and a tiny one the smallest scale
    parts[3][1:] = 0.0
    slot_B = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(rows))
    got, scales = quantize_rows(torch.cat(parts), encoding, slot_B, len(rows))
    start = 0
    for i, (n, part) in enumerate(zip(rows, parts, strict=True)):
        want, want_scale = quantize(part, encoding)
        assert torch.equal(got[start:start + n], want)
        if want_scale is None:
            assert scales is None
        else:
            assert scales is not None
            scale = scales[i] if encoding == "fp16" else scales[start:start + n]
            assert torch.equal(scale, want_scale) and scale.dtype == want_scale.dtype
        start += n
