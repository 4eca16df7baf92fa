"""The peer's and `demonet up`'s pure pieces: run folder, CLI flags, token, settle, client error mapping.

No sockets: the gRPC client's stub is replaced by a fake that answers like the coordinator.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
import torch

from demonet import cli, wire
from demonet._proto import demonet_pb2 as pb
from demonet.config import load_token
from demonet.errors import InvalidPayload, PeerUnavailable
from demonet.loop import MetricsRow, runfolder
from demonet.optim import Compressed, DeMo, Payload, aggregate
from demonet.train.trainer import settle
from demonet.transport import Digest, NotMember, Resync, RoundResult, StaleRound, grpc_retry
from demonet.transport.grpc import GrpcClient, JoinInfo
from demonet.wire.identity import submit_statement, verify

# -- run folder ------------------------------------------------------------------------------------------


def _row(round: int, peer: str, loss: float, digest: str = "d", up: int = 100, down: int = 120) -> dict[str, Any]:
    return {"round": round, "peer": peer, "loss": loss, "bytes_up": up, "bytes_down": down,
            "param_digest": f"{digest}{round}", "round_time_s": 0.1, "compute_s": 0.1, "wait_s": 0.0,
            "contributors": 2, "aborted": False}


def _rows(rows: Iterable[dict[str, Any]]) -> list[MetricsRow]:
    return [MetricsRow.from_dict(r) for r in rows]


def _write(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_merge_metrics_sorts_by_round_then_peer(tmp_path: Path) -> None:
    _write(tmp_path / "metrics-b.jsonl", [_row(0, "b", 5.0), _row(1, "b", 4.0)])
    _write(tmp_path / "metrics-a.jsonl", [_row(1, "a", 4.5), _row(2, "a", 3.0)])
    (tmp_path / "other.jsonl").write_text("not metrics\n")
    rows = runfolder.merge_metrics(tmp_path)
    assert [(r.round, r.peer) for r in rows] == [(0, "b"), (1, "a"), (1, "b"), (2, "a")]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [r.to_dict() for r in rows]


def test_merge_metrics_keeps_the_last_rows_of_rounds_a_peer_did_again(tmp_path: Path) -> None:
    # a's coordinator restarted from the state of round 2 after publishing round 3: a does 2 and 3 again
    _write(tmp_path / "metrics-a.jsonl", [_row(0, "a", 5.0), _row(1, "a", 4.0), _row(2, "a", 3.0, "old"),
                                          _row(3, "a", 2.0, "old"), _row(2, "a", 3.5), _row(3, "a", 2.5),
                                          _row(4, "a", 2.0)])
    rows = runfolder.merge_metrics(tmp_path)
    assert [(r.round, r.param_digest) for r in rows] == [(0, "d0"), (1, "d1"), (2, "d2"), (3, "d3"), (4, "d4")]
    assert runfolder.final_rows(rows, lambda r: r.round) == rows  # increasing rounds: nothing to drop


def test_summary_losses_bytes_and_digest_agreement() -> None:
    rows = _rows(_row(r, p, 5.0 - r + (0.5 if p == "b" else 0.0), up=100 + (p == "b"), down=200)
                 for r in range(8) for p in ("a", "b"))
    s = runfolder.summarize_run(rows)
    assert (s["rounds"], s["peers"]) == (8, 2)
    assert s["first_loss"] == pytest.approx(4.75)  # mean over peers 5.25 - round, first 2 rounds (8 // 4)
    assert s["loss_window_rounds"] == 2  # the summary says over how many rounds its losses are averaged
    assert s["last_loss"] == pytest.approx(-1.25)
    assert s["per_peer"]["b"]["bytes_up_per_round"] == 101 and s["per_peer"]["a"]["bytes_down_per_round"] == 200
    assert s["digests_agree"] and s["disagreeing_rounds"] == []
    rows[5].param_digest = "other"
    s = runfolder.summarize_run(rows)
    assert not s["digests_agree"] and s["disagreeing_rounds"] == [2]
    empty = json.loads(runfolder.to_json(runfolder.summarize_run([])))  # strict JSON: no NaN
    assert empty["digests_agree"] is False and empty["first_loss"] is None


def test_plot_is_a_png(tmp_path: Path) -> None:
    rows = _rows(_row(r, p, 5.0 - 0.1 * r) for r in range(5) for p in ("a", "b"))
    runfolder.plot_loss(rows, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compute_and_wait_per_peer_and_their_plot(tmp_path: Path) -> None:
    rows = _rows({**_row(r, p, 5.0 - 0.1 * r), "compute_s": 0.2 + (p == "b") * 0.1, "wait_s": 0.05 * r, "overlap": 1}
                 for r in range(5) for p in ("a", "b"))
    s = runfolder.summarize_run(rows)
    assert s["per_peer"]["a"]["compute_s"] == pytest.approx(0.2)
    assert s["per_peer"]["b"]["compute_s"] == pytest.approx(0.3)
    assert s["per_peer"]["a"]["wait_s"] == pytest.approx(0.1)
    runfolder.plot_pipeline(rows, tmp_path / "compute_wait.png")
    assert (tmp_path / "compute_wait.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_pace_is_wall_clock_seconds_per_round_from_the_rows_times() -> None:
    """An overlapped round's round_time_s spans the next round's compute; the pace comes from the rows' times."""
    rows = [{**_row(r, p, 1.0), "time": 1000.0 + r * (0.5 if p == "a" else 0.7), "round_time_s": 9.9}
            for r in range(3, 8) for p in ("a", "b", "c")]
    rows = [r for r in rows if not (r["peer"] == "c" and r["round"] > 3)]  # c: one row, no pace
    s = runfolder.summarize_run(_rows(rows))
    assert s["per_peer"]["a"]["s_per_round"] == pytest.approx(0.5)
    assert s["per_peer"]["b"]["s_per_round"] == pytest.approx(0.7)
    assert s["s_per_round"] == pytest.approx(0.6)  # the median of the peers that have a pace
    assert json.loads(runfolder.to_json(s))["per_peer"]["c"]["s_per_round"] is None


