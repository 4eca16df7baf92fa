"""The coordinator as a real process on loopback, driven by raw gRPC clients: auth, bad input,
stragglers, and kill -9 with a restart from the persisted state."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet._proto import demonet_pb2_grpc as pbg
from demonet.config import Config
from demonet.coordinator.state import STATE_FILE
from demonet.optim import DeMo, LrSchedule
from demonet.train.data import Batches, load_corpus
from demonet.train.model import GPT
from demonet.transport.grpc import GrpcClient
from demonet.wire import params as wire_params
from demonet.wire.digest import param_digest
from demonet.wire.identity import Identity
from demonet.wire.signed import (
    aggregate_request,
    join_request,
    parameters_request,
    submit_parts,
    task_files_request,
)
from tests.integration.common import tiny_config
from tests.procs import Reaper, free_port

pytestmark = pytest.mark.slow

TOKEN = "test-token"


class Coordinator:
    """A `demonet coordinator` child process; `reaper` kills it at the end."""

    def __init__(self, tmp: Path, reaper: Reaper, timeout_s: float = 3.0, extra: tuple[str, ...] = ()) -> None:
        self.tmp, self.reaper = tmp, reaper
        self.extra = extra
        (tmp / "run.toml").write_text(tiny_config(round_timeout_s=timeout_s, steps=50, heartbeat_timeout_s=30.0))
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""

    def start(self) -> str:
        self.proc = self.reaper.add(subprocess.Popen(
            [sys.executable, "-m", "demonet.coordinator", "--listen", "127.0.0.1:0", "--config",
             str(self.tmp / "run.toml"), "--state-dir", str(self.tmp / "state"), *self.extra],
            stdout=subprocess.PIPE, stderr=self.reaper.open(self.tmp / "coordinator.log", "a"), text=True,
            env={**os.environ, "DEMONET_TOKEN": TOKEN}))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # blocks until the server is up (or the process died)
        assert line.startswith("listening on "), (self.tmp / "coordinator.log").read_text()
        self.address = line.split()[-1]
        return self.address

    def kill(self) -> None:
        """SIGKILL: nothing is flushed on the way out."""
        if self.proc is not None:
            self.reaper.kill(self.proc)

    def wait_saved(self, round_: int, timeout_s: float = 30.0) -> None:
        """Wait until the state file starts round `round_`: the coordinator publishes a round, then
        writes its state in the background."""
        path = self.tmp / "state" / STATE_FILE
        deadline = time.monotonic() + timeout_s
        while not (path.exists() and torch.load(path, weights_only=False)["rounds"]["round"] >= round_):
            assert time.monotonic() < deadline, f"the state of round {round_} was not written in {timeout_s} s"
            time.sleep(0.02)


@pytest.fixture
def coordinator(tmp_path: Path, reap_children: Reaper) -> Coordinator:
    c = Coordinator(tmp_path, reap_children)
    c.start()
    return c


@dataclass(frozen=True)
class Closed:
    """A GetAggregate stream's header and its trailer's canonical digest."""

    round: int
    aborted: bool
    contributors: tuple[str, ...]
    param_digest: str


class Peer:
    """A minimal honest peer, written against the protocol (demonet.peer is the real one)."""

    def __init__(self, address: str, peer_id: str, identity: Identity | None = None) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pbg.CoordinatorStub(self.channel)  # type: ignore[no-untyped-call]
        self.peer_id = peer_id
        self.md = (("authorization", f"Bearer {TOKEN}"),)
        self.identity = identity or Identity.generate()
        self.session = b""
        self.counter = 0  # the session's last counter: each counted request takes the next

    def next(self) -> int:
        self.counter += 1
        return self.counter

    async def join(self, *, load: bool = True) -> int:
        """Join the run; then (with `load`) download the parameters of the round it joins at, which waits
        for that round to open."""
        challenge = await self.stub.Challenge(pb.ChallengeRequest(peer_id=self.peer_id,
                                                                  public_key=self.identity.public),
                                              metadata=self.md, timeout=10)
        reply = await self.stub.Join(join_request(self.identity, self.peer_id, challenge.nonce), metadata=self.md,
                                     timeout=10)
        self.session, self.counter = reply.session, 0
        cfg = Config.from_dict(json.loads(reply.run_config))
        self.model = GPT(cfg.model)
        self.opt = DeMo(self.model.named_parameters(), lr=cfg.optim.lr)
        self.lr = LrSchedule.from_settings(cfg.optim, cfg.train.steps)  # round r's apply, as the coordinator's
        self.batches = Batches(load_corpus(), batch_size=2, seq_len=32, seed=reply.data_seed)
        if load:
            await self.load_parameters(reply.round)
        return int(reply.round)

    async def load_parameters(self, round_: int) -> int:
        parts = wire.Reassembler()
        data = None
        request = parameters_request(self.identity, self.session, self.peer_id, round_, self.next())
        async for part in self.stub.GetParameters(request, metadata=self.md, timeout=30):
            data = parts.add(part)
        expected = {n: (tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()}
        assert data is not None
        got_round, tensors = wire_params.decode_parameters(data, expected=expected)
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(tensors[n])
        return got_round

    def digest(self) -> str:
        return param_digest(self.model.named_parameters())

    async def submit_bytes(self, round_: int, data: bytes, digest: str | None = None) -> pb.SubmitReply:
        parts = submit_parts(self.identity, self.session, self.peer_id, round_, data,
                             param_digest=digest or self.digest(), loss=1.0)
        return await self.stub.Submit(iter(parts), metadata=self.md, timeout=30)

    async def step(self, round_: int) -> tuple[pb.SubmitReply, Closed]:
        x, y = next(self.batches)
        _, loss = self.model(x, y)
        assert loss is not None
        loss.backward()
        payload = self.opt.compress()
        reply = await self.submit_bytes(round_, wire.encode(payload, step=round_))
        header, agg = await self.aggregate(round_)
        if header.aborted or agg is None:
            self.opt.restore(payload)
        else:
            self.opt.restore(payload, kept=agg) if self.peer_id in header.contributors else self.opt.restore(payload)
            self.opt.apply(agg, lr=self.lr(round_))
        self.opt.zero_grad()
        return reply, header

    async def aggregate(self, round_: int, *, submitting: bool = False) -> tuple[Closed, object]:
        header, data, digest, parts = None, None, None, wire.Reassembler()
        request = aggregate_request(self.identity, self.session, self.peer_id, round_, self.next(),
                                    submitting=submitting)
        async for chunk in self.stub.GetAggregate(request, metadata=self.md, timeout=60):
            kind = chunk.WhichOneof("kind")
            if kind == "header":
                header = chunk.header
            elif kind == "part":
                data = parts.add(chunk.part)
            else:
                assert kind == "trailer" and digest is None, kind
                digest = chunk.trailer.param_digest
        assert header is not None and digest, "a stream ends with the trailer and its digest"
        agg = wire.decode(data, expected=self.opt.param_specs())[1] if data else None
        return Closed(header.round, header.aborted, tuple(header.contributors), digest), agg

    async def status(self) -> pb.StatusReply:
        return await self.stub.Status(pb.StatusRequest(), metadata=self.md, timeout=10)


async def _a_and_b(address: str) -> tuple[Peer, Peer]:
    """Peers a (a member from round 0, which it trains alone) and b (a member from round 1), both at round 1."""
    a, b = Peer(address, "a"), Peer(address, "b")
    assert await a.join() == 0
    assert await b.join(load=False) == 1
    await a.step(0)
    await b.load_parameters(1)
    return a, b


async def test_every_rpc_refuses_a_wrong_or_missing_token(coordinator: Coordinator) -> None:
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        stub = pbg.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        for md in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
            calls = (stub.Join(pb.JoinRequest(peer_id="x"), metadata=md, timeout=5),
                     stub.Heartbeat(pb.HeartbeatRequest(peer_id="x"), metadata=md, timeout=5),
                     stub.Status(pb.StatusRequest(), metadata=md, timeout=5))
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="demonet.v1.Coordinator"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING  # the health check needs no token


@pytest.fixture
def slow_rounds(tmp_path: Path, reap_children: Reaper) -> Coordinator:
    """A coordinator whose rounds last long enough for several calls in one round on a busy machine."""
    c = Coordinator(tmp_path, reap_children, timeout_s=10.0)
    c.start()
    return c


async def test_bad_payloads_are_rejected_and_change_nothing(slow_rounds: Coordinator) -> None:
    coordinator = slow_rounds
    honest, evil = Peer(coordinator.address, "honest"), Peer(coordinator.address, "evil")
    assert await honest.join() == 0
    assert await evil.join(load=False) == 1
    await honest.step(0)  # round 1 opens with both as members
    await evil.load_parameters(1)
    before = await honest.status()
    x, y = next(evil.batches)
    evil.model(x, y)[1].backward()  # type: ignore[union-attr]
    good = wire.encode(evil.opt.compress(), step=1)
    bad = [
        good[:-7],  # truncated
        bytes(b ^ 0x55 for b in good),  # garbage
        wire.encode(evil.opt.compress(), step=7),  # names another round inside
    ]
    for data in bad:
        reply = await evil.submit_bytes(1, data)
        assert not reply.accepted and "invalid payload" in reply.reason
    reply = await evil.submit_bytes(1, good, digest="0" * 32)
    assert not reply.accepted and reply.resync
    reply = await evil.submit_bytes(0, wire.encode(evil.opt.compress(), step=0))
    assert not reply.accepted and "closed" in reply.reason  # a stale round
    after = await honest.status()
    assert (after.round, after.submitted, after.param_digest) == (before.round, 0, before.param_digest)
    assert after.rejected == before.rejected + len(bad)
    assert (await evil.submit_bytes(1, good)).accepted  # the refusals left its round open to its good payload
    reply, header = await honest.step(1)
    assert reply.accepted and list(header.contributors) == ["evil", "honest"]
    assert honest.digest() == header.param_digest


async def test_a_member_with_other_parameters_resyncs_and_each_resync_is_counted_once(
        slow_rounds: Coordinator) -> None:
    """Both ways a resync reaches the coordinator (a Submit refused for its digest; a GetParameters of a
    peer whose digest differed after applying) count once each in `demonet_resyncs`, are logged, and
    survive a restart."""
    coordinator = slow_rounds
    a, b = await _a_and_b(coordinator.address)
    assert (await a.status()).resyncs == 0
    x, y = next(b.batches)
    b.model(x, y)[1].backward()  # type: ignore[union-attr]
    data = wire.encode(b.opt.compress(), step=1)
    for _ in range(2):  # the second is the same refusal again (a peer that did not download), not a resync
        reply = await b.submit_bytes(1, data, digest="0" * 32)
        assert not reply.accepted and reply.resync and reply.refusal == pb.REFUSAL_RESYNC
    assert (await a.status()).resyncs == 1
    b.opt.zero_grad()
    b_step = asyncio.create_task(b.step(1))  # b's first: a member with no payload accepted yet is not waited on
    while (await a.status()).submitted < 1:
        await asyncio.sleep(0.05)
    (_, header), _ = await asyncio.gather(a.step(1), b_step)
    assert sorted(header.contributors) == ["a", "b"]
    # b's digest after applying round 1 differs (so it says): it downloads round 2's parameters.
    client = GrpcClient(coordinator.address, token=TOKEN, peer_id="b", identity=b.identity)
    await client.join()  # b again, with its key: a member's join changes only its session
    expected = {n: (tuple(p.shape), p.dtype) for n, p in b.model.named_parameters()}
    for _ in range(2):  # a retried call is the same resync
        got, tensors, _ = await client.get_parameters(2, expected, resync=True)
        assert got == 2 and param_digest(tensors.items()) == a.digest()
    await client.get_parameters(2, expected)  # a download that is no resync (a late peer, a joiner)
    assert (await client.status()).resyncs == 2
    b.session, b.counter = client._session, client._counter  # the join gave b's key a new session
    await client.close()
    log = (coordinator.tmp / "coordinator.log").read_text()
    assert "WARNING" in log and "b resyncs at round 1 (resync 1 of the run)" in log, log
    assert "b resyncs at round 2 (resync 2 of the run)" in log and "resync 3" not in log, log
    await asyncio.gather(a.step(2), b.step(2))  # the counters are persisted when a round closes
    coordinator.wait_saved(3)
    coordinator.kill()
    a = Peer(coordinator.start(), "a")
    assert (await a.status()).resyncs == 2


async def test_a_get_aggregate_beside_its_submit_waits_for_the_payload_and_gets_the_close(
        slow_rounds: Coordinator) -> None:
    """A member without a payload in the open round is refused a plain GetAggregate (FAILED_PRECONDITION: a
    restarted coordinator lost it, submit it again); with `submitting` (its Submit is on its way beside the
    call) the call waits, and once the round closes it gets the aggregate with that payload in it, the
    same bytes and canonical digest as a call made after the Submit."""
    coordinator = slow_rounds
    a, b = await _a_and_b(coordinator.address)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await b.aggregate(1)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no payload from b for round 1: submit it again" in (refused.value.details() or "")

    beside = asyncio.create_task(b.aggregate(1, submitting=True))
    await asyncio.sleep(0.5)
    assert not beside.done(), "the call waits for the round's close"
    assert (await a.status()).submitted == 0, "the call is no submission"
    payloads = []
    for peer in (b, a):  # b first: a member with no payload accepted yet is not waited on
        x, y = next(peer.batches)
        peer.model(x, y)[1].backward()  # type: ignore[union-attr]
        payloads.append(peer.opt.compress())
        reply = await peer.submit_bytes(1, wire.encode(payloads[-1], step=1))
        assert reply.accepted, reply.reason
    header, agg = await asyncio.wait_for(beside, 30)
    after, agg_after = await a.aggregate(1)  # the same round, asked for after the Submit
    assert header == after and header.contributors == ("a", "b") and not header.aborted
    assert agg is not None and agg_after is not None
    assert all(torch.equal(agg.tensors[n].val, agg_after.tensors[n].val)  # type: ignore[attr-defined]
               and torch.equal(agg.tensors[n].idx, agg_after.tensors[n].idx)  # type: ignore[attr-defined]
               for n in agg.tensors)  # type: ignore[attr-defined]
    for peer, payload in zip((a, b), payloads, strict=True):
        peer.opt.restore(payload, kept=agg)
        peer.opt.apply(agg, lr=peer.lr(1))
    assert a.digest() == b.digest() == header.param_digest


async def test_requests_that_do_not_parse_get_a_clear_error_and_change_nothing(coordinator: Coordinator) -> None:
    honest = Peer(coordinator.address, "honest")
    assert await honest.join() == 0
    before = await honest.status()
    junk = b"\xff\xff\xff\xff\x0f"  # a truncated varint: no protobuf message parses from it
    md = honest.md
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        for method, message in (("Join", "JoinRequest"), ("Heartbeat", "HeartbeatRequest"),
                                ("Status", "StatusRequest"), ("Leave", "LeaveRequest")):
            call = channel.unary_unary(f"/demonet.v1.Coordinator/{method}")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(junk, metadata=md, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert f"not a valid {message} message" in (err.value.details() or "")
        for method, message in (("GetParameters", "ParametersRequest"), ("GetAggregate", "AggregateRequest"),
                                ("GetTaskFiles", "TaskFilesRequest")):
            stream = channel.unary_stream(f"/demonet.v1.Coordinator/{method}")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stream(junk, metadata=md, timeout=10):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert f"not a valid {message} message" in (err.value.details() or "")
        submit = channel.stream_unary("/demonet.v1.Coordinator/Submit")
        raw = await submit(iter([junk]), metadata=md, timeout=10)
        reply = pb.SubmitReply.FromString(raw)
        assert not reply.accepted and reply.refusal == pb.REFUSAL_INVALID
        assert "not a valid SubmitPart message" in reply.reason
        # A well-formed request far larger than its message can need is refused unparsed: by the parser past
        # 4096 bytes, by gRPC itself past the largest message of the run (one part of its largest payload).
        for size, code, said in ((8_000, grpc.StatusCode.INVALID_ARGUMENT, "more than the 4096 it can need"),
                                 (100_000, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")):
            huge = pb.JoinRequest(peer_id="x" * size).SerializeToString()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary("/demonet.v1.Coordinator/Join")(huge, metadata=md, timeout=10)
            assert err.value.code() == code and said in (err.value.details() or ""), err.value
        # Without the token the answer is the token's, whatever the bytes.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await channel.unary_unary("/demonet.v1.Coordinator/Status")(junk, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    after = await honest.status()
    assert (after.round, after.members, after.param_digest) == (before.round, before.members, before.param_digest)
    assert after.rejected == before.rejected + 9
    assert "Exception deserializing" not in (coordinator.tmp / "coordinator.log").read_text()


async def test_get_task_files_is_a_joined_keys_call_and_a_gpt_run_ships_none(coordinator: Coordinator) -> None:
    peer = Peer(coordinator.address, "asker")
    await peer.join(load=False)
    probe = await peer.stub.Join(pb.JoinRequest(peer_id="asker", probe=True, protocol=wire_params.PROTOCOL),
                                 metadata=peer.md, timeout=10)
    assert list(probe.task_files) == []  # the built-in task is built from the run config alone
    for identity, code in ((Identity.generate(), grpc.StatusCode.PERMISSION_DENIED),  # another key's signature
                           (peer.identity, grpc.StatusCode.NOT_FOUND)):
        request = task_files_request(identity, peer.session, peer.peer_id, peer.next())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in peer.stub.GetTaskFiles(request, metadata=peer.md, timeout=10):
                pass
        assert err.value.code() == code, err.value
    assert "ships no task files" in (err.value.details() or "")


async def test_coordinator_killed_and_restarted_resumes(coordinator: Coordinator) -> None:
    peer = Peer(coordinator.address, "p")
    assert await peer.join() == 0
    for r in range(3):
        await peer.step(r)
    digest = peer.digest()
    coordinator.wait_saved(3)  # the kill at a moment a crash loses rounds: tests/integration/test_persist.py
    coordinator.kill()  # SIGKILL: nothing is flushed on the way out
    address = coordinator.start()
    with pytest.raises(grpc.aio.AioRpcError) as refused:  # the id is still bound to p's key after the restart
        await Peer(address, "p").join()
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED and "belongs to another key" in str(refused.value)
    peer = Peer(address, "p", identity=peer.identity)
    assert await peer.join() == 3  # a member reconnecting resumes the open round
    status = await peer.status()
    assert status.round == 3 and status.param_digest == digest and status.rounds_closed == 3
    assert peer.digest() == digest
    reply, header = await peer.step(3)
    assert reply.accepted and header.round == 3 and peer.digest() == header.param_digest


async def test_a_run_ends_after_its_rounds(tmp_path: Path, reap_children: Reaper) -> None:
    c = Coordinator(tmp_path, reap_children)
    (tmp_path / "run.toml").write_text(tiny_config(round_timeout_s=3.0, steps=2, heartbeat_timeout_s=30.0))
    c.start()
    peer = Peer(c.address, "p")
    await peer.join()
    for r in range(2):
        await peer.step(r)
    assert c.proc is not None
    start = time.monotonic()
    c.proc.send_signal(signal.SIGTERM)  # graceful: stops serving at once instead of lingering
    assert c.proc.wait(timeout=20) == 0
    assert time.monotonic() - start < 15
    saved = torch.load(tmp_path / "state" / STATE_FILE, weights_only=False)  # the last round's, before the exit
    assert saved["rounds"]["round"] == 2 and saved["digest"] == peer.digest()


async def test_prometheus_metrics(tmp_path: Path, reap_children: Reaper) -> None:
    import urllib.request

    port = free_port()
    c = Coordinator(tmp_path, reap_children, extra=("--metrics-port", str(port)))
    c.start()
    peer = Peer(c.address, "p")
    await peer.join()
    await peer.step(0)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("demonet_") and " " in line}
    assert values["demonet_round"] == 1 and values["demonet_members"] == 1 and values["demonet_phase"] == 0
    assert values["demonet_rounds_closed_total"] == 1 and values["demonet_bytes_up_total"] > 0
    assert values["demonet_resyncs_total"] == 0
    for name in ("demonet_loss", "demonet_rejected_total", "demonet_late_total", "demonet_bytes_down_total",
                 "demonet_close_seconds_count", "demonet_submitted", "demonet_unauthorized_total",
                 "demonet_persist_seconds_count", "demonet_persisted_round", "demonet_persist_failures_total"):
        assert name in values
