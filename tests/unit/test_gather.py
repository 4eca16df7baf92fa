"""The one all_gather of payloads (`demonet.optim.gather_payloads`): exact in its narrow wire dtypes."""

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from demonet.optim import Compressed, DeMo, Payload, gather_payloads
from demonet.optim.gather import world_size


@pytest.fixture
def world_of_one() -> Iterator[None]:
    assert world_size() == 1  # not initialised: DeMo.step runs without a gather
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _payload(dtypes: list[torch.dtype], encoding: str) -> Payload:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(48, 32, generator=g, dtype=d) * 0.1) for d in dtypes]
    opt = DeMo(params, lr=0.01, compression_topk=8, compression_chunk=16, encoding=encoding)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype) * 1e-3
    return opt.compress()


@pytest.mark.parametrize(("dtypes", "encoding", "wire_bytes_per_entry"), [
    ([torch.float32], "fp32", 2 + 4),
    ([torch.float32], "bf16", 2 + 2),
    ([torch.float64], "fp32", 2 + 8),  # float64 values that float32 cannot hold
    ([torch.float32, torch.float64], "int8", 2 + 8),  # mixed: the widest travels, each comes back as it was
])
def test_round_trip_is_exact(world_of_one: None, dtypes: list[torch.dtype], encoding: str,
                             wire_bytes_per_entry: int) -> None:
    payload = _payload(dtypes, encoding)
    (got,), sent = gather_payloads(payload)
    assert sent == payload.numel() * wire_bytes_per_entry
    assert got.encoding == payload.encoding and list(got.tensors) == list(payload.tensors)
    for name, c in payload.tensors.items():
        r = got.tensors[name]
        assert (r.shape, r.chunk, r.idx.dtype, r.val.dtype) == (c.shape, c.chunk, c.idx.dtype, c.val.dtype)
        assert torch.equal(r.idx, c.idx) and torch.equal(r.val, c.val)


def test_chunks_over_int16_send_int32_indices(world_of_one: None) -> None:
    idx = torch.tensor([[0, 32767, 32768, 39999]])
    c = Compressed(idx=idx, val=torch.tensor([[1.0, -2.0, 3.0, -4.0]]), shape=(200, 200), chunk=(200, 200))
    (got,), sent = gather_payloads(Payload(tensors={"w": c}))
    assert sent == 4 * (4 + 4)
    assert torch.equal(got.tensors["w"].idx, idx) and torch.equal(got.tensors["w"].val, c.val)