# -- flags and token -------------------------------------------------------------------------------------


def test_new_subcommands_parse() -> None:
    parser = cli._parser("peer")  # a subcommand's flags are built only for it (`demonet --help` stays light)
    args, rest = parser.parse_known_args(["peer", "--coordinator", "h:1", "--peer-id", "p0", "--accumulate", "4",
                                          "--threads", "2", "--out", "o"])
    assert (args.command, args.coordinator, args.peer_id, args.accumulate, args.threads, rest) == \
        ("peer", "h:1", "p0", 4, 2, [])
    args, _ = cli._parser("status").parse_known_args(["status", "--coordinator", "h:2", "--token-file", "t"])
    assert (args.command, args.coordinator, args.token_file) == ("status", "h:2", "t")
    args, _ = parser.parse_known_args(["up", "--peers", "3", "--steps", "5", "--out", "r", "--round-timeout-s", "2"])
    assert (args.peers, args.steps, args.out, args.round_timeout_s, args.threads_per_peer) == (3, 5, "r", 2.0, 1)
    args, rest = parser.parse_known_args(["coordinator", "--listen", "127.0.0.1:0", "--steps", "3", "--help"])
    assert args.command == "coordinator" and rest == ["--listen", "127.0.0.1:0", "--steps", "3", "--help"]
    with pytest.raises(SystemExit):
        cli.main(["status", "--coordinator", "h:1", "--bogus"])


