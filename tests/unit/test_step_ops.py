"""The DeMo step launches a fixed number of kernels, whatever the model's depth (docs/optimizer.md).

Counted with `tests.op_count` (views and metadata-only ops excluded) on stacks of identical transformer blocks,
with the buckets every device gets by default: a step that went back to per-tensor work would add an op or more
for each of the 8-block stack's 72 extra tensors, one back to small buckets a set of ops per bucket.
The apply gives the same bits whatever the buckets.
"""

from __future__ import annotations

import pytest
import torch

from demonet.optim import Compressed, DeMo, Payload, exact, outcome
from demonet.optim.buckets import BUCKET_CAP_MB
from demonet.optim.payload import quantize, quantize_rows
from tests.op_count import stack_model, step_ops

NEAR_OPS = 36
"""The sign base's fast decode re-sums, exactly, the entries its float32 GEMM leaves too near zero: this many ops
in each bucket that has any (data-dependent, at most once a bucket)."""


def _totals(base: str, encoding: str, d_model: int = 32) -> list[tuple[int, int]]:
    """(compress ops, apply ops) of a 2-block and an 8-block stack, with the default buckets (on the CPU)."""
    totals = []
    for blocks in (2, 8):
        compress, apply = step_ops(stack_model(blocks, d_model=d_model), base=base, encoding=encoding)
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


def test_a_cpu_step_of_24_mib_of_blocks_launches_as_many_kernels_as_one_of_6(monkeypatch: pytest.MonkeyPatch) -> None:
    # d_model 256: 3 MiB of 64 x 64 blocks a transformer block. Buckets of a few MiB (a CPU's before) would
    # give the 8-block stack a set of ops per bucket more than the 2-block one.
    monkeypatch.setattr(outcome, "fast_float32_gemm", lambda device: False)
    (c2, a2), (c8, a8) = _totals("sign", "fp32", d_model=256)
    assert (c8, a8) == (c2, a2)


def test_the_sign_bases_fast_decode_adds_at_most_a_re_sum_a_bucket() -> None:
    (c2, a2), (c8, a8) = _totals("sign", "fp32")
    num_buckets = len(DeMo(stack_model(8, d_model=32).parameters())._buckets)
    assert c8 == c2
    assert abs(a8 - a2) <= NEAR_OPS * num_buckets, (a2, a8, num_buckets)


def test_every_device_gets_the_same_large_buckets() -> None:
    sizes = {}
    for device in ("cpu", "meta"):  # meta: the buckets of a device that is not the CPU, and no memory
        params = [(f"w{i}", torch.nn.Parameter(torch.empty(1024, 1024, device=device))) for i in range(3)]
        sizes[device] = [b.num_blocks for b in DeMo(params)._buckets]
    assert sizes == {"cpu": [768], "meta": [768]}
    big = [torch.nn.Parameter(torch.empty(4096, 4096, device="meta")) for _ in range(3)]  # 64 MiB each
    assert [b.num_blocks for b in DeMo(big)._buckets] == [8192, 4096]  # BUCKET_CAP_MB: 128 MiB
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
    # 4 MiB buckets (a CPU's before), the default's and tiny ones: the same aggregate gives the same bits.
    runs = {cap: _apply_in_buckets(cap, base) for cap in (4.0, BUCKET_CAP_MB, 0.01)}
    assert [layout for _, layout in runs.values()] == [[1, 2], [3], [1, 1, 1]]
    want, _ = runs[4.0]
    for got, _ in runs.values():
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_the_exact_square_root_gives_the_same_bits_in_pieces_of_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.rand(5000, generator=torch.Generator().manual_seed(0)) * 1e3
    whole = exact.sqrt_exact(x, torch.empty_like(x), piece=x.numel())
    monkeypatch.setattr(exact, "_SQRT_PIECE", 999)
    assert torch.equal(exact.sqrt_exact(x, torch.empty_like(x)), whole)
