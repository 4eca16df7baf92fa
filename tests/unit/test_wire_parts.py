"""Splitting serialized payloads into PayloadPart messages and reassembling them in any order.

The transports parse and embed the PayloadPart messages; the Reassembler validates each one as parsed.
"""

from __future__ import annotations

import random

import pytest
from google.protobuf.message import DecodeError

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload
from tests.unit.test_wire import small_payload


def _reassemble(parts: list[pb.PayloadPart], **kwargs: int) -> bytes | None:
    assembler = wire.Reassembler(**kwargs)
    whole = None
    for i, part in enumerate(parts):
        whole = assembler.add(part)
        assert (whole is None) == (i < len(parts) - 1)
    return whole


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 4567])
@pytest.mark.parametrize("part_bytes", [1, 7, 1000])
def test_split_and_reassemble_in_any_order(size: int, part_bytes: int) -> None:
    rng = random.Random(size * 31 + part_bytes)
    data = rng.randbytes(size)
    parts = wire.split(data, part_bytes=part_bytes)
    assert len(parts) == max(1, -(-size // part_bytes))
    assert all(isinstance(p, pb.PayloadPart) and len(p.data) <= part_bytes for p in parts)
    for _ in range(3):
        rng.shuffle(parts)
        assert _reassemble(parts) == data


def test_default_part_size_and_a_real_payload() -> None:
    data = wire.encode(small_payload("fp16", seed=0), step=5)
    parts = wire.split(data, part_bytes=64)
    random.Random(0).shuffle(parts)
    whole = _reassemble(parts)
    assert whole is not None and wire.decode(whole)[0] == 5
    big = bytes(5 << 20)
    assert [len(p.data) for p in wire.split(big)] == [2 << 20, 2 << 20, 1 << 20]


def test_duplicate_inconsistent_and_late_parts_are_rejected() -> None:
    parts = wire.split(bytes(range(100)), part_bytes=10)
    other = wire.split(bytes(100), part_bytes=10)
    assembler = wire.Reassembler()
    assembler.add(parts[0])
    with pytest.raises(InvalidPayload, match="twice"):
        assembler.add(parts[0])
    with pytest.raises(InvalidPayload, match="another payload"):
        _feed([parts[1], other[2]])
    done = wire.Reassembler()
    for part in parts:
        done.add(part)
    with pytest.raises(InvalidPayload, match="complete"):
        done.add(parts[3])


def _feed(parts: list[pb.PayloadPart]) -> None:
    assembler = wire.Reassembler()
    for part in parts:
        assembler.add(part)


def _forged(**fields: object) -> pb.PayloadPart:
    base = {"payload_digest": bytes(32), "index": 0, "count": 1, "total_bytes": 4, "data": b"abcd"}
    base.update(fields)
    return pb.PayloadPart(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"payload_digest": b"short"}, "digest"),
        ({"total_bytes": 1 << 40}, "exceeds the cap"),
        ({"count": 0}, "count"),
        ({"count": 5}, "count"),
        ({"index": 1}, "out of range"),
        ({"data": b"abcdef"}, "more than"),
        ({"count": 2, "data": b""}, "empty part"),
        ({}, "digest"),  # all fields consistent, but the bytes do not hash to the digest
    ],
)
def test_forged_parts_are_rejected(fields: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidPayload, match=match):
        _feed([_forged(**fields)])


def test_oversize_parts() -> None:
    with pytest.raises(InvalidPayload, match="exceeds the cap"):
        wire.Reassembler(max_bytes=10).add(wire.split(bytes(100))[0])
    with pytest.raises(InvalidPayload, match="part of 100 bytes exceeds the cap"):  # before the first's totals
        wire.Reassembler(max_bytes=10).add(_forged(data=bytes(100), total_bytes=4))


def test_fuzzed_parts_never_crash_nor_yield_wrong_bytes() -> None:
    """Bit flips in a part as it travels: the transport's parse refuses some, the Reassembler the rest."""
    rng = random.Random(7)
    data = rng.randbytes(300)
    parts = wire.split(data, part_bytes=40)
    parsed = 0
    for _ in range(1000):
        mutated = list(parts)
        rng.shuffle(mutated)
        i = rng.randrange(len(mutated))
        buf = bytearray(mutated[i].SerializeToString())
        for _ in range(rng.randint(1, 3)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        try:
            mutated[i] = pb.PayloadPart.FromString(bytes(buf))
        except DecodeError:
            continue
        parsed += 1
        assembler = wire.Reassembler(max_bytes=1000)
        try:
            for part in mutated:
                whole = assembler.add(part)
                assert whole is None or whole == data
        except InvalidPayload:
            pass
    assert parsed > 500  # most flips still parse: the Reassembler is what refuses them