def test_token_from_file_then_env(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("  secret\n")
    assert load_token(str(tmp_path / "t"), {"DEMONET_TOKEN": "env"}) == "secret"
    assert load_token(None, {"DEMONET_TOKEN": "env"}) == "env"
    with pytest.raises(ValueError, match="no token: pass --token-file FILE or set DEMONET_TOKEN"):
        load_token(None, {"DEMONET_TOKEN": " "})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_token(str(tmp_path / "empty"), {})
    with pytest.raises(ValueError, match="cannot read the token file"):
        load_token(str(tmp_path / "missing"), {})


@pytest.mark.parametrize("command", [["peer", "--coordinator", "127.0.0.1:1"],
                                     ["status", "--coordinator", "127.0.0.1:1"]])
def test_missing_token_is_a_clear_error(command: list[str], monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("DEMONET_TOKEN", raising=False)
    assert cli.main(command) == 2
    assert "no token: pass --token-file FILE or set DEMONET_TOKEN" in capsys.readouterr().err


# -- settle ----------------------------------------------------------------------------------------------


def _replica() -> tuple[torch.nn.Linear, DeMo, Payload]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = DeMo(model.named_parameters(), lr=0.01, compression_topk=4, compression_chunk=4)
    model(torch.randn(3, 16)).square().sum().backward()
    return model, opt, opt.compress()


_LR = 0.5


def _entries(rows: dict[str, tuple[list[int], list[float]]]) -> Payload:
    """A payload or an aggregate for the two 4x4 parameters of `_settle_replica`: one chunk each."""
    return Payload(tensors={name: Compressed(idx=torch.tensor([idx]), val=torch.tensor([val]), shape=(4, 4),
                                             chunk=(4, 4)) for name, (idx, val) in rows.items()})


def _settle_replica() -> tuple[torch.nn.Parameter, torch.nn.Parameter, DeMo]:
    """Parameters a and b, one DCT chunk each; every momentum coefficient at 1."""
    a = torch.nn.Parameter(torch.arange(16.0).reshape(4, 4))
    b = torch.nn.Parameter(-torch.arange(16.0).reshape(4, 4))
    opt = DeMo([("a", a), ("b", b)], lr=_LR, compression_topk=2, compression_chunk=4)
    for p in (a, b):
        opt.state[p]["momentum"].fill_(1.0)
    return a, b, opt


_PAYLOAD = {"a": ([0, 5], [2.0, 3.0]), "b": ([0, 7], [-1.0, 4.0])}
"""This peer's entries (coefficient index, value): what `compress` took out of the momentum."""
_AGGREGATE = {"a": ([0, 0], [1.5, 0.0]), "b": ([7, 7], [0.0, 0.0])}
"""The round's aggregate holds a's coefficient 0 (the DC term) and nothing of b: b's entries are
padding (value 0), which holds no index."""
_KEPT = {"a": ([0, 0], [0.0, 0.0]), "b": ([7, 7], [2.0, 0.0])}
"""What of this peer's payload the aggregate holds when that is not the aggregate (DHT mode): b's 7."""


_RESTORED = {
    "aborted": {"a": {0: 2.0, 5: 3.0}, "b": {0: -1.0, 7: 4.0}},  # all of it: nothing was applied
    "missed": {"a": {0: 2.0, 5: 3.0}, "b": {0: -1.0, 7: 4.0}},  # all of it: its payload is in no aggregate
    "contributor": {"a": {5: 3.0}, "b": {0: -1.0, 7: 4.0}},  # what the aggregate does not hold
    "contributor-kept": {"a": {0: 2.0, 5: 3.0}, "b": {0: -1.0}},  # what `kept` does not hold
}
"""Per outcome: the payload entries that must be back in the momentum (index: value added)."""


@pytest.mark.parametrize("case", list(_RESTORED))
def test_settle_restores_and_applies_by_outcome(case: str) -> None:
    a, b, opt = _settle_replica()
    a0, b0 = a.detach().clone(), b.detach().clone()
    result = RoundResult(round=0, aggregate=None if case == "aborted" else _entries(_AGGREGATE),
                         contributors=("x",) if case == "missed" else ("me", "x"), param_digest="",
                         aborted=case == "aborted", bytes_up=1, bytes_down=1,
                         kept=_entries(_KEPT) if case == "contributor-kept" else None)
    settle(opt, _entries(_PAYLOAD), result, "me" in result.contributors)
    for name, p in (("a", a), ("b", b)):
        want = torch.ones(1, 16)
        for i, v in _RESTORED[case][name].items():
            want[0, i] += v
        assert torch.equal(opt.state[p]["momentum"], want), (name, opt.state[p]["momentum"])
    # A lone positive DC coefficient decodes to the same positive value on every element: with the sign
    # base, a steps by -lr everywhere. b's aggregate is all zeros: b stays. An aborted round moves nothing.
    assert torch.equal(a.detach(), a0 if case == "aborted" else a0 - _LR)
    assert torch.equal(b.detach(), b0)


# -- the client against a fake coordinator ---------------------------------------------------------------


def _rpc_error(code: grpc.StatusCode, details: str = "", debug: str | None = None) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, debug)


class _FakeStub:
    """Answers Submit, Heartbeat and GetAggregate as the coordinator would, from canned replies."""

    def __init__(self, submit: Any, open_round: int = 3, member: bool = True,
                 aggregate: list[Any] | grpc.aio.AioRpcError | None = None) -> None:
        self.submit, self.open_round, self.member, self.aggregate = submit, open_round, member, aggregate
        self.submitted: list[Any] = []
        self.metadata: Any = None

    async def Submit(self, requests: Iterable[Any], metadata: Any, timeout: float) -> Any:
        self.submitted += list(requests)
        self.metadata = metadata
        if isinstance(self.submit, Exception):
            raise self.submit
        return self.submit

    async def Heartbeat(self, request: Any, metadata: Any, timeout: float) -> Any:
        return pb.HeartbeatReply(round=self.open_round, member=self.member)

    async def GetAggregate(self, request: Any, metadata: Any, timeout: float) -> AsyncIterator[Any]:
        if isinstance(self.aggregate, grpc.aio.AioRpcError):
            raise self.aggregate
        for chunk in self.aggregate or []:
            yield chunk


def _client(stub: _FakeStub) -> GrpcClient:
    client = GrpcClient("127.0.0.1:1", token="tok", peer_id="me", reconnect_timeout_s=0.05)
    client._stub = stub
    return client


def _chunks(round: int, agg: Payload | None, contributors: tuple[str, ...]) -> list[Any]:
    header = pb.AggregateChunk(header=pb.AggregateHeader(round=round, aborted=agg is None,
                                                         contributors=list(contributors)))
    trailer = pb.AggregateChunk(trailer=pb.AggregateTrailer(param_digest="abc"))
    if agg is None:
        return [header, trailer]
    return [header] + [pb.AggregateChunk(part=p)
                       for p in wire.split(wire.encode(agg, step=round), part_bytes=300)] + [trailer]


async def test_gather_submits_parts_and_returns_the_aggregate() -> None:
    _, _, payload = _replica()
    agg = aggregate([payload])
    stub = _FakeStub(pb.SubmitReply(accepted=True), aggregate=_chunks(3, agg, ("me",)))
    client = _client(stub)
    result = await client.gather(3, payload, loss=1.5, param_digest=Digest("pd"))
    await client.close()
    assert {(p.peer_id, p.round, p.param_digest, p.loss) for p in stub.submitted} == {("me", 3, "pd", 1.5)}
    assert dict(stub.metadata)["authorization"] == "Bearer tok"
    assert (result.round, result.contributors, result.aborted) == (3, ("me",), False)
    assert result.param_digest == "" and await result.canonical_digest() == "abc"  # the trailer's
    assert result.bytes_up == len(wire.encode(payload, step=3)) and result.bytes_down == len(wire.encode(agg, step=3))
    assert result.aggregate is not None
    for name, c in agg.tensors.items():  # entropy-coded indices travel sorted by index, the values along
        order = c.idx.argsort(dim=1)
        got = result.aggregate.tensors[name]
        assert torch.equal(got.idx, c.idx.gather(1, order)) and torch.equal(got.val, c.val.gather(1, order))


async def test_gather_with_a_digest_to_follow_streams_the_payload_first_then_the_signed_digest() -> None:
    _, _, payload = _replica()
    digest = Digest.to_follow()
    seen: list[tuple[Any, bool]] = []

    class Ahead(_FakeStub):
        async def Submit(self, requests: Any, metadata: Any, timeout: float) -> Any:
            async for part in requests:
                seen.append((part, digest.is_known))
                if part.HasField("part") and part.part.index == part.part.count - 1:
                    digest.set("pd")  # the round before is settled once the payload is in
            return self.submit

    client = _client(Ahead(pb.SubmitReply(accepted=True), aggregate=_chunks(3, aggregate([payload]), ("me",))))
    result = await client.gather(3, payload, loss=1.5, param_digest=digest)
    await client.close()
    (first, known), (last, _) = seen[0], seen[-1]
    assert not known and first.digest_follows and first.param_digest == "" and first.part.count == len(seen) - 1
    assert all(p.HasField("part") for p, _ in seen[:-1]) and not last.HasField("part") and last.param_digest == "pd"
    statement = submit_statement(b"", "me", 3, first.part.payload_digest, "pd", 1.5)
    assert verify(client.identity.public, last.signature, statement)
    assert verify(client.identity.public, first.signature, submit_statement(b"", "me", 3, first.part.payload_digest,
                                                                            "", 1.5))
    assert (result.round, result.contributors) == (3, ("me",))


async def test_gather_of_an_aborted_round_has_no_aggregate() -> None:
    _, _, payload = _replica()
    client = _client(_FakeStub(pb.SubmitReply(accepted=True), aggregate=_chunks(3, None, ())))
    result = await client.gather(3, payload, loss=1.0, param_digest=Digest("pd"))
    await client.close()
    assert result.aborted and result.aggregate is None and result.bytes_down == 0


def _cut(chunks: list[Any], how: str) -> list[Any]:
    """A GetAggregate stream gone wrong."""
    head, parts, trailer = chunks[0], chunks[1:-1], chunks[-1]
    return {"no trailer": [head, *parts], "trailer before the last part": [head, *parts[:-1], trailer, parts[-1]],
            "two trailers": [head, *parts, trailer, trailer], "no header": [*parts, trailer],
            "trailer alone": [head, trailer]}[how]


@pytest.mark.parametrize("how", ["trailer before the last part", "no header", "trailer alone"])
async def test_gather_refuses_an_aggregate_stream_out_of_order(how: str) -> None:
    _, _, payload = _replica()
    stream = _cut(_chunks(3, aggregate([payload]), ("me",)), how)
    client = _client(_FakeStub(pb.SubmitReply(accepted=True), aggregate=stream))
    with pytest.raises(InvalidPayload, match="GetAggregate"):
        await client.gather(3, payload, loss=1.0, param_digest=Digest("pd"))
    await client.close()


@pytest.mark.parametrize("how", ["no trailer", "two trailers"])
async def test_a_stream_without_one_canonical_digest_after_the_aggregate_leaves_it_unknown(how: str) -> None:
    """The aggregate itself is whole and is returned; the digest that should follow it is refused."""
    _, _, payload = _replica()
    stream = _cut(_chunks(3, aggregate([payload]), ("me",)), how)
    client = _client(_FakeStub(pb.SubmitReply(accepted=True), aggregate=stream))
    result = await client.gather(3, payload, loss=1.0, param_digest=Digest("pd"))
    assert result.aggregate is not None
    with pytest.raises(InvalidPayload, match="GetAggregate"):
        await result.canonical_digest()
    await client.close()


@pytest.mark.parametrize(("stub", "error"), [
    (_FakeStub(pb.SubmitReply(accepted=False, resync=True, refusal=pb.REFUSAL_RESYNC, reason="digest")), Resync),
    (_FakeStub(pb.SubmitReply(accepted=False, refusal=pb.REFUSAL_STALE, open_round=4,
                              reason="round 3 is closed; the open round is 4"), open_round=4), StaleRound),
    (_FakeStub(pb.SubmitReply(accepted=False, refusal=pb.REFUSAL_NOT_MEMBER, reason="me is not a member of round 3"),
               member=False), NotMember),
    (_FakeStub(pb.SubmitReply(accepted=True), aggregate=_rpc_error(grpc.StatusCode.NOT_FOUND, "too old"),
               open_round=9), StaleRound),
    (_FakeStub(pb.SubmitReply(accepted=True), aggregate=[]), InvalidPayload),
    (_FakeStub(_rpc_error(grpc.StatusCode.UNAVAILABLE, "down")), PeerUnavailable),
    (_FakeStub(_rpc_error(grpc.StatusCode.UNAUTHENTICATED, "bad token")), PermissionError),
    (_FakeStub(pb.SubmitReply(accepted=False, refusal=pb.REFUSAL_INVALID, reason="invalid payload: bad")),
     RuntimeError),  # our bug: crash
])
async def test_gather_maps_refusals_to_what_the_peer_does(stub: _FakeStub, error: type[Exception]) -> None:
    _, _, payload = _replica()
    client = _client(stub)
    with pytest.raises(error) as info:
        await client.gather(3, payload, loss=1.0, param_digest=Digest("pd"))
    await client.close()
    if isinstance(info.value, StaleRound):
        assert info.value.open_round == stub.open_round


async def test_a_resubmission_already_taken_counts_as_accepted() -> None:
    _, _, payload = _replica()
    stub = _FakeStub(pb.SubmitReply(accepted=False, refusal=pb.REFUSAL_DUPLICATE, reason="me already submitted"),
                     aggregate=_chunks(3, aggregate([payload]), ("me",)))
    client = _client(stub)
    assert (await client.gather(3, payload, loss=1.0, param_digest=Digest("pd"))).contributors == ("me",)
    await client.close()


async def test_unavailable_is_retried_with_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpc_retry, "BACKOFF_FIRST_S", 0.001)
    client = GrpcClient("127.0.0.1:1", token="tok", reconnect_timeout_s=5.0)
    calls = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE if len(calls) % 2 else grpc.StatusCode.DEADLINE_EXCEEDED)
        return "ok"

    assert await client._call("Flaky", flaky) == "ok"
    assert len(calls) == 4
    with pytest.raises(grpc.aio.AioRpcError):  # anything else is not retried
        await client._call("Bug", lambda: _raise(_rpc_error(grpc.StatusCode.INTERNAL)))
    await client.close()


