"""The parameter digest over canonical bytes (docs/protocol.md): written out here by hand with struct and hashlib,
and sensitive to every name, dtype, shape and bit; protocol 1's digest only to check an old state."""

import hashlib
import struct

import pytest
import torch

from demonet.wire.digest import legacy_param_digest, param_digest


def _by_hand(named: list[tuple[str, str, tuple[int, ...], bytes]]) -> str:
    h = hashlib.sha256()
    for name, dtype, shape, data in named:
        h.update(struct.pack("<I", len(name.encode())) + name.encode())
        h.update(struct.pack("<I", len(dtype)) + dtype.encode())
        h.update(struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape))
        h.update(struct.pack("<Q", len(data)) + data)
    return h.hexdigest()[:32]


def test_digest_is_the_documented_bytes() -> None:
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, -0.0, 3.25]])
    b = torch.tensor([1.5, -1.0], dtype=torch.bfloat16)
    s = torch.tensor(7.0, dtype=torch.float64)
    want = _by_hand([("blocks.0.wé", "float32", (2, 3), struct.pack("<6f", 1.0, -2.0, 0.5, 0.0, -0.0, 3.25)),
                     ("b", "bfloat16", (2,), bytes.fromhex("c03f80bf")),
                     ("s", "float64", (), struct.pack("<d", 7.0)),
                     ("empty", "float32", (0, 4), b"")])
    got = param_digest([("blocks.0.wé", w), ("b", b), ("s", s), ("empty", torch.zeros(0, 4))])
    assert got == want
    assert len(got) == 32 and got == got.lower()


def test_digest_differs_for_every_field() -> None:
    w = torch.arange(6, dtype=torch.float32).view(2, 3)
    base = param_digest([("w", w)])
    variants = [[("v", w)], [("w", w.view(3, 2))], [("w", w.view(6))], [("w", w.double())],
                [("w", w.clone().index_put_((torch.tensor(0), torch.tensor(0)), torch.tensor(-0.0)))],
                [("w", w), ("w", w)], []]
    digests = [param_digest(v) for v in variants]
    assert base not in digests and len(set(digests)) == len(digests)
    # A name that runs into the next field cannot be confused with the next tensor's name: both are prefixed.
    assert param_digest([("ab", torch.zeros(1)), ("c", torch.zeros(1))]) != param_digest(
        [("a", torch.zeros(1)), ("bc", torch.zeros(1))])


def test_legacy_digest_is_protocol_1s_text() -> None:
    w = torch.ones(2, 2)
    h = hashlib.sha256(b"w|torch.float32|(2, 2)|" + struct.pack("<4f", 1, 1, 1, 1))
    assert legacy_param_digest([("w", w)]) == h.hexdigest()[:32] != param_digest([("w", w)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_digest_of_a_device_tensor_is_the_hosts() -> None:
    w = torch.randn(5, 7)
    assert param_digest([("w", w.cuda())]) == param_digest([("w", w)])
