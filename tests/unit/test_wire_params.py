"""Dense parameters on the wire: exact round trip, and every kind of bad message rejected."""

import pytest
import torch

from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload
from demonet.wire.digest import param_digest
from demonet.wire.params import PROTOCOL, decode_parameters, encode_parameters

NAMED = [("w", torch.randn(4, 3)), ("b", torch.randn(3).to(torch.bfloat16)), ("s", torch.tensor(2.5))]
EXPECTED = {n: (tuple(t.shape), t.dtype) for n, t in NAMED}


def test_round_trip_is_exact() -> None:
    round_, got = decode_parameters(encode_parameters(NAMED, round=7), expected=EXPECTED)
    assert round_ == 7
    assert list(got) == ["w", "b", "s"]
    assert param_digest(got.items()) == param_digest(NAMED)


def _tampered(edit: str) -> bytes:
    msg = pb.Parameters()
    msg.ParseFromString(encode_parameters(NAMED, round=1))
    if edit == "version":
        msg.version = 1  # protocol 1: its digest hashed another text
    elif edit == "shape":
        msg.tensors[0].shape[:] = [3, 4]
    elif edit == "dtype":
        msg.tensors[1].dtype = "float32"
    elif edit == "bytes":
        msg.tensors[0].data = msg.tensors[0].data[:-4]
    elif edit == "nan":
        msg.tensors[0].data = torch.full((4, 3), float("nan")).numpy().tobytes()
    elif edit == "value":
        msg.tensors[0].data = torch.zeros(4, 3).numpy().tobytes()  # well-formed, but not what the digest says
    elif edit == "order":
        first = pb.DenseTensor()
        first.CopyFrom(msg.tensors[0])
        del msg.tensors[0]
        msg.tensors.append(first)
    elif edit == "missing":
        del msg.tensors[2]
    return msg.SerializeToString()


@pytest.mark.parametrize("edit", ["version", "shape", "dtype", "bytes", "nan", "value", "order", "missing"])
def test_bad_parameters_are_rejected(edit: str) -> None:
    with pytest.raises(InvalidPayload, match="parameters"):
        decode_parameters(_tampered(edit), expected=EXPECTED)


@pytest.mark.parametrize("version", [0, 1, 2, 4])
def test_parameters_of_another_protocol_version_name_both(version: int) -> None:
    msg = pb.Parameters()
    msg.ParseFromString(encode_parameters(NAMED, round=1))
    assert msg.version == PROTOCOL == 3
    msg.version = version
    with pytest.raises(InvalidPayload, match=f"protocol {version or 1} and this peer protocol {PROTOCOL}"):
        decode_parameters(msg.SerializeToString(), expected=EXPECTED)


def test_garbage_is_rejected() -> None:
    g = torch.Generator().manual_seed(0)
    good = encode_parameters(NAMED, round=1)
    for _ in range(300):
        data = bytearray(good)
        for _ in range(3):
            data[int(torch.randint(len(data), (1,), generator=g))] ^= 1 << int(torch.randint(8, (1,), generator=g))
        try:
            _, got = decode_parameters(bytes(data), expected=EXPECTED)
        except InvalidPayload:
            continue
        assert param_digest(got.items()) == param_digest(NAMED)  # a flip in a field nobody reads
