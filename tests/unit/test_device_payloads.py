"""Payloads between a GPU and the host.

- `to_host`: an overlapped round's payload reaches host memory without waiting for the next round's work.
- An aggregate decoded from the wire (on the CPU) settles on a GPU replica with the bits of the same
  aggregate on the device.

The CUDA cases run only where a GPU is (CI has none); the CPU case runs everywhere."""

import pytest
import torch

from demonet import wire
from demonet.optim import Compressed, DeMo, Payload, aggregate, to_host

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _replica(device: str, encoding: str = "fp32", seed: int = 0) -> tuple[list[torch.nn.Parameter], DeMo]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(device)) for s in [(96, 128), (64,)]]
    opt = DeMo(params, lr=0.01, compression_topk=8, compression_chunk=32, encoding=encoding, base="adamw")
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.01).to(device)
    return params, opt


def _payload(device: str, encoding: str = "fp32") -> Payload:
    return _replica(device, encoding)[1].compress()


def _on(payload: Payload, device: str) -> Payload:
    return Payload({name: Compressed(c.idx.to(device), c.val.to(device), c.shape, c.chunk,
                                     None if c.scale is None else c.scale.to(device))
                    for name, c in payload.tensors.items()}, payload.encoding)


def test_a_cpu_payload_is_sent_as_it_is() -> None:
    payload = _payload("cpu")
    assert to_host(payload) == (payload, None)


@CUDA
@pytest.mark.parametrize("encoding", ["fp32", "int8", "fp16"])
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


@CUDA
def test_an_aggregate_from_the_wire_settles_on_a_gpu_replica_as_on_the_device() -> None:
    (from_wire, wire_opt), (on_device, device_opt) = _replica("cuda"), _replica("cuda")
    own_w, own_d = wire_opt.compress(), device_opt.compress()
    other = _replica("cuda", seed=1)[1].compress()
    agg = aggregate([own_d, other])
    # the contributor restores what the aggregate dropped, then applies it (`demonet.train.trainer.settle`)
    wire_opt.restore(own_w, kept=_on(agg, "cpu"))
    wire_opt.apply(_on(agg, "cpu"))
    device_opt.restore(own_d, kept=agg)
    device_opt.apply(agg)
    for a, b in zip(from_wire, on_device, strict=True):
        assert a.is_cuda and torch.equal(a, b)
    for a, b in zip(wire_opt.state.values(), device_opt.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("momentum", "exp_avg", "exp_avg_sq"))
