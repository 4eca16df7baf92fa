"""Writes the protocol's test vectors (docs/protocol.md) from the implementation: every signed statement, the
parameter digest, and payloads in every index coding and value encoding.

    python -m tests.vectors.generate          # rewrite tests/vectors/*.json
    python -m tests.vectors.generate --check  # exit 1 if they differ from what the code gives now

The statements are found, not listed: every ``*_statement`` function of `demonet.wire.identity` (coordinator
mode) and `demonet.dht.keys` (DHT mode), called with the example value of each of its parameters (`EXAMPLES`,
by name, else by type). A statement that gains a field gets its vector here once `EXAMPLES` knows the field's
name (or its type has a default). Ed25519 signatures are deterministic (RFC 8032), so the files are the same
bytes on every run.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import struct
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.dht import keys as dht_keys
from demonet.optim import Compressed, Payload
from demonet.optim.payload import num_chunks, quantize
from demonet.wire import identity
from demonet.wire.digest import param_digest, tensor_header
from demonet.wire.identity import Identity

HERE = Path(__file__).parent
TEST_KEY_SEED = bytes(range(32))
"""The test key's 32-byte Ed25519 private seed (RFC 8032): never a real peer's key."""
MODULES = (identity, dht_keys)

EXAMPLES: dict[str, Any] = {
    "nonce": bytes(range(0xA0, 0xC0)), "session": bytes(range(0x10, 0x20)), "peer_id": "alice-1",
    "round": 7, "resync": True, "payload_digest": hashlib.sha256(b"a payload").digest(),
    "param_digest": "0123456789abcdef0123456789abcdef", "loss": 2.75, "samples": 12,
    "key_id": hashlib.sha1(b"demonet/run/state/7").digest(), "subkey_bytes": b"alice-1@" + bytes(32).hex().encode(),
    "value": b"\x93\xa4abcd", "expiration_time": 1_700_000_000.5, "body": b"\x0a\x03run\x10\x07",
    "opener": "12D3KooWopener", "callee": "12D3KooWcallee",
}
"""Each statement parameter's example value, by name; `public` is the test key's own public key."""
BY_TYPE: dict[type, Any] = {bytes: bytes(range(8)), str: "text", int: 3, float: 0.5, bool: False}
TAGS = {ord("b"): "bool", ord("i"): "u64", ord("f"): "f64", ord("s"): "utf8", ord("y"): "bytes"}


def _json_value(value: Any) -> Any:
    return value.hex() if isinstance(value, bytes) else value


def _example(name: str, kind: Any, public: bytes) -> Any:
    if name == "public":
        return public
    if name in EXAMPLES:
        return EXAMPLES[name]
    if kind in BY_TYPE:
        return BY_TYPE[kind]
    raise SystemExit(f"no example value for parameter {name!r} ({kind}): add one to EXAMPLES")


def statement_functions() -> list[tuple[str, Callable[..., bytes]]]:
    """Every ``*_statement`` function of the statement modules, in module then name order."""
    found = []
    for module in MODULES:
        for name, fn in sorted(vars(module).items()):
            if name.endswith("_statement") and inspect.isfunction(fn) and fn.__module__ == module.__name__:
                found.append((name, fn))
    return found


def parse_fields(data: bytes) -> tuple[str, list[dict[str, Any]]]:
    """A statement's kind and fields, read as docs/protocol.md describes them (tag, 4-byte length, bytes)."""
    domain = b"demonet/v1\0"
    assert data.startswith(domain), data[:16]
    end = data.index(b"\0", len(domain))
    kind, pos, fields = data[len(domain):end].decode(), end + 1, []
    while pos < len(data):
        tag, (length,) = data[pos], struct.unpack_from("<I", data, pos + 1)
        fields.append({"tag": chr(tag), "type": TAGS[tag], "length": length,
                       "hex": data[pos + 5:pos + 5 + length].hex()})
        pos += 5 + length
    return kind, fields


def statements() -> dict[str, Any]:
    key = Ed25519PrivateKey.from_private_bytes(TEST_KEY_SEED)
    me = Identity(key)
    vectors = []
    for name, fn in statement_functions():
        hints = typing.get_type_hints(fn)
        params = list(inspect.signature(fn).parameters)
        inputs = [(p, _example(p, hints.get(p), me.public)) for p in params]
        data = fn(*(v for _, v in inputs))
        kind, fields = parse_fields(data)
        vectors.append({"function": f"{fn.__module__}.{name}", "kind": kind,
                        "inputs": [{"name": p, "type": type(v).__name__, "value": _json_value(v)} for p, v in inputs],
                        "fields": fields, "statement_hex": data.hex(), "signature_hex": me.sign(data).hex()})
    return {"about": "docs/protocol.md, Signed statements; regenerate: python -m tests.vectors.generate",
            "domain_hex": b"demonet/v1\0".hex(), "test_key": {"seed_hex": TEST_KEY_SEED.hex(),
                                                             "public_hex": me.public.hex()},
            "vectors": vectors}


