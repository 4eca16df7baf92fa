"""Wire format round trips: every value encoding and index coding, bit-identical values, accounting.

Also holds the synthetic-payload helpers the other tests/unit/test_wire_*.py files import.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload
from demonet.optim.payload import ENCODINGS, Compressed, Payload, matrix_shape, quantize
from demonet.wire import _values


def num_chunks(shape: tuple[int, ...], chunk: tuple[int, int]) -> int:
    rows, cols = matrix_shape(shape)
    return -(-rows // chunk[0]) * -(-cols // chunk[1])


def make_compressed(
    shape: tuple[int, ...],
    chunk: tuple[int, int],
    k: int,
    encoding: str,
    gen: torch.Generator,
    *,
    magnitude: float = 1e-6,
    zeros: float = 0.0,
    pad: bool = False,
) -> Compressed:
    """k distinct random indices per chunk; normal values; a `zeros` fraction of exact +-0.

    With ``pad`` some rows end in aggregate-style padding: value 0 and the row's first index again.
    """
    count, n = num_chunks(shape, chunk), chunk[0] * chunk[1]
    idx_CK = torch.rand(count, n, generator=gen).argsort(dim=1)[:, :k]
    val_CK = torch.randn(count, k, generator=gen) * magnitude
    if zeros:
        zero_CK = torch.rand(count, k, generator=gen) < zeros
        val_CK = torch.where(zero_CK, torch.where(val_CK < 0, -0.0, 0.0), val_CK)
    if pad and k > 1:
        kept_C1 = torch.randint(1, k + 1, (count, 1), generator=gen)
        pad_CK = torch.arange(k)[None, :] >= kept_C1
        idx_CK = torch.where(pad_CK, idx_CK[:, :1], idx_CK)
        val_CK = torch.where(pad_CK, 0.0, val_CK)
    val_CK, scale = quantize(val_CK, encoding)
    return Compressed(idx=idx_CK, val=val_CK, shape=shape, chunk=chunk, scale=scale)


def small_payload(encoding: str, seed: int, *, pad: bool = False) -> Payload:
    """A few tensors of every kind: 2-D with a padded grid, 1-D, 0-d, 3-D."""
    gen = torch.Generator().manual_seed(seed)
    specs = [((10, 12), (4, 8), 5), ((20,), (1, 8), 3), ((), (1, 1), 1), ((3, 4, 5), (2, 4), 8)]
    tensors = {f"t{i}": make_compressed(s, c, k, encoding, gen, pad=pad) for i, (s, c, k) in enumerate(specs)}
    return Payload(tensors=tensors, encoding=encoding)


def expected_of(payload: Payload) -> dict[str, tuple[tuple[int, ...], tuple[int, int]]]:
    return {name: (c.shape, c.chunk) for name, c in payload.tensors.items()}


def seal(msg: pb.Payload) -> bytes:
    """Serialize a (possibly tampered) message with a correct digest, as a sender would."""
    msg.ClearField("digest")
    body = msg.SerializeToString()
    return body + pb.Payload(digest=hashlib.sha256(body).digest()).SerializeToString()


def parse(data: bytes) -> pb.Payload:
    msg = pb.Payload()
    msg.ParseFromString(data)
    return msg


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.contiguous().view(torch.int32))


# --- round trips -------------------------------------------------------------------------------


def _sorted_like(c: Compressed) -> tuple[torch.Tensor, torch.Tensor]:
    idx_CK, order_CK = torch.sort(c.idx, dim=1, stable=True)
    return idx_CK, c.val.gather(1, order_CK)


def assert_round_trip(payload: Payload, index_coding: str, step: int = 3) -> Payload:
    data = wire.encode(payload, step=step, index_coding=index_coding)
    got_step, got = wire.decode(data, expected=expected_of(payload))
    assert got_step == step and got.encoding == payload.encoding
    assert list(got.tensors) == list(payload.tensors)
    for name, sent in payload.tensors.items():
        back = got.tensors[name]
        assert back.shape == sent.shape and back.chunk == sent.chunk
        idx_CK, val_CK = (sent.idx, sent.val) if index_coding == "packed" else _sorted_like(sent)
        assert torch.equal(back.idx, idx_CK), name
        assert bits_equal(back.val, val_CK), name  # what the sender subtracted, to the bit
        if sent.scale is None:
            assert back.scale is None
        else:
            assert back.scale is not None and bits_equal(back.scale, sent.scale.reshape(back.scale.shape))
    assert wire.payload_bytes(payload, index_coding=index_coding, step=step) == len(data)
    return got


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("index_coding", wire.INDEX_CODINGS)
def test_round_trip_every_encoding(encoding: str, index_coding: str) -> None:
    assert_round_trip(small_payload(encoding, seed=1), index_coding)


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("index_coding", wire.INDEX_CODINGS)
def test_round_trip_aggregate_padding(encoding: str, index_coding: str) -> None:
    """An aggregate's rows end in value-0 entries that repeat the row's first index."""
    assert_round_trip(small_payload(encoding, seed=2, pad=True), index_coding)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_signed_zeros_and_zero_chunks_are_bit_exact(encoding: str) -> None:
    gen = torch.Generator().manual_seed(3)
    c = make_compressed((16, 16), (8, 8), 6, encoding, gen, zeros=0.5)
    zero = make_compressed((8, 8), (8, 8), 4, encoding, gen, magnitude=0.0)
    assert_round_trip(Payload(tensors={"w": c, "z": zero}, encoding=encoding), "entropy")
    assert_round_trip(Payload(tensors={"w": c, "z": zero}, encoding=encoding), "packed")


@st.composite
def _tensor_specs(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, int], int]:
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 24), min_size=ndim, max_size=ndim)))
    h = 1 if ndim < 2 else draw(st.integers(1, 8))
    w = draw(st.sampled_from([1, 2, 3, 5, 8, 16, 64]))
    k = draw(st.integers(1, h * w))
    return shape, (h, w), k


@settings(max_examples=80, deadline=None)
@given(
    specs=st.lists(_tensor_specs(), min_size=1, max_size=3),
    encoding=st.sampled_from(ENCODINGS),
    index_coding=st.sampled_from(wire.INDEX_CODINGS),
    seed=st.integers(0, 2**31),
    exponent=st.integers(-30, 10),
    pad=st.booleans(),
)
def test_round_trip_property(
    specs: list[tuple[tuple[int, ...], tuple[int, int], int]],
    encoding: str,
    index_coding: str,
    seed: int,
    exponent: int,
    pad: bool,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    pad = pad and encoding in ("fp32", "bf16", "fp16")  # aggregates travel in these
    tensors = {
        f"p{i}": make_compressed(s, c, k, encoding, gen, magnitude=2.0**exponent, zeros=0.1, pad=pad)
        for i, (s, c, k) in enumerate(specs)
    }
    assert_round_trip(Payload(tensors=tensors, encoding=encoding), index_coding, step=seed)


def test_empty_payload_and_k_zero() -> None:
    assert_round_trip(Payload(tensors={}, encoding="fp32"), "packed")
    c = Compressed(idx=torch.zeros(2, 0, dtype=torch.int64), val=torch.zeros(2, 0), shape=(4, 8), chunk=(2, 8))
    for coding in wire.INDEX_CODINGS:
        assert_round_trip(Payload(tensors={"w": c}, encoding="fp32"), coding)


# --- batches: tensors that share (n, k) are coded together --------------------------------------


def _batch_payload(encoding: str) -> Payload:
    """1x8 chunks with k=3 (odd bit counts, so bytes pad between tensors), an empty tensor, a tensor with
    padding repeats (Elias-Fano beside bitmaps under entropy coding), and a second (n, k)."""
    gen = torch.Generator().manual_seed(21)
    pad = encoding in ("fp32", "bf16", "fp16")
    tensors = {
        "a": make_compressed((13,), (1, 8), 3, encoding, gen),
        "empty": make_compressed((0,), (1, 8), 3, encoding, gen),
        "b": make_compressed((5, 9), (1, 8), 3, encoding, gen, zeros=0.3),
        "padded": make_compressed((20,), (1, 8), 3, encoding, gen, pad=pad),
        "c": make_compressed((6, 6), (2, 4), 5, encoding, gen),
        "d": make_compressed((7,), (1, 8), 3, encoding, gen),
    }
    return Payload(tensors=tensors, encoding=encoding)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("index_coding", wire.INDEX_CODINGS)
def test_a_batch_codes_each_tensor_as_it_would_alone(encoding: str, index_coding: str) -> None:
    payload = _batch_payload(encoding)
    assert_round_trip(payload, index_coding)
    together = parse(wire.encode(payload, step=0, index_coding=index_coding)).tensors
    for i, (name, c) in enumerate(payload.tensors.items()):
        alone = parse(wire.encode(Payload(tensors={name: c}, encoding=encoding), step=0, index_coding=index_coding))
        assert together[i] == alone.tensors[0], name
    if index_coding == "entropy" and encoding in ("fp32", "bf16", "fp16"):
        codings = {t.name: t.index_coding for t in together}
        assert codings["a"] == codings["d"] == pb.INDEX_CODING_BITMAP
        assert codings["padded"] == pb.INDEX_CODING_ELIAS_FANO


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("index_coding", wire.INDEX_CODINGS)
@pytest.mark.parametrize("value_coding", wire.VALUE_CODINGS)
def test_encode_many_gives_each_payload_the_bytes_encode_gives(encoding: str, index_coding: str,
                                                                value_coding: str) -> None:
    tensors = list(_batch_payload(encoding).tensors.items())
    groups = [tensors[:2], tensors[2:5], [], tensors[5:], tensors[1:4]]  # a batch spans payloads; one is empty
    payloads = [Payload(tensors=dict(g), encoding=encoding) for g in groups]
    alone = [wire.encode(p, step=7, index_coding=index_coding, value_coding=value_coding) for p in payloads]
    assert wire.encode_many(payloads, step=7, index_coding=index_coding, value_coding=value_coding) == alone
    assert wire.encode_many([], step=7) == []


def test_encode_many_refuses_mixed_encodings_and_names_a_bad_tensor() -> None:
    gen = torch.Generator().manual_seed(23)
    a = Payload(tensors={"a": make_compressed((16,), (1, 8), 3, "fp32", gen)}, encoding="fp32")
    b = Payload(tensors={"b": make_compressed((16,), (1, 8), 3, "bf16", gen)}, encoding="bf16")
    with pytest.raises(ValueError, match="share one encoding"):
        wire.encode_many([a, b], step=0)
    val_CK = a.tensors["a"].val.clone()
    val_CK[0, 0] = float("inf")
    bad = Payload(tensors={"t": _with(a.tensors["a"], val=val_CK)}, encoding="fp32")
    with pytest.raises(ValueError, match="^t: val holds NaN or Inf"):
        wire.encode_many([a, bad], step=0)


def test_errors_name_the_tensor_within_a_batch() -> None:
    gen = torch.Generator().manual_seed(22)
    tensors = {f"t{i}": make_compressed((16,), (1, 8), 3, "fp32", gen) for i in range(4)}
    val_CK = tensors["t2"].val.clone()
    val_CK[1, 0] = float("nan")
    with pytest.raises(ValueError, match="^t2: val holds NaN"):
        wire.encode(Payload(tensors={**tensors, "t2": _with(tensors["t2"], val=val_CK)}, encoding="fp32"), step=0)
    idx_CK = tensors["t3"].idx.clone()
    idx_CK[1, 2] = idx_CK[1, 0]  # encode does not look for repeats; decode must
    payload = Payload(tensors={**tensors, "t3": _with(tensors["t3"], idx=idx_CK)}, encoding="fp32")
    with pytest.raises(InvalidPayload, match="^tensor 't3': an index repeats"):
        wire.decode(wire.encode(payload, step=0))
    msg = parse(wire.encode(Payload(tensors=tensors, encoding="fp32"), step=0, index_coding="entropy"))
    msg.tensors[1].values = msg.tensors[1].values[:4] + b"\x00\x00\xc0\x7f" + msg.tensors[1].values[8:]  # NaN
    with pytest.raises(InvalidPayload, match="^tensor 't1': values are not all finite"):
        wire.decode(seal(msg))


# --- index codings -----------------------------------------------------------------------------


@pytest.mark.parametrize(("chunk", "width"), [((64, 64), 12), ((1, 64), 6), ((1, 1), 0), ((3, 5), 4)])
def test_packed_index_width(chunk: tuple[int, int], width: int) -> None:
    gen = torch.Generator().manual_seed(4)
    k = min(3, chunk[0] * chunk[1])
    c = make_compressed((chunk[0] * 2, chunk[1]), chunk, k, "fp32", gen)
    msg = parse(wire.encode(Payload(tensors={"w": c}, encoding="fp32"), step=0, index_coding="packed"))
    assert len(msg.tensors[0].indices) == math.ceil(2 * k * width / 8)


def test_entropy_coding_near_the_floor() -> None:
    """64x64 chunks with k=32: Elias-Fano takes 287 bits a chunk against a floor of about 266."""
    gen = torch.Generator().manual_seed(5)
    payload = Payload(tensors={"w": make_compressed((256, 384), (64, 64), 32, "fp16", gen)}, encoding="fp16")
    report = wire.index_bits_report(payload)
    assert report["packed_bits_per_index"] == 12
    assert report["entropy_over_floor"] < 1.10
    assert abs(report["floor_bits_per_index"] - 8.32) < 0.01
    assert report["tensors"]["w"]["entropy_bits"] == 24 * 287
    msg = parse(wire.encode(payload, step=0, index_coding="entropy"))
    assert msg.tensors[0].index_coding == pb.INDEX_CODING_ELIAS_FANO
    assert len(msg.tensors[0].indices) == math.ceil(24 * 287 / 8)


def test_entropy_coding_picks_a_bitmap_for_dense_chunks_unless_indices_repeat() -> None:
    gen = torch.Generator().manual_seed(6)
    dense = make_compressed((64,), (1, 64), 32, "fp32", gen)
    msg = parse(wire.encode(Payload(tensors={"b": dense}, encoding="fp32"), step=0, index_coding="entropy"))
    assert msg.tensors[0].index_coding == pb.INDEX_CODING_BITMAP and len(msg.tensors[0].indices) == 8
    padded = make_compressed((64,), (1, 64), 32, "fp32", gen, pad=True)
    msg = parse(wire.encode(Payload(tensors={"b": padded}, encoding="fp32"), step=0, index_coding="entropy"))
    assert msg.tensors[0].index_coding == pb.INDEX_CODING_ELIAS_FANO


# --- encode refuses local bugs -----------------------------------------------------------------


def test_encode_rejects_values_off_the_encoding_grid() -> None:
    gen = torch.Generator().manual_seed(7)
    c = make_compressed((8, 8), (8, 8), 4, "fp32", gen)  # fp32 values, not rounded to bf16
    with pytest.raises(ValueError, match="quantize"):
        wire.encode(Payload(tensors={"w": c}, encoding="bf16"), step=0)


@pytest.mark.parametrize(
    "change",
    [
        {"idx": torch.full((1, 4), 64)},
        {"idx": torch.zeros(2, 4, dtype=torch.int64)},
        {"val": torch.zeros(1, 4, dtype=torch.float64)},
        {"chunk": (8, 4)},
        {"chunk": (0, 8)},
    ],
)
def test_encode_rejects_malformed_local_payloads(change: dict[str, object]) -> None:
    fields = {"idx": torch.arange(4)[None, :], "val": torch.zeros(1, 4), "shape": (8, 8), "chunk": (8, 8)}
    fields.update(change)
    with pytest.raises(ValueError):
        wire.encode(Payload(tensors={"w": Compressed(**fields)}, encoding="fp32"), step=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_encode_rejects_non_finite_values_and_scales(encoding: str) -> None:
    c = make_compressed((8, 8), (8, 8), 4, encoding, torch.Generator().manual_seed(12))
    val_CK = c.val.clone()
    val_CK[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        wire.encode(Payload(tensors={"w": _with(c, val=val_CK)}, encoding=encoding), step=0)
    if c.scale is not None:
        bad = torch.full_like(c.scale, float("inf") if encoding != "fp16" else 0.0)
        with pytest.raises(ValueError, match="scale"):
            wire.encode(Payload(tensors={"w": _with(c, scale=bad)}, encoding=encoding), step=0)


def _with(c: Compressed, **change: object) -> Compressed:
    fields = {"idx": c.idx, "val": c.val, "shape": c.shape, "chunk": c.chunk, "scale": c.scale, **change}
    return Compressed(**fields)  # type: ignore[arg-type]


def test_encode_rejects_bad_arguments() -> None:
    payload = small_payload("fp32", seed=8)
    with pytest.raises(ValueError, match="step"):
        wire.encode(payload, step=-1)
    with pytest.raises(ValueError, match="index_coding"):
        wire.encode(payload, step=0, index_coding="zip")


def test_digest_is_the_last_field_and_covers_everything_before_it() -> None:
    data = wire.encode(small_payload("sign", seed=9), step=11)
    assert data[-34:-32] == b"\x7a\x20"
    assert hashlib.sha256(data[:-34]).digest() == data[-32:] == parse(data).digest


def test_decode_returns_the_model_order() -> None:
    payload = small_payload("fp32", seed=11)
    shuffled = dict(reversed(list(expected_of(payload).items())))
    _, got = wire.decode(wire.encode(payload, step=0), expected=shuffled)
    assert list(got.tensors) == list(shuffled)


def test_index_bits_report_totals_match_tensors() -> None:
    report = wire.index_bits_report(small_payload("int8", seed=10))
    for key in ("num_indices", "packed_bits", "entropy_bits"):
        assert report[key] == sum(t[key] for t in report["tensors"].values())
    assert report["packed_over_floor"] >= report["entropy_over_floor"] >= 1.0


# --- value codings -----------------------------------------------------------------------------


def _demo_payload(encoding: str) -> Payload:
    """A real DeMo payload: a small GPT's momentum after three steps on the embedded corpus."""
    from demonet.optim import DeMo
    from demonet.train.data import Batches, load_corpus
    from demonet.train.model import GPT, ModelConfig

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=2))
    opt = DeMo(model.named_parameters(), lr=1e-3, encoding=encoding)
    batches = Batches(load_corpus(), batch_size=2, seq_len=32, seed=0)
    for _ in range(3):
        x, y = next(batches)
        model(x, y)[1].backward()  # type: ignore[union-attr]
        payload = opt.compress()
        opt.zero_grad()
    return payload


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_deflated_values_decode_to_the_plain_bits_and_are_smaller(encoding: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    payload = _demo_payload(encoding)
    plain = wire.encode(payload, step=1, value_coding="plain")
    assert wire.encode(payload, step=1) == plain  # this model's tensors are too small to be worth a zlib call
    monkeypatch.setattr(_values, "_DEFLATE_MIN_VALUES", 0)
    deflated = wire.encode(payload, step=1)  # the default
    codings = {t.value_coding for t in parse(deflated).tensors}
    got, want = wire.decode(deflated)[1], wire.decode(plain)[1]
    for name, c in want.tensors.items():
        assert torch.equal(got.tensors[name].idx, c.idx) and torch.equal(got.tensors[name].val, c.val), name
    if encoding in ("fp32", "bf16", "fp16"):
        assert pb.VALUE_CODING_TOP_PLANE_DEFLATE in codings
        assert len(deflated) < (0.92 if encoding != "fp16" else 1.0) * len(plain), (encoding, len(deflated), len(plain))
    else:  # int8 codes and sign bits have no byte planes
        assert codings == {pb.VALUE_CODING_PLAIN} and deflated == plain


def test_values_that_do_not_shrink_stay_plain_and_a_bad_value_coding_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_values, "_DEFLATE_MIN_VALUES", 0)
    gen = torch.Generator().manual_seed(3)
    c = make_compressed((64, 64), (8, 8), 16, "fp32", gen)
    bits = torch.randint(-(2**31), 2**31, c.val.shape, generator=gen, dtype=torch.int64).to(torch.int32)
    noise = bits.view(torch.float32).nan_to_num(0.0, 0.0, 0.0)  # random signs and exponents: nothing to deflate
    payload = Payload(tensors={"w": Compressed(idx=c.idx, val=noise, shape=c.shape, chunk=c.chunk)})
    assert [t.value_coding for t in parse(wire.encode(payload, step=0)).tensors] == [pb.VALUE_CODING_PLAIN]
    msg = parse(wire.encode(_demo_payload("fp32"), step=0))
    t = next(t for t in msg.tensors if t.value_coding == pb.VALUE_CODING_TOP_PLANE_DEFLATE)
    t.value_coding = 9
    with pytest.raises(InvalidPayload, match="unknown value coding 9"):
        wire.decode(seal(msg))
    with pytest.raises(ValueError, match="value_coding should be one of"):
        wire.encode(payload, step=0, value_coding="zstd")


