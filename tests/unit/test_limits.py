"""The coordinator's limits (demonet.coordinator.limits) on a fake clock, and the submission bound against
real payloads of a run."""

from __future__ import annotations

import pytest
import torch

from demonet import wire
from demonet.config import Config
from demonet.coordinator.limits import (
    MESSAGE_MARGIN_BYTES,
    Limits,
    LimitsConfig,
    RateLimits,
    RoundCalls,
    StreamCount,
    SubmitSlots,
    submission_bound,
)
from demonet.errors import Busy
from demonet.optim import DeMo
from demonet.optim.payload import Compressed, Payload, num_chunks
from demonet.train.task import build_task
from demonet.wire.parts import DEFAULT_PART_BYTES


def _config(**optim: object) -> Config:
    return Config.from_dict({"model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32},
                             "train": {"seq_len": 32, "batch_size": 2}, "optim": optim})


def _demo(cfg: Config) -> tuple[torch.nn.Module, DeMo]:
    model = build_task(cfg).model
    return model, DeMo.from_settings(list(model.named_parameters()), cfg.optim)


@pytest.mark.parametrize("encoding", ["fp32", "int8", "sign"])
def test_a_real_payload_is_under_the_bound_and_the_bound_is_a_few_times_its_size(encoding: str) -> None:
    cfg = _config(encoding=encoding)
    model, opt = _demo(cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    payload = opt.compress()
    bound = submission_bound(opt.param_specs(), cfg.optim.compression_topk)
    sizes = [len(wire.encode(payload, step=7, index_coding=coding)) for coding in wire.INDEX_CODINGS]
    assert max(sizes) <= bound <= 4 * max(sizes) + 8192, (sizes, bound)


def test_the_largest_payload_any_coding_makes_is_under_the_bound() -> None:
    """k = h*w (every coefficient of every chunk), fp32 values, the widest index coding: still under."""
    cfg = _config(compression_topk=1 << 20)
    _, opt = _demo(cfg)
    specs = opt.param_specs()
    tensors = {}
    for name, (shape, chunk) in specs.items():
        n = chunk[0] * chunk[1]
        idx_CK = torch.arange(n).repeat(num_chunks(shape, chunk), 1)  # (C, k)
        tensors[name] = Compressed(idx=idx_CK, val=torch.randn(idx_CK.shape), shape=shape, chunk=chunk)
    payload = Payload(tensors=tensors, encoding="fp32")
    bound = submission_bound(specs, cfg.optim.compression_topk)
    for coding in wire.INDEX_CODINGS:
        assert len(wire.encode(payload, step=2**40, index_coding=coding)) <= bound
    assert submission_bound(specs, cfg.optim.compression_topk, cap=1000) == 1000  # the operator's cap wins


def test_one_stream_per_peer_and_round_and_a_budget_of_bytes_in_flight() -> None:
    slots = SubmitSlots(max_inflight_bytes=100)
    first, second, third = object(), object(), object()
    slots.open("a", 3, 50, first)
    with pytest.raises(Busy, match="stream open for round 3"):
        slots.open("a", 3, 1, second)  # a second stream of the same round
    slots.release("a", 3, second)  # a refused stream releases nothing
    assert slots.inflight_bytes == 50
    slots.open("a", 4, 10, third)  # the next round's, whose digest follows (an overlapped peer)
    with pytest.raises(Busy, match="budget"):
        slots.open("b", 3, 41, second)
    slots.open("b", 3, 40, second)
    assert slots.outlived(3) == [] and slots.outlived(4) == [first, second]
    assert slots.outlived(5) == [first, third, second]
    slots.release("a", 4, first)  # another stream's handle: nothing
    assert slots.inflight_bytes == 100
    slots.release("a", 3, first)
    slots.release("a", 4, third)
    slots.release("b", 3, second)
    assert slots.inflight_bytes == 0 and not slots.streams
    slots.open("a", 4, 100, second)  # free again


def test_rate_limits_give_a_burst_then_one_per_interval_and_say_when() -> None:
    rates = RateLimits(burst=4, every_s=10.0)
    assert [rates.take("a", 0.0) for _ in range(4)] == [0.0] * 4
    assert rates.take("a", 0.0) == pytest.approx(10.0)
    assert rates.take("a", 4.0) == pytest.approx(6.0)  # refused calls do not push the refill back
    assert rates.take("b", 4.0) == 0.0  # per caller
    assert rates.take("a", 10.0) == 0.0
    assert rates.take("a", 10.0) == pytest.approx(10.0)
    assert rates.take("a", 1000.0) == 0.0  # refilled to the burst, no more
    assert [rates.take("a", 1000.0) for _ in range(3)] == [0.0] * 3
    assert rates.take("a", 1000.0) > 0


def test_quiet_callers_are_forgotten_so_the_table_stays_small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("demonet.coordinator.limits._MAX_KEYS", 10)
    rates = RateLimits(burst=2, every_s=1.0)
    for i in range(50):
        rates.take(f"p{i}", float(i))
    assert len(rates.buckets) <= 11


def test_limits_refuse_a_size_no_payload_has_and_end_a_stream_with_its_round() -> None:
    limits = Limits(LimitsConfig(max_submission_bytes=1000, max_inflight_bytes=8000, download_every_s=5.0))
    assert limits.check_size(1000) is None
    assert "1001 bytes" in (limits.check_size(1001) or "")
    assert limits.stream_deadline(130.0, True, now=100.0, round_timeout_s=30.0) == 131.0
    assert limits.stream_deadline(50.0, True, now=100.0, round_timeout_s=30.0) == 101.0  # past: the grace only
    assert limits.stream_deadline(0.0, False, now=100.0, round_timeout_s=30.0) == 131.0  # not started yet
    with pytest.raises(ValueError):
        LimitsConfig(max_submission_bytes=1000, max_inflight_bytes=999, download_every_s=5.0)


def test_submit_calls_are_counted_in_total_and_per_address_before_any_part() -> None:
    streams, ended = StreamCount(most=3, most_per_address=2), []
    a1 = streams.enter("ipv4:10.0.0.1", lambda: ended.append("a1"))
    a2 = streams.enter("ipv4:10.0.0.1", lambda: ended.append("a2"))
    with pytest.raises(Busy, match="the most one address may"):
        streams.enter("ipv4:10.0.0.1", lambda: ended.append("a3"))
    b1 = streams.enter("ipv4:10.0.0.2", lambda: ended.append("b1"))
    for token in (a1, a2, b1):
        streams.started(token)  # all three are sending their payloads
    with pytest.raises(Busy, match="its most"):
        streams.enter("ipv4:10.0.0.3", lambda: ended.append("c1"))  # the total, from a fresh address
    streams.leave("ipv4:10.0.0.1", a1)
    streams.enter("ipv4:10.0.0.3", lambda: ended.append("c1"))
    assert streams.total == 3 and streams.open == {"ipv4:10.0.0.1": 1, "ipv4:10.0.0.2": 1, "ipv4:10.0.0.3": 1}
    assert ended == []


def test_a_new_submit_call_takes_the_place_of_the_oldest_that_sent_no_part() -> None:
    """Streams from many addresses that never send a part cannot hold off an honest peer's Submit: over the total,
    a new call ends the oldest call with no part yet; only calls that are sending make a new one BUSY."""
    streams, ended = StreamCount(most=3, most_per_address=2), []
    idle = [streams.enter(f"ipv4:10.0.0.{i}", lambda i=i: ended.append(i)) for i in (1, 2, 3)]
    honest = streams.enter("ipv4:10.0.9.9", lambda: ended.append(99))
    assert ended == [1]  # the oldest idle call ends at once; it leaves once its handler sees it
    streams.leave("ipv4:10.0.0.1", idle[0])
    streams.started(honest)
    streams.enter("ipv4:10.0.0.4", lambda: ended.append(4))
    assert ended == [1, 2] and streams.total == 4  # over by the one still ending, never by a sending call
    streams.leave("ipv4:10.0.0.2", idle[1])
    assert 99 not in ended and streams.total == 3


def test_aggregate_calls_are_limited_per_caller_and_round() -> None:
    calls = RoundCalls(most=2)
    assert calls.take("a", 5, oldest=0) and calls.take("a", 5, oldest=0)
    assert not calls.take("a", 5, oldest=0)
    assert calls.take("b", 5, oldest=0) and calls.take("a", 6, oldest=0)  # another caller, another round


def test_the_largest_message_read_is_one_part_of_the_runs_largest_payload() -> None:
    small = LimitsConfig(max_submission_bytes=1000, max_inflight_bytes=8000, download_every_s=5.0)
    assert small.max_message_bytes == 1000 + MESSAGE_MARGIN_BYTES
    big = LimitsConfig(max_submission_bytes=1 << 30, max_inflight_bytes=1 << 31, download_every_s=5.0)
    assert big.max_message_bytes == DEFAULT_PART_BYTES + MESSAGE_MARGIN_BYTES
    with pytest.raises(ValueError, match="max_streams"):
        LimitsConfig(max_submission_bytes=1000, max_inflight_bytes=8000, download_every_s=5.0, max_streams=0)