async def test_a_stream_write_that_failed_as_its_call_ended_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Submit stream cut by a coordinator killed mid-call can end as INTERNAL "Internal error from Core"
    (a failed send in the debug string) instead of UNAVAILABLE: tried again, not a crash of the peer.
    Another INTERNAL is a bug and propagates."""
    monkeypatch.setattr(grpc_retry, "BACKOFF_FIRST_S", 0.001)
    client = GrpcClient("127.0.0.1:1", token="tok", reconnect_timeout_s=5.0)
    cut = _rpc_error(grpc.StatusCode.INTERNAL, "Internal error from Core",
                     'Failed "execute_batch": (<grpc._cython.cygrpc.SendMessageOperation object at 0x7f83f59f7ab0>,)')
    calls = []

    async def killed_then_back() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise cut
        return "ok"

    assert await client._call("Submit(3)", killed_then_back) == "ok" and len(calls) == 2
    other = _rpc_error(grpc.StatusCode.INTERNAL, "Internal error from Core", 'Failed "execute_batch": '
                       "(<grpc._cython.cygrpc.ReceiveMessageOperation object at 0x7f83f59f7ab0>,)")
    for error in (other, _rpc_error(grpc.StatusCode.INTERNAL, "serialization failed")):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client._call("Bug", lambda e=error: _raise(e))
        assert raised.value is error
    await client.close()


async def test_the_outage_is_timed_from_the_first_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long first attempt (a stream that waited for its round) does not use up reconnect_timeout_s."""
    monkeypatch.setattr(grpc_retry, "BACKOFF_FIRST_S", 0.01)
    client = GrpcClient("127.0.0.1:1", token="tok", reconnect_timeout_s=0.3)
    calls = []

    async def slow_then_ok() -> str:
        calls.append(1)
        if len(calls) == 1:
            await asyncio.sleep(0.5)
            raise _rpc_error(grpc.StatusCode.CANCELLED)
        return "ok"

    assert await client._call("Slow", slow_then_ok) == "ok" and len(calls) == 2
    await client.close()