def test_metadata_that_passed_once_is_still_checked_against_each_model_and_each_message() -> None:
    """What a tensor's metadata alone decides is checked once per metadata and model shape, then kept: a
    payload that passed for one model is refused for another, a message whose bytes do not fit its
    (known good) metadata is refused, and a model whose shapes are lists is checked all the same."""
    payload = small_payload("bf16", seed=3)
    data, expected = wire.encode(payload, step=0), expected_of(payload)
    wire.decode(data, expected=expected)
    wire.decode(data, expected=expected)  # its metadata known good now
    wider = {**expected, "t0": ((10, 16), (4, 8))}
    with pytest.raises(InvalidPayload, match=r"'t0': shape \(10, 12\) chunk \(4, 8\), the model has \(10, 16\)"):
        wire.decode(data, expected=wider)
    with pytest.raises(InvalidPayload, match="'t0' is not a parameter of this model"):
        wire.decode(data, expected={n: v for n, v in expected.items() if n != "t0"})
    msg = parse(data)
    msg.tensors[0].indices = msg.tensors[0].indices[:-1]
    with pytest.raises(InvalidPayload, match="'t0': indices hold"):
        wire.decode(seal(msg), expected=expected)
    listed = {n: (list(s), list(c)) for n, (s, c) in expected.items()}
    assert list(wire.decode(data, expected=listed)[1].tensors) == list(expected)
    with pytest.raises(InvalidPayload, match="the model has"):
        wire.decode(data, expected={**listed, "t0": ([10, 16], [4, 8])})
