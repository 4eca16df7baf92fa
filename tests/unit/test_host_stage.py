"""`to_host`: an overlapped round's payload reaches host memory without waiting for the next round's work.

The CUDA cases run only where a GPU is (CI has none); the CPU case runs everywhere."""

import pytest
import torch

from demonet import wire
from demonet.optim import DeMo, Payload, to_host

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _payload(device: str, encoding: str = "fp32") -> Payload:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(device)) for s in [(96, 128), (64,)]]
    opt = DeMo(params, lr=0.01, compression_topk=8, compression_chunk=32, encoding=encoding)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.01).to(device)
    return opt.compress()


def test_a_cpu_payload_is_sent_as_it_is() -> None:
    payload = _payload("cpu")
    assert to_host(payload) == (payload, None)


@CUDA
@pytest.mark.parametrize("encoding", ["fp32", "int8"])
def test_the_host_copy_holds_the_payloads_bits_in_pinned_memory(encoding: str) -> None:
    payload = _payload("cuda", encoding)
    host, ready = to_host(payload)
    assert ready is not None
    ready.synchronize()
    for name, c in payload.tensors.items():
        h = host.tensors[name]
        assert h.idx.is_pinned() and h.val.is_pinned() and (h.scale is None) == (c.scale is None)
        assert torch.equal(h.idx, c.idx.cpu()) and torch.equal(h.val, c.val.cpu())
        assert h.scale is None or torch.equal(h.scale, c.scale.cpu())  # type: ignore[union-attr]
    # what the exchange sends from the host copy is the same bytes as from the device payload
    assert wire.encode(host, step=3) == wire.encode(payload, step=3)


@CUDA
def test_the_host_copy_is_ready_while_the_next_rounds_work_still_runs() -> None:
    payload = _payload("cuda")
    host, ready = to_host(payload)
    # the next round's forward and backward, queued behind the copy on the training stream
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(200):
        x = torch.tanh(x @ x)
    assert ready is not None
    ready.synchronize()
    assert not torch.cuda.current_stream().query(), "the copy waited for the work queued after it"
    torch.cuda.current_stream().synchronize()
    for name, c in payload.tensors.items():
        assert torch.equal(host.tensors[name].val, c.val.cpu())
