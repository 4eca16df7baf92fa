"""The DeMo step launches a fixed number of kernels, whatever the model's depth (docs/optimizer.md).

Counted with `tests.op_count` (views and metadata-only ops excluded) on stacks of identical transformer blocks:
a step that went back to per-tensor work would add an op or more for each of the 8-block stack's 72 extra tensors.
The apply gives the same bits whatever the buckets: a GPU's and a CPU's differ.
"""

from __future__ import annotations

import pytest
import torch

from demonet.optim import Compressed, DeMo, Payload, exact, outcome
from demonet.optim.buckets import ACCELERATOR_BUCKET_CAP_MB, CPU_BUCKET_CAP_MB, default_bucket_cap_mb
from demonet.optim.payload import quantize, quantize_rows
from tests.op_count import stack_model, step_ops

NEAR_OPS = 36
"""The sign base's fast decode re-sums, exactly, the entries its float32 GEMM leaves too near zero: this many ops
in each bucket that has any (data-dependent, at most once a bucket)."""


def _totals(base: str, encoding: str, cap_mb: float | None = ACCELERATOR_BUCKET_CAP_MB) -> list[tuple[int, int]]:
    """(compress ops, apply ops) of a 2-block and an 8-block stack (`cap_mb` None: the CPU's default buckets)."""
    totals = []
    for blocks in (2, 8):
        compress, apply = step_ops(stack_model(blocks, d_model=32), base=base, encoding=encoding,
                                   bucket_cap_mb=cap_mb)
        totals.append((compress.total(), apply.total()))
    return totals


@pytest.mark.parametrize(("base", "encoding"), [("sign", "fp32"), ("sgd", "int8"), ("adamw", "fp16"),
                                                ("sign", "sign"), ("sgd", "bf16")])
def test_the_step_launches_as_many_kernels_for_8_blocks_as_for_2(base: str, encoding: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # The sign base on its exact decode (where float32 GEMMs are not IEEE): no data-dependent branch.
    monkeypatch.setattr(outcome, "fast_float32_gemm", lambda device: False)
    (c2, a2), (c8, a8) = _totals(base, encoding)
    assert c2 > 0 and a2 > 0
    assert (c8, a8) == (c2, a2)


@pytest.mark.parametrize(("base", "encoding"), [("sign", "fp32"), ("adamw", "fp16")])
def test_a_cpu_step_launches_a_set_of_kernels_a_bucket_not_a_tensor(base: str, encoding: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU's own buckets (4 MiB) hold either stack in one bucket a chunk shape: the 72 more tensors add no op.
    monkeypatch.setattr(outcome, "fast_float32_gemm", lambda device: False)
    (c2, a2), (c8, a8) = _totals(base, encoding, cap_mb=None)
    num_buckets = [len(DeMo(stack_model(n, d_model=32).parameters())._buckets) for n in (2, 8)]
    assert num_buckets[0] == num_buckets[1]
    assert (c8, a8) == (c2, a2)


def test_the_sign_bases_fast_decode_adds_at_most_a_re_sum_a_bucket() -> None:
    (c2, a2), (c8, a8) = _totals("sign", "fp32")
    num_buckets = len(DeMo(stack_model(8, d_model=32).parameters(), bucket_cap_mb=ACCELERATOR_BUCKET_CAP_MB)._buckets)
    assert c8 == c2
    assert abs(a8 - a2) <= NEAR_OPS * num_buckets, (a2, a8, num_buckets)


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


def _apply_in_buckets(bucket_cap_mb: float, base: str) -> tuple[list[torch.Tensor], list[int]]:
    """The parameters after one apply of an aggregate whose tensors have 32 and 2 entries a chunk."""
    torch.manual_seed(0)
    shapes = {"w0": (1024, 1024), "w1": (64, 128), "w2": (64, 64)}  # w0 fills a decode group (4 MiB) alone
    params = [(name, torch.nn.Parameter(torch.randn(shape))) for name, shape in shapes.items()]
    opt = DeMo(params, lr=0.1, base=base, weight_decay=0.1, bucket_cap_mb=bucket_cap_mb)
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for name, p in params:
        k, rows = (32 if name == "w0" else 2), p.numel() // 4096
        idx = torch.stack([torch.randperm(4096, generator=gen)[:k] for _ in range(rows)])
        tensors[name] = Compressed(idx=idx, val=torch.randn(rows, k, generator=gen) * 1e-3, shape=p.shape,
                                   chunk=(64, 64))
    opt.apply(Payload(tensors))
    return [p.detach().clone() for _, p in params], [len(b.slots) for b in opt._buckets]


@pytest.mark.parametrize("base", ["sign", "sgd", "adamw"])
def test_the_apply_gives_the_same_bits_in_buckets_of_any_size(base: str) -> None:
    # A GPU batches its blocks in 128 MiB buckets, a CPU in 4 MiB ones: the same aggregate gives the same bits.
    runs = {cap: _apply_in_buckets(cap, base) for cap in (CPU_BUCKET_CAP_MB, ACCELERATOR_BUCKET_CAP_MB, 0.01)}
    assert [layout for _, layout in runs.values()] == [[1, 2], [3], [1, 1, 1]]
    want, _ = runs[CPU_BUCKET_CAP_MB]
    for got, _ in runs.values():
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_the_exact_square_root_gives_the_same_bits_in_pieces_of_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.rand(5000, generator=torch.Generator().manual_seed(0)) * 1e3
    whole = exact.sqrt_exact(x, torch.empty_like(x), piece=x.numel())
    monkeypatch.setattr(exact, "_SQRT_PIECE", 999)
    assert torch.equal(exact.sqrt_exact(x, torch.empty_like(x)), whole)
