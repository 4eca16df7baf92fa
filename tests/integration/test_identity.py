"""Per-peer keys against a real coordinator process and real `demonet peer` processes on loopback.

Nobody speaks for another peer id: an intruder holding the run token and a key of its own cannot join,
heartbeat, download or submit as an honest peer, and a replayed signed submit is refused. Under the
allowlist policy unknown keys are refused at their challenge and a key removed from the file (SIGHUP) is
dropped; under the open policy no token is needed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet._proto import demonet_pb2_grpc as pbg
from demonet.transport.grpc import GrpcClient
from demonet.wire.identity import Identity, public_text
from demonet.wire.signed import heartbeat_request, join_request, parameters_request, submit_parts
from tests.integration.common import listening_line, metrics_rows, tiny_config
from tests.integration.test_coordinator import TOKEN, Peer
from tests.procs import Reaper

pytestmark = pytest.mark.slow


class _Run:
    """A coordinator process and `demonet peer` processes, each with its own key file."""

    def __init__(self, tmp: Path, reaper: Reaper, *, steps: int, **net: str | float) -> None:
        self.tmp, self.reaper = tmp, reaper
        (tmp / "run.toml").write_text(tiny_config(round_timeout_s=5.0, steps=steps, heartbeat_timeout_s=6.0,
                                                  **net))  # type: ignore[arg-type]
        self.coordinator = reaper.add(subprocess.Popen(
            [sys.executable, "-m", "demonet", "coordinator", "--listen", "127.0.0.1:0", "--config",
             str(tmp / "run.toml"), "--start-peers", "2"],
            stdout=subprocess.PIPE, stderr=reaper.open(tmp / "coordinator.log", "w"),
            env={**os.environ, "DEMONET_TOKEN": TOKEN}))
        line = listening_line(self.coordinator, 60.0)
        assert line.startswith("listening on "), self.log("coordinator")
        self.address = line.split()[-1]
        self.peers: dict[str, subprocess.Popen[bytes]] = {}

    def key(self, peer_id: str) -> Identity:
        return Identity.load_or_create(self.tmp / f"{peer_id}.key")

    def peer(self, peer_id: str) -> None:
        self.peers[peer_id] = self.reaper.add(subprocess.Popen(
            [sys.executable, "-m", "demonet", "peer", "--coordinator", self.address, "--peer-id", peer_id,
             "--out", str(self.tmp / "out"), "--key", str(self.tmp / f"{peer_id}.key"), "--threads", "1"],
            stdout=subprocess.DEVNULL, stderr=self.reaper.open(self.tmp / f"{peer_id}.log", "w"),
            env={**os.environ, "DEMONET_TOKEN": TOKEN}))

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def rounds(self, peer_id: str) -> list[int]:
        return [r["round"] for r in metrics_rows(self.tmp / "out", peer_id)]

    async def members(self) -> dict[str, str | None]:
        """id -> key fingerprint of the run's members, from the status document (no key needed to read it)."""
        client = GrpcClient(self.address, token=TOKEN)
        try:
            doc = await client.status_document()
        finally:
            await client.close()
        return {m["id"]: m["key"] for m in doc["members"] if m["state"] in ("member", "submitted", "joining")}

    async def wait(self, what: str, check: object, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not await check():  # type: ignore[operator]
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.2)

    def finish(self, timeout_s: float = 120.0) -> list[int | None]:
        codes = []
        for proc in self.peers.values():
            try:
                codes.append(proc.wait(timeout=timeout_s))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes


async def _refused(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call  # type: ignore[misc]
    return err.value.code()


async def test_an_intruder_with_the_token_and_its_own_key_cannot_speak_for_another_peer(
        tmp_path: Path, reap_children: Reaper) -> None:
    run = _Run(tmp_path, reap_children, steps=40)
    honest = {p: run.key(p) for p in ("p0", "p1")}
    for p in honest:
        run.peer(p)

    async def both_in() -> bool:
        return set(await run.members()) >= {"p0", "p1"}

    await run.wait("both honest peers to join", both_in)
    members = await run.members()
    assert members["p1"] == honest["p1"].fingerprint  # status lists members by key

    thief = Peer(run.address, "thief")  # a member in its own name, with its own key
    first = await thief.join()
    stub, md, key = thief.stub, thief.md, thief.identity
    # As p1: no challenge for p1 with another key, no signed call under p1 with this key.
    code = await _refused(stub.Challenge(pb.ChallengeRequest(peer_id="p1", public_key=key.public), metadata=md))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    nonce = (await stub.Challenge(pb.ChallengeRequest(peer_id="thief", public_key=key.public), metadata=md)).nonce
    forged = join_request(key, "p1", nonce)  # its own challenge's nonce, under p1's id
    assert await _refused(stub.Join(forged, metadata=md)) == grpc.StatusCode.PERMISSION_DENIED
    assert await _refused(stub.Heartbeat(heartbeat_request(key, thief.session, "p1", first, 1), metadata=md)) \
        == grpc.StatusCode.PERMISSION_DENIED
    call = stub.GetParameters(parameters_request(key, thief.session, "p1", first, 2), metadata=md)
    assert await _refused(call.read()) == grpc.StatusCode.PERMISSION_DENIED
    payload = wire.encode(thief.opt.compress(), step=first)
    as_p1 = submit_parts(key, thief.session, "p1", first, payload, param_digest=thief.digest(), loss=1.0)
    assert await _refused(stub.Submit(iter(as_p1), metadata=md)) == grpc.StatusCode.PERMISSION_DENIED
    unsigned = [pb.SubmitPart(peer_id="p1", round=first, param_digest=thief.digest(), loss=1.0, part=part)
                for part in wire.split(payload)]
    assert await _refused(stub.Submit(iter(unsigned), metadata=md)) == grpc.StatusCode.PERMISSION_DENIED

    client = GrpcClient(run.address, token=TOKEN)
    refusals = [(r["peer"], r["kind"]) for r in (await client.status_document())["refusals"]]
    await client.close()
    assert ("p1", "join") in refusals and refusals.count(("p1", "signature")) == 4, refusals  # shown, with reasons
    await thief.channel.close()  # it leaves (silent: dropped after the heartbeat timeout)

    codes = run.finish()
    assert codes == [0, 0], run.log("p0") + run.log("p1")
    for p in honest:  # every honest peer trained every round from its first to the last, in its own name
        rounds = run.rounds(p)
        assert rounds == list(range(rounds[0], 40)), (p, rounds)
    log = run.log("coordinator")
    assert "refused a challenge for p1: peer id 'p1' belongs to another key" in log and "does not verify" in log, log


async def test_a_replayed_or_second_signed_submit_is_refused(tmp_path: Path, reap_children: Reaper) -> None:
    run = _Run(tmp_path, reap_children, steps=10)
    a, b = Peer(run.address, "a"), Peer(run.address, "b")
    assert await asyncio.gather(a.join(), b.join()) == [0, 0]
    stub, md, key = a.stub, a.md, a.identity
    x, y = next(a.batches)
    a.model(x, y)[1].backward()  # type: ignore[union-attr]
    payload = wire.encode(a.opt.compress(), step=0)
    mine = submit_parts(key, a.session, "a", 0, payload, param_digest=a.digest(), loss=1.0)
    assert (await stub.Submit(iter(mine), metadata=md)).accepted
    again = await stub.Submit(iter(mine), metadata=md)  # the same stream again: a retry, nothing changes
    assert not again.accepted and again.refusal == pb.REFUSAL_DUPLICATE
    moved = [pb.SubmitPart(peer_id=p.peer_id, round=1, param_digest=p.param_digest, loss=p.loss, part=p.part,
                           samples=p.samples,
                           signature=p.signature) for p in mine]  # its signature on another round
    assert await _refused(stub.Submit(iter(moved), metadata=md)) == grpc.StatusCode.PERMISSION_DENIED
    x, y = next(a.batches)
    a.model(x, y)[1].backward()  # type: ignore[union-attr]
    second = wire.encode(a.opt.compress(), step=0)
    other = submit_parts(key, a.session, "a", 0, second, param_digest=a.digest(), loss=1.0)
    conflict = await stub.Submit(iter(other), metadata=md)  # another signed payload for the same round
    assert not conflict.accepted and conflict.refusal == pb.REFUSAL_INVALID and "already in" in conflict.reason
    (reply, header), _ = await asyncio.gather(b.step(0), a.aggregate(0))
    assert reply.accepted and list(header.contributors) == ["a", "b"]
    stale = await stub.Submit(iter(mine), metadata=md)  # the stream again once its round has closed
    assert not stale.accepted and stale.refusal == pb.REFUSAL_STALE
    for _ in range(8):  # joins as a with b's key: refused, and they do not spend a's own joins
        nonce = (await b.stub.Challenge(pb.ChallengeRequest(peer_id="b", public_key=b.identity.public),
                                        metadata=md)).nonce
        assert await _refused(b.stub.Join(join_request(b.identity, "a", nonce), metadata=md)) \
            == grpc.StatusCode.PERMISSION_DENIED
    assert await a.join() == 1  # a member joining again resumes the open round


async def test_the_allowlist_admits_its_keys_refuses_a_flood_and_drops_a_removed_key(
        tmp_path: Path, reap_children: Reaper) -> None:
    keys = {p: Identity.load_or_create(tmp_path / f"{p}.key") for p in ("p0", "p1", "p2")}
    allow = tmp_path / "allow.txt"
    allow.write_text("".join(f"{public_text(k.public)} {p}\n" for p, k in keys.items()))
    run = _Run(tmp_path, reap_children, steps=400, admission='"allowlist"', allowlist=f'"{allow}"')
    for p in keys:
        run.peer(p)

    async def all_in() -> bool:
        return set(await run.members()) == set(keys)

    await run.wait("the three listed peers to join", all_in)
    before = max(run.rounds("p0"), default=0)

    async def flood(n: int) -> list[grpc.StatusCode]:  # new keys, the run token: refused at the challenge
        async with grpc.aio.insecure_channel(run.address) as channel:
            stub = pbg.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
            codes = []
            for i in range(n):
                request = pb.ChallengeRequest(peer_id=f"f{i}", public_key=Identity.generate().public)
                codes.append(await _refused(stub.Challenge(request, metadata=(("authorization", f"Bearer {TOKEN}"),))))
            return codes

    assert set(await flood(300)) == {grpc.StatusCode.PERMISSION_DENIED}
    assert max(run.rounds("p0")) > before  # the run went on meanwhile

    allow.write_text("".join(f"{public_text(k.public)} {p}\n" for p, k in keys.items() if p != "p2"))
    run.coordinator.send_signal(signal.SIGHUP)
    assert run.peers["p2"].wait(timeout=60) == 2, run.log("p2")  # dropped; its rejoin is refused
    assert "not on the run's allowlist" in run.log("p2")
    assert set(await run.members()) == {"p0", "p1"}
    dropped_at = max(run.rounds("p0"))

    async def goes_on() -> bool:
        return max(run.rounds("p0")) >= dropped_at + 3

    await run.wait("three more rounds without p2", goes_on)
    assert "allowlist reloaded: 2 keys; dropped p2" in run.log("coordinator")
    for p in ("p0", "p1"):
        run.peers[p].terminate()


async def test_an_open_run_needs_no_token(tmp_path: Path, reap_children: Reaper) -> None:
    run = _Run(tmp_path, reap_children, steps=4, admission='"open"', start_peers=1)
    peer = Peer(run.address, "volunteer")
    peer.md = (("authorization", "Bearer anything"),)
    await peer.join()
    other = Peer(run.address, "volunteer-2")
    other.md = ()
    await other.join()
    for r in range(2):
        (reply, header), _ = await asyncio.gather(peer.step(r), other.step(r))
        assert reply.accepted and sorted(header.contributors) == ["volunteer", "volunteer-2"]
