"""FlexDeMo's pure pieces: the chunk plan, and shard payloads joining into the whole parameter's payload."""

from __future__ import annotations

import pytest
import torch

from demonet.flex.shard import chunk_plan, join_shards, local_rows
from demonet.optim import DeMo, Payload, aggregate

SHAPES = {"w": (64, 48), "b": (32,)}
CHUNKS = {"w": (16, 16), "b": (1, 16)}


def test_chunk_plan_keeps_the_whole_parameter_chunks() -> None:
    assert chunk_plan(SHAPES.items(), ranks=2, target=16, policy="pad") == CHUNKS
    assert chunk_plan([("w", (64, 48))], ranks=1, target=64, policy="reference") == {"w": (64, 48)}


@pytest.mark.parametrize("shape", [(64, 48), (96,), (63, 16), ()])
def test_chunk_plan_refuses_shards_that_cut_a_chunk(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="parameter 'x'"):
        chunk_plan([("x", shape)], ranks=4 if shape == (64, 48) else 2, target=32, policy="pad")


def _demo(tensors: dict[str, torch.Tensor]) -> DeMo:
    params = [(n, torch.nn.Parameter(t.clone())) for n, t in tensors.items()]
    return DeMo(params, lr=0.1, compression_topk=5, compression_chunk=16, chunks=CHUNKS)


def _named(opt: DeMo) -> dict[str, torch.Tensor]:
    group = opt.param_groups[0]
    return dict(zip(group["param_names"], group["params"], strict=True))


def _half(t: torch.Tensor, r: int) -> torch.Tensor:
    return t.chunk(2)[r]


def test_shard_payloads_join_into_the_unsharded_payload() -> None:
    """Two shards of whole chunks compress and join into the unsharded payload, and apply exactly as
    the unsharded DeMo does.

    What the design needs, and so what is asserted:
    - The apply must give the same bits on a shard as on the whole parameter, or a FlexDeMo node's
      digest would leave the coordinator's: applying one aggregate is compared with `torch.equal`.
    - `compress` is each node's own business (DESIGN.md): a shard runs its transform as a smaller GEMM,
      which may round differently in the last bit on another CPU, so the joined payload is compared to
      float tolerance. Its indices must match: the inputs are Gaussian, whose top-k choices have no
      near-ties within rounding error.
    """
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    whole = _demo(full)
    shards = [_demo({n: _half(t, r) for n, t in full.items()}) for r in range(2)]
    for _ in range(3):  # the momentum carries over: error feedback must agree too
        grads = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
        for name, p in _named(whole).items():
            p.grad = grads[name].clone()
        for r, opt in enumerate(shards):
            for name, p in _named(opt).items():
                p.grad = _half(grads[name], r).clone()
        joined = join_shards([s.compress() for s in shards], SHAPES)
        ref = whole.compress()
        for name, c in ref.tensors.items():
            j = joined.tensors[name]
            assert j.shape == c.shape and j.chunk == c.chunk
            order_j, order_c = j.idx.argsort(dim=1), c.idx.argsort(dim=1)
            assert torch.equal(j.idx.gather(1, order_j), c.idx.gather(1, order_c))
            torch.testing.assert_close(j.val.gather(1, order_j), c.val.gather(1, order_c), rtol=1e-5, atol=1e-7)
        agg = aggregate([joined, ref])  # one aggregate, applied by the shards and by the whole
        for r, opt in enumerate(shards):
            opt.apply(Payload({n: local_rows(c, r, 2, tuple(_half(full[n], r).shape))
                               for n, c in agg.tensors.items()}))
        whole.apply(agg)
        for name, want in _named(whole).items():
            got = torch.cat([_named(opt)[name].detach() for opt in shards])
            assert torch.equal(got, want.detach())


def test_join_refuses_fp16_and_local_rows_checks_the_count() -> None:
    p = torch.nn.Parameter(torch.randn(32, 16))
    opt = DeMo([("w", p)], compression_topk=4, compression_chunk=16, encoding="fp16")
    p.grad = torch.randn(32, 16)
    payload = opt.compress()
    with pytest.raises(ValueError, match="fp16"):
        join_shards([payload, payload], {"w": (64, 16)})
    with pytest.raises(ValueError, match="chunks"):
        local_rows(payload.tensors["w"], 0, 3, (16, 16))


def test_demo_chunks_override_is_validated() -> None:
    with pytest.raises(ValueError, match="chunks"):
        DeMo([("w", torch.nn.Parameter(torch.randn(4, 4)))], chunks={"w": (0, 4)})


def test_shard_units_are_the_outermost_module_lists_entries() -> None:
    from demonet.config import ModelConfig
    from demonet.flex.shard import shard_units
    from demonet.train.model import GPT

    gpt = GPT(ModelConfig(d_model=16, n_layers=3, n_heads=2, seq_len=8))
    assert shard_units(gpt) == list(gpt.blocks)
    assert shard_units(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())) == []  # sharded whole
    inner = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    outer = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential()), inner])
    model = torch.nn.Module()
    model.layers, model.more = outer, torch.nn.ModuleList([torch.nn.Linear(3, 3)])
    assert shard_units(model) == [*outer, model.more[0]]  # not the list nested inside `layers`