def _tensor(values: list[float], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(dtype).reshape(shape)


def parameters() -> dict[str, Any]:
    cases = {
        "one float32 matrix": [("w", _tensor([1.0, -2.0, 0.5, 0.0, -0.0, 3.25], (2, 3), torch.float32))],
        "every dtype, a scalar and an empty tensor": [
            ("blocks.0.attn.wé", _tensor([0.1, -0.2, 0.3, 1e-40], (2, 2), torch.float32)),
            ("b", _tensor([1.5, -1.0, 65504.0], (3,), torch.bfloat16)),
            ("h", _tensor([0.333, -7.0], (1, 2), torch.float16)),
            ("s", _tensor([math.pi], (), torch.float64)),
            ("empty", torch.zeros(0, 4)),
        ],
    }
    out = []
    for about, named in cases.items():
        tensors = []
        for name, t in named:
            data = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            dtype = str(t.dtype).removeprefix("torch.")
            tensors.append({"name": name, "dtype": dtype, "shape": list(t.shape), "data_hex": data.hex(),
                            "header_hex": tensor_header(name, dtype, tuple(t.shape), len(data)).hex()})
        out.append({"about": about, "tensors": tensors, "param_digest": param_digest(named)})
    return {"about": "docs/protocol.md, The parameter digest; regenerate: python -m tests.vectors.generate",
            "vectors": out}


PAYLOAD_CASES = [
    # (about, index coding asked, encoding, value coding, shape, chunk, k): the entropy cases are sized so that
    # Elias-Fano (k small against n) or the bitmap (k close to n) is the smaller, and the deflate case is large
    # enough (C*k >= 512) for the byte planes.
    ("packed", "packed", "fp32", "plain", (3, 10), (2, 4), 3),
    ("elias-fano", "entropy", "fp32", "plain", (4, 32), (2, 16), 3),
    ("bitmap", "entropy", "fp32", "plain", (2, 8), (2, 4), 6),
    ("bf16", "packed", "bf16", "plain", (2, 8), (2, 4), 3),
    ("fp16", "packed", "fp16", "plain", (2, 8), (2, 4), 3),
    ("int8", "packed", "int8", "plain", (2, 8), (2, 4), 3),
    ("sign", "packed", "sign", "plain", (2, 8), (2, 4), 3),
    ("fp32, top plane deflated", "packed", "fp32", "deflate", (16, 64), (4, 16), 32),
    ("bf16, top plane deflated", "packed", "bf16", "deflate", (16, 64), (4, 16), 32),
]


def _payload(shape: tuple[int, ...], chunk: tuple[int, int], k: int, encoding: str, seed: int) -> Payload:
    gen = torch.Generator().manual_seed(seed)
    rows, n = num_chunks(shape, chunk), chunk[0] * chunk[1]
    idx_CK = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(rows)])  # (C, k)
    # Integers, not randn: torch's normal sampler takes a vectorized path whose bits differ by CPU kernel level,
    # and the vectors must be the same on every machine. An int to float and an IEEE multiply are exact everywhere.
    raw_CK = torch.randint(-2000, 2001, (rows, k), generator=gen).float() * 1e-5  # (C, k)
    val_CK, scale = quantize(raw_CK, encoding)
    return Payload(tensors={"layer.w": Compressed(idx_CK, val_CK, shape, chunk, scale)}, encoding=encoding)


def payloads() -> dict[str, Any]:
    out = []
    for seed, (about, index_coding, encoding, value_coding, shape, chunk, k) in enumerate(PAYLOAD_CASES):
        data = wire.encode(_payload(shape, chunk, k, encoding, seed), step=5, index_coding=index_coding,
                           value_coding=value_coding)
        msg = pb.Payload.FromString(data)
        step, decoded = wire.decode(data, expected={"layer.w": (shape, chunk)})
        c, t = decoded.tensors["layer.w"], msg.tensors[0]
        want = {"packed": 1, "elias-fano": 2, "bitmap": 3}.get(about, 1)
        assert t.index_coding == want, (about, t.index_coding)
        assert t.value_coding == (1 if value_coding == "deflate" else 0), (about, t.value_coding)
        out.append({
            "about": about, "payload_hex": data.hex(), "step": step,
            "digest_hex": msg.digest.hex(), "encoding": pb.ValueEncoding.Name(msg.encoding),
            "tensors": [{"name": t.name, "shape": list(t.shape), "chunk": [t.chunk_h, t.chunk_w], "k": t.k,
                         "index_coding": pb.IndexCoding.Name(t.index_coding),
                         "value_coding": pb.ValueCoding.Name(t.value_coding),
                         "indices": c.idx.tolist(), "values": c.val.tolist()}],
        })
    return {"about": "docs/protocol.md, Payloads; regenerate: python -m tests.vectors.generate", "vectors": out}


def documents() -> dict[str, str]:
    """File name -> its text."""
    return {name: json.dumps(make(), indent=1, ensure_ascii=False) + "\n"
            for name, make in (("statements.json", statements), ("parameters.json", parameters),
                               ("payloads.json", payloads))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare with the files; exit 1 if they differ")
    args = parser.parse_args(argv)
    stale = []
    for name, text in documents().items():
        path = HERE / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python -m tests.vectors.generate", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