async def test_gives_up_after_reconnect_timeout_and_a_refused_token_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpc_retry, "BACKOFF_FIRST_S", 0.01)
    client = GrpcClient("127.0.0.1:1", token="tok", reconnect_timeout_s=0.3)
    calls: list[float] = []

    async def down() -> None:
        calls.append(time.monotonic())
        raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "no route")

    with pytest.raises(PeerUnavailable, match=r"Join: .* unreachable for 0 s \(last: UNAVAILABLE no route\)"):
        await client._call("Join", down)
    assert len(calls) >= 3  # backed off 0.01, 0.02, 0.04 ... s and tried again meanwhile
    assert 0.25 <= calls[-1] - calls[0] <= 0.3 + 0.2  # the last try is made at the give-up time, not later
    assert all(b - a <= 0.3 for a, b in zip(calls, calls[1:], strict=False))

    codes = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED]  # a restarted coordinator, new token

    async def refused() -> None:
        raise _rpc_error(codes.pop(0), "bad token")

    with pytest.raises(PermissionError, match="refused the call"):
        await client._call("Join", refused)
    assert codes == []
    await client.close()


async def _raise(error: Exception) -> None:
    raise error


# -- the peer's round loop against a fake client ---------------------------------------------------------


class _FakeClient:
    """The coordinator's side of a few rounds: canned outcomes for gather, parameters for any round."""

    peer_id = "me"

    def __init__(self, outcomes: list[Any], params: dict[str, torch.Tensor]) -> None:
        self.outcomes, self.params = outcomes, params
        self.asked: list[int] = []
        self.resyncs: list[int] = []
        """The rounds whose parameters were asked for as a resync (the coordinator counts those)."""
        self.joins = 0

    digest_follows = False

    async def gather(self, round: int, payload: Payload, *, loss: float, param_digest: Any,
                     samples: int = 1, pace: Any = None) -> RoundResult:
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return RoundResult(round=round, aggregate=aggregate([payload]), contributors=("me",), param_digest=outcome,
                           aborted=False, bytes_up=10, bytes_down=12)

    async def get_parameters(self, round: int, expected: Any, *, resync: bool = False
                             ) -> tuple[int, dict[str, torch.Tensor], int]:
        self.asked.append(round)
        if resync:
            self.resyncs.append(round)
        return round, {name: t + 0.01 * round for name, t in self.params.items()}, 1

    async def join(self) -> JoinInfo:
        self.joins += 1
        return _info(round=9)

    async def heartbeat(self, round: int) -> tuple[int, bool]:
        return round, True  # the run's open round is the peer's: on time


