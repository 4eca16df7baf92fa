"""The committed test vectors (tests/vectors/*.json) against the implementation, and against docs/protocol.md's
rules written out here independently: the statement grammar, the digest's bytes, packed indices and plain values.
A statement, digest or coding that changes fails here until `python -m tests.vectors.generate` is rerun."""

from __future__ import annotations

import hashlib
import importlib
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.wire.digest import param_digest
from tests.vectors import generate

VECTORS = Path(generate.__file__).parent


def _load(name: str) -> dict[str, Any]:
    return dict(json.loads((VECTORS / name).read_text()))


def _value(item: dict[str, Any]) -> Any:
    return bytes.fromhex(item["value"]) if item["type"] == "bytes" else item["value"]


def _field(value: Any) -> bytes:
    """One field as docs/protocol.md writes it: a type tag, a 4-byte little-endian length, the bytes (written out
    here, not imported, so that the page's rule is checked against the code)."""
    if isinstance(value, bool):
        tag, data = b"b", bytes([value])
    elif isinstance(value, int):
        tag, data = b"i", struct.pack("<Q", value)
    elif isinstance(value, float):
        tag, data = b"f", struct.pack("<d", value)
    elif isinstance(value, str):
        tag, data = b"s", value.encode("utf-8")
    else:
        tag, data = b"y", value
    return tag + struct.pack("<I", len(data)) + data


def test_the_committed_vectors_are_what_the_code_gives() -> None:
    assert generate.main(["--check"]) == 0, "run: python -m tests.vectors.generate"


def test_every_statement_kind_has_a_vector() -> None:
    listed = {v["function"] for v in _load("statements.json")["vectors"]}
    found = {f"{fn.__module__}.{name}" for name, fn in generate.statement_functions()}
    assert listed == found and {"join", "heartbeat", "leave", "parameters", "submit"} <= {
        v["kind"] for v in _load("statements.json")["vectors"]}


@pytest.mark.parametrize("vector", _load("statements.json")["vectors"], ids=lambda v: v["kind"])
def test_statement_vector(vector: dict[str, Any]) -> None:
    doc = _load("statements.json")
    inputs = [_value(i) for i in vector["inputs"]]
    # DHT messages are signed over the SHA-256 of their body (docs/protocol.md), not the body itself.
    fields = [hashlib.sha256(v).digest() if i["name"] == "body" else v for i, v in zip(vector["inputs"], inputs,
                                                                                       strict=True)]
    by_grammar = b"demonet/v1\0" + vector["kind"].encode() + b"\0" + b"".join(_field(v) for v in fields)
    assert [bytes.fromhex(f["hex"]) for f in vector["fields"]] == [_field(v)[5:] for v in fields]
    assert by_grammar.hex() == vector["statement_hex"] == doc["domain_hex"] + by_grammar[11:].hex()
    module, name = vector["function"].rsplit(".", 1)
    assert getattr(importlib.import_module(module), name)(*inputs) == by_grammar
    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(doc["test_key"]["seed_hex"]))
    assert key.sign(by_grammar).hex() == vector["signature_hex"]  # Ed25519 is deterministic
    Ed25519PublicKey.from_public_bytes(bytes.fromhex(doc["test_key"]["public_hex"])).verify(
        bytes.fromhex(vector["signature_hex"]), by_grammar)


@pytest.mark.parametrize("vector", _load("parameters.json")["vectors"], ids=lambda v: v["about"])
def test_parameter_digest_vector(vector: dict[str, Any]) -> None:
    h, named = hashlib.sha256(), []
    for t in vector["tensors"]:
        name, dtype, shape, data = t["name"].encode(), t["dtype"].encode(), t["shape"], bytes.fromhex(t["data_hex"])
        header = (struct.pack("<I", len(name)) + name + struct.pack("<I", len(dtype)) + dtype
                  + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
                  + struct.pack("<Q", len(data)))
        assert header.hex() == t["header_hex"]
        h.update(header + data)
        tensor = torch.frombuffer(bytearray(data), dtype=getattr(torch, t["dtype"])) if data else torch.zeros(0)
        named.append((t["name"], tensor.reshape(shape)))
    assert h.hexdigest()[:32] == vector["param_digest"] == param_digest(named)


def _packed(data: bytes, count: int, bits: int) -> list[int]:
    """`count` numbers of `bits` bits each, LSB-first: bit j of the stream is (data[j // 8] >> (j % 8)) & 1, and a
    number's first bit is its least significant."""
    return [sum(((data[(i * bits + b) // 8] >> ((i * bits + b) % 8)) & 1) << b for b in range(bits))
            for i in range(count)]


@pytest.mark.parametrize("vector", _load("payloads.json")["vectors"], ids=lambda v: v["about"])
def test_payload_vector(vector: dict[str, Any]) -> None:
    data = bytes.fromhex(vector["payload_hex"])
    assert data[-34:-32] == b"\x7a\x20" and hashlib.sha256(data[:-34]).digest().hex() == vector["digest_hex"]
    (t,) = vector["tensors"]
    step, payload = wire.decode(data, expected={t["name"]: (tuple(t["shape"]), tuple(t["chunk"]))})
    c = payload.tensors[t["name"]]
    assert step == vector["step"] and c.idx.tolist() == t["indices"] and c.val.tolist() == t["values"]
    msg = pb.Payload.FromString(data).tensors[0]
    n, k, num_chunks = t["chunk"][0] * t["chunk"][1], t["k"], len(t["indices"])
    if t["index_coding"] == "INDEX_CODING_PACKED":
        flat = _packed(msg.indices, num_chunks * k, (n - 1).bit_length())
        assert flat == [i for row in t["indices"] for i in row]
    if vector["encoding"] == "VALUE_ENCODING_FP32" and t["value_coding"] == "VALUE_CODING_PLAIN":
        assert list(struct.unpack(f"<{num_chunks * k}f", msg.values)) == [v for row in t["values"] for v in row]