def _info(round: int) -> JoinInfo:
    run = {"model": {"d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 16},
           "train": {"seq_len": 16, "batch_size": 2}, "optim": {"compression_topk": 4, "compression_chunk": 8}}
    return JoinInfo(peer_id="me", round=round, run_config=run, data_seed=7, round_timeout_s=5.0,
                    heartbeat_interval_s=1.0, total_rounds=0)


def _peer(outcomes: list[Any], tmp_path: Path) -> tuple[Any, _FakeClient]:
    from demonet.config import load_config
    from demonet.loop import RoundLoop
    from demonet.train.model import GPT
    from demonet.train.trainer import Trainer
    from demonet.transport.coordinated import CoordinatorMembership

    cfg = load_config(None, {}, _info(0).run_config)
    params = {name: p.detach().clone() for name, p in GPT(cfg.model).named_parameters()}
    client = _FakeClient(outcomes, params)
    trainer = Trainer.for_run(cfg, data_seed=7, device=torch.device("cpu"), checkpoint=tmp_path / "peer-me.pt")
    peer = RoundLoop(trainer, CoordinatorMembership(client), client, "me", None, 0)  # type: ignore[arg-type]
    return peer, client


async def _load(peer: Any, round: int) -> None:
    await peer.load_parameters(await peer.membership.parameters(round, peer.replica.expected()))


async def test_peer_catches_up_after_each_kind_of_refusal(tmp_path: Path) -> None:
    import io

    peer, client = _peer([Resync("digest"), StaleRound("late", open_round=7), NotMember("dropped")], tmp_path)
    await _load(peer, 3)
    metrics = io.StringIO()
    for _ in range(3):
        assert await peer.run_round(metrics)
    assert client.asked == [3, 3, 7, 9] and client.joins == 1 and peer.round == 9
    assert metrics.getvalue() == ""  # no round completed
    # Told to resync at its Submit: the coordinator counted it there, so the download does not say so
    # again; the peer counts it (its next row carries it). Being late or dropped is no resync.
    assert client.resyncs == [] and peer.resyncs == 1


async def test_peer_resyncs_when_its_digest_differs_after_applying(tmp_path: Path) -> None:
    import io

    from demonet.wire.digest import param_digest

    peer, client = _peer([], tmp_path)
    await _load(peer, 3)
    # "": no canonical digest to compare with (as in DHT mode); then one that differs; then none again.
    client.outcomes = ["", "not-the-digest-after-applying", ""]
    metrics = io.StringIO()
    assert await peer.run_round(metrics)
    state = peer.replica.opt.state
    momentum_before = [state[p]["momentum"].clone() for p in peer.replica.model.parameters()]
    assert await peer.run_round(metrics)
    assert peer.digest == param_digest(peer.replica.model.named_parameters())
    downloaded = peer.digest
    moved = [not torch.equal(a, peer.replica.opt.state[p]["momentum"])
             for a, p in zip(momentum_before, peer.replica.model.parameters(), strict=True)]
    assert any(moved)  # the round's gradient went into the momentum
    assert await peer.run_round(metrics)
    first, line, after = (json.loads(row) for row in metrics.getvalue().splitlines())
    assert (first["round"], first["resyncs"], "resynced" in first) == (3, 0, False)
    assert (line["round"], line["resynced"], line["resyncs"], line["param_digest"]) == (4, True, 1, downloaded)
    assert (after["round"], after["resyncs"], "resynced" in after) == (5, 1, False)  # the count is cumulative
    assert (peer.round, client.asked, client.resyncs) == (6, [3, 5], [5])  # the download says it is a resync
    peer._save()
    saved = torch.load(tmp_path / "peer-me.pt", weights_only=True)
    assert saved["round"] == 6 and saved["resyncs"] == 1
    restarted, _ = _peer([], tmp_path)  # the same peer id and folder: its rows go on counting from 1
    restarted._resume()
    assert restarted.resyncs == 1
