"""Bad input at every RPC of a coordinator, from its own process (run it inside a lab host):

    python -m tests.chaos.intruder --coordinator HOST:PORT --token TOKEN --seed 0 --out fuzz.json

It tries, with a deadline on every call: each RPC without a token, with a wrong one; random bytes
as each RPC's request; then, as a member that joined with the right token, payloads with NaN, Inf,
huge norms, wrong shapes and names, bit flips (with and without a fixed digest), truncations, lying
and mixed parts, stale and future rounds, replays; speaking for an honest member (`--victim`) with its
own key and session; and stale or future rounds in the other RPCs.
It writes per category how many were tried and how many were accepted (a Submit the coordinator
took, a Join it admitted, a call a wrong token got through): every one of those must stay 0.

`POISONER` is the other intruder: a real `demonet peer` (or `demonet peer --dht`) whose payloads are
scaled by 1000 or replaced by large random values (argv[1]: scale or random); it applies the aggregate
like everyone else, so its digest stays canonical and its payloads are well formed.

`LIAR` is a real `demonet peer --dht` whose slice merges are altered: every merged slice it serves as
an owner, and every digest it gives as a verifier, is of the true merge with its values negated. Its
own payloads are honest.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import torch

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet.config import load_config
from demonet.errors import InvalidPayload
from demonet.optim import DeMo
from demonet.train.model import GPT
from demonet.wire.identity import Identity, submit_statement
from demonet.wire.signed import aggregate_request, heartbeat_request, join_request, leave_request, parameters_request

POISONER = """
import sys
import torch
from demonet.optim import Compressed, Payload

MODE = sys.argv.pop(1)
if "--dht" in sys.argv:
    from demonet.dht.gatherer import DhtGatherer as Gatherer
else:
    from demonet.transport.grpc import GrpcClient as Gatherer
_gather = Gatherer.gather


async def gather(self, round, payload, *, loss, param_digest, samples=1, pace=None):
    g = torch.Generator().manual_seed(round)
    tensors = {}
    for name, c in payload.tensors.items():
        if MODE == "scale":
            val = c.val * 1000
        else:
            rms = c.val.float().square().mean().sqrt().clamp(min=1e-6)
            val = torch.randn(c.val.shape, generator=g) * rms * 1000
        tensors[name] = Compressed(idx=c.idx, val=val.float(), shape=c.shape, chunk=c.chunk)
    return await _gather(self, round, Payload(tensors=tensors, encoding="fp32"), loss=loss,
                         param_digest=param_digest, samples=samples, pace=pace)


Gatherer.gather = gather
from demonet.cli import main
raise SystemExit(main(sys.argv[1:]))
"""

LIAR = """
import sys
from demonet.dht import exchange
from demonet.wire.merge import Merged
from demonet.optim import Compressed, Payload

_merge = exchange.merge


def merge(payloads, *, step, rules, expected, **kwargs):
    honest = _merge(payloads, step=step, rules=rules, expected=expected, **kwargs)
    lie = Payload(tensors={n: Compressed(idx=c.idx, val=-c.val, shape=c.shape, chunk=c.chunk, scale=c.scale)
                           for n, c in honest.payload.tensors.items()}, encoding="fp32")
    told = _merge([lie], step=step, rules=rules, expected=expected)  # one payload merges to itself, encoded
    return Merged(data=told.data, payload=told.payload, factors=honest.factors, weights=honest.weights,
                  capped=honest.capped)


exchange.merge = merge
from demonet.cli import main
raise SystemExit(main(sys.argv[1:]))
"""

CALL_S = 2.0
"""Deadline of every call the intruder makes."""
METHODS = {  # name -> (kind, reply type)
    "Challenge": ("unary", pb.ChallengeReply), "Join": ("unary", pb.JoinReply),
    "Heartbeat": ("unary", pb.HeartbeatReply), "Leave": ("unary", pb.LeaveReply),
    "GetParameters": ("stream_out", pb.PayloadPart), "Submit": ("stream_in", pb.SubmitReply),
    "GetAggregate": ("stream_out", pb.AggregateChunk), "Status": ("unary", pb.StatusReply),
}
_TRAILER = len(wire.codec._TRAILER_HEAD) + 32


def _seal(msg: Any) -> bytes:
    """A payload message serialized with a correct digest, so the check goes past the digest."""
    body = msg.SerializeToString()
    return body + wire.codec._TRAILER_HEAD + hashlib.sha256(body).digest()


def _parse(data: bytes) -> Any:
    msg = pb.Payload()
    msg.ParseFromString(data[:-_TRAILER])
    return msg


class Intruder:
    def __init__(self, address: str, token: str, seed: int) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.token = token
        self.rng = random.Random(seed)
        self.tried: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()
        self.codes: Counter[str] = Counter()
        self.peer_id = "intruder"
        self.key = Identity.generate()  # its own key: the token admits it in its own name
        self.session = b""
        self.counter = 0
        self._payload: Any = None
        self._specs: Any = None

    def next(self) -> int:
        """The session's next counter."""
        self.counter += 1
        return self.counter

    def meta(self, token: str | None = "") -> tuple[tuple[str, str], ...]:
        token = self.token if token == "" else token
        return () if token is None else (("authorization", f"Bearer {token}"),)

    def raw(self, method: str) -> Any:
        kind = METHODS[method][0]
        path = f"/demonet.v1.Coordinator/{method}"
        make = {"unary": self.channel.unary_unary, "stream_out": self.channel.unary_stream,
                "stream_in": self.channel.stream_unary}[kind]
        return make(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)

    async def call(self, method: str, request: bytes | list[bytes], meta: Any) -> tuple[str, list[bytes]]:
        """One raw call; returns (status code name, reply messages)."""
        kind = METHODS[method][0]
        try:
            if kind == "unary":
                return "OK", [await self.raw(method)(request, metadata=meta, timeout=CALL_S)]
            if kind == "stream_out":
                return "OK", [m async for m in self.raw(method)(request, metadata=meta, timeout=CALL_S)]
            parts = request if isinstance(request, list) else [request]
            return "OK", [await self.raw(method)(iter(parts), metadata=meta, timeout=CALL_S)]
        except grpc.aio.AioRpcError as e:
            return e.code().name, []

    def record(self, category: str, accepted: bool, code: str) -> None:
        self.tried[category] += 1
        self.accepted[category] += int(accepted)
        self.codes[f"{category}:{code}"] += 1

    # -- without the token ---------------------------------------------------------------------------

    async def tokens(self) -> None:
        valid = {"Challenge": pb.ChallengeRequest(peer_id="thief", public_key=self.key.public),
                 "Join": pb.JoinRequest(peer_id="thief"), "Heartbeat": pb.HeartbeatRequest(peer_id="thief"),
                 "Leave": pb.LeaveRequest(peer_id="thief"),
                 "GetParameters": pb.ParametersRequest(peer_id="thief"), "Status": pb.StatusRequest(),
                 "GetAggregate": pb.AggregateRequest(peer_id="thief"),
                 "Submit": pb.SubmitPart(peer_id="thief", part=pb.PayloadPart(count=1, total_bytes=1, data=b"x"))}
        for token in (None, "wrong-token", self.token + "x", "", " " + self.token):
            meta = self.meta(token) if token != "" else (("authorization", self.token),)  # no "Bearer"
            for method, msg in valid.items():
                code, _ = await self.call(method, msg.SerializeToString(), meta)
                self.record("bad_token", code != "UNAUTHENTICATED", code)

    # -- random bytes --------------------------------------------------------------------------------

    def junk(self) -> bytes:
        n = self.rng.choice([0, 1, 3, 17, 200, 3000])
        return bytes(self.rng.getrandbits(8) for _ in range(n))

    async def garbage(self, rounds: int = 12) -> None:
        for _ in range(rounds):
            for method in METHODS:
                request = [self.junk() for _ in range(self.rng.randint(1, 3))] if method == "Submit" else self.junk()
                code, replies = await self.call(method, request, self.meta())
                accepted = False
                if code == "OK" and method in ("Join", "Challenge"):
                    accepted = True  # random bytes must never make a member
                if code == "OK" and method == "Submit":
                    reply = pb.SubmitReply()
                    reply.ParseFromString(replies[0])
                    accepted = reply.accepted
                self.record(f"garbage_{method}", accepted, code)

    # -- as a member ---------------------------------------------------------------------------------

    async def status(self) -> Any:
        code, replies = await self.call("Status", pb.StatusRequest().SerializeToString(), self.meta())
        assert code == "OK", code
        reply = pb.StatusReply()
        reply.ParseFromString(replies[0])
        return reply

    async def join(self) -> dict[str, Any]:
        """Join, then wait (bounded) until the round this id is a member of opens."""
        code, replies = await self.call("Challenge", pb.ChallengeRequest(
            peer_id=self.peer_id, public_key=self.key.public).SerializeToString(), self.meta())
        assert code == "OK", code
        nonce = pb.ChallengeReply.FromString(replies[0]).nonce
        code, replies = await self.call("Join", join_request(self.key, self.peer_id, nonce).SerializeToString(),
                                        self.meta())
        assert code == "OK", code
        reply = pb.JoinReply()
        reply.ParseFromString(replies[0])
        self.session, self.counter = reply.session, 0
        deadline = time.monotonic() + 30
        while (await self.status()).round < reply.round and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return dict(json.loads(reply.run_config))

    def valid_payload(self, run_config: dict[str, Any], step: int) -> bytes:
        """A well-formed payload for `step` (one compress() of the run's model, made once)."""
        if self._payload is None:
            self._payload = self._compress(run_config)
        return wire.encode(self._payload, step=step)

    def _compress(self, run_config: dict[str, Any]) -> Any:
        cfg = load_config(None, {}, run_config)
        torch.manual_seed(0)
        model = GPT(cfg.model)
        o = cfg.optim
        opt = DeMo(model.named_parameters(), lr=o.lr, compression_topk=o.compression_topk,
                   compression_chunk=o.compression_chunk, encoding=o.encoding, chunk_policy=o.chunk_policy)
        x = torch.randint(0, cfg.model.vocab_size, (1, cfg.train.seq_len))
        _, loss = model(x, x)
        loss.backward()
        self._specs = opt.param_specs()
        return opt.compress()

    def is_valid(self, data: bytes) -> bool:
        """Whether the coordinator's own checks would take this payload (the fuzzer checks itself)."""
        try:
            wire.decode(data, expected=self._specs, max_norm=1e6)
        except InvalidPayload:
            return False
        return True

    def parts(self, data: bytes, round: int, digest: str, peer_id: str | None = None) -> list[bytes]:
        """The parts of a Submit stream, the first signed with this intruder's key (whatever id they name)."""
        return self.signed([pb.SubmitPart(peer_id=peer_id or self.peer_id, round=round, param_digest=digest, loss=1.0,
                                          part=p) for p in wire.split(data)])

    def signed(self, parts: list[Any]) -> list[bytes]:
        """Serialized parts, the first signed with this intruder's key over its own fields, as a member signs,
        so that a lie in the parts is refused by the checks behind the signature."""
        if parts:
            head = parts[0]
            head.samples = head.samples or 1
            head.signature = self.key.sign(submit_statement(self.session, head.peer_id, head.round,
                                                            head.part.payload_digest, head.param_digest, head.loss,
                                                            head.samples))
        return [p.SerializeToString() for p in parts]

    async def submit(self, category: str, parts: list[bytes]) -> None:
        code, replies = await self.call("Submit", parts, self.meta())
        accepted = False
        if code == "OK":
            reply = pb.SubmitReply()
            reply.ParseFromString(replies[0])
            accepted = reply.accepted
            code = pb.Refusal.Name(reply.refusal)
        self.record(category, accepted, code)

    def bad_payloads(self, good: bytes) -> Iterator[tuple[str, bytes]]:
        """(category, payload bytes) of every malformed or hostile payload, built from a good one."""
        base = _parse(good)
        t0 = base.tensors[0]
        for what, value in (("nan", np.nan), ("inf", np.inf), ("neg_inf", -np.inf), ("huge_norm", 1e30)):
            msg = _parse(good)
            vals = np.frombuffer(msg.tensors[0].values, dtype="<f4").copy()
            vals[:: max(1, len(vals) // 7)] = value
            msg.tensors[0].values = vals.astype("<f4").tobytes()
            yield f"payload_{what}", _seal(msg)
        msg = _parse(good)
        msg.tensors[0].shape[0] += 1
        yield "payload_wrong_shape", _seal(msg)
        msg = _parse(good)
        msg.tensors[0].chunk_h, msg.tensors[0].chunk_w = msg.tensors[0].chunk_w, msg.tensors[0].chunk_h + 1
        yield "payload_wrong_chunk", _seal(msg)
        msg = _parse(good)
        msg.tensors[0].name = "no.such.parameter"
        yield "payload_wrong_name", _seal(msg)
        msg = _parse(good)
        del msg.tensors[-1]
        yield "payload_missing_tensor", _seal(msg)
        msg = _parse(good)
        msg.tensors.add().CopyFrom(t0)
        yield "payload_duplicate_tensor", _seal(msg)
        msg = _parse(good)
        msg.tensors[0].k = msg.tensors[0].chunk_h * msg.tensors[0].chunk_w + 1
        yield "payload_k_too_large", _seal(msg)
        msg = _parse(good)
        msg.tensors[0].values = msg.tensors[0].values[:-4]
        yield "payload_short_values", _seal(msg)
        for what in ("deflate_overflow", "deflate_cut"):  # fp32 values as byte planes whose deflated top plane lies
            msg = _parse(good)
            planes = np.frombuffer(msg.tensors[0].values, np.uint8).reshape(-1, 4).T  # (4 planes, values)
            packer = zlib.compressobj(9, zlib.DEFLATED, -15)
            stream = packer.compress(planes[-1].tobytes() + bytes(1 << 20 if what == "deflate_overflow" else 0))
            stream += packer.flush()
            msg.tensors[0].values = planes[:-1].tobytes() + (stream if what == "deflate_overflow" else stream[:-3])
            msg.tensors[0].value_coding = pb.VALUE_CODING_TOP_PLANE_DEFLATE
            yield f"payload_{what}", _seal(msg)
        msg = _parse(good)
        msg.version = 99
        yield "payload_version", _seal(msg)
        msg = _parse(good)
        msg.encoding = 77
        yield "payload_encoding", _seal(msg)
        for _ in range(6):  # bit flips: the digest catches them
            data = bytearray(good)
            for _ in range(self.rng.randint(1, 8)):
                data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
            yield "payload_bitflip", bytes(data)
        for _ in range(10):  # bit flips in the body, digest fixed: the checks behind the digest catch them
            body = bytearray(good[:-_TRAILER])
            for _ in range(self.rng.randint(1, 4)):
                body[self.rng.randrange(len(body))] ^= 1 << self.rng.randrange(8)
            sealed = bytes(body) + wire.codec._TRAILER_HEAD + hashlib.sha256(body).digest()
            try:
                _parse(sealed)
            except Exception:  # noqa: BLE001 - not even a protobuf any more: still worth sending
                pass
            yield "payload_mutated_sealed", sealed
        yield "payload_truncated", good[: len(good) // 2]
        yield "payload_empty", b""

    async def payloads(self, run_config: dict[str, Any]) -> None:
        st = await self.status()
        r, digest = st.round, st.param_digest
        good = self.valid_payload(run_config, r)
        for category, data in self.bad_payloads(good):
            st = await self.status()  # keep up with the open round, or the refusals would only say "stale"
            r, digest = st.round, st.param_digest
            if self.is_valid(data):
                continue  # a mutation that is still a well-formed payload (a flipped value bit) is not bad input
            if not data:
                part = pb.PayloadPart(payload_digest=bytes(32), index=0, count=1, total_bytes=0, data=b"")
                await self.submit(category, self.signed([pb.SubmitPart(peer_id=self.peer_id, round=r,
                                                                       param_digest=digest, part=part)]))
                continue
            await self.submit(category, self.parts(data, r, digest))
        # Parts that lie: several peers or rounds in one stream, a wrong count, a part twice.
        st = await self.status()
        r, digest = st.round, st.param_digest
        good = self.valid_payload(run_config, r)
        small = wire.split(good, part_bytes=max(1, len(good) // 3))
        mixed = self.signed([pb.SubmitPart(peer_id=self.peer_id if i == 0 else "a", round=r, param_digest=digest,
                                           part=p) for i, p in enumerate(small)])
        await self.submit("parts_mixed_peers", mixed)
        mixed = self.signed([pb.SubmitPart(peer_id=self.peer_id, round=r + i, param_digest=digest, part=p)
                             for i, p in enumerate(small)])
        await self.submit("parts_mixed_rounds", mixed)
        parts = small
        twice = [parts[0], parts[0], *parts[1:]]
        await self.submit("parts_duplicate", self.signed([pb.SubmitPart(peer_id=self.peer_id, round=r,
                                                                        param_digest=digest, part=p) for p in twice]))
        lying = pb.PayloadPart()
        lying.CopyFrom(parts[0])
        lying.total_bytes = 1 << 40
        await self.submit("parts_huge_size", self.signed([pb.SubmitPart(peer_id=self.peer_id, round=r,
                                                                        param_digest=digest, part=lying)]))
        await self.submit("parts_missing", self.signed([pb.SubmitPart(peer_id=self.peer_id, round=r,
                                                                      param_digest=digest, part=parts[0])]))
        await self.submit("wrong_step", self.parts(self.valid_payload(run_config, r + 3), r, digest))
        await self.submit("stale_round", self.parts(self.valid_payload(run_config, max(r - 1, 0)), max(r - 1, 0),
                                                    digest))
        await self.submit("future_round", self.parts(self.valid_payload(run_config, r + 5), r + 5, digest))
        await self.submit("bad_peer_id", self.parts(good, r, digest, peer_id="../../etc/passwd"))
        await self.submit("not_a_member", self.parts(good, r, digest, peer_id="stranger"))

    async def replays(self, run_config: dict[str, Any]) -> int:
        """A valid payload for the open round (accepted: this id is a member), then replayed: again for
        the same round, for the next one. Returns how many valid ones were accepted (the control)."""
        st = await self.status()
        r, digest = st.round, st.param_digest
        good = self.parts(self.valid_payload(run_config, r), r, digest)
        code, replies = await self.call("Submit", good, self.meta())
        control = int(code == "OK" and pb.SubmitReply.FromString(replies[0]).accepted)
        await self.submit("replay_same_round", good)
        deadline = time.monotonic() + 30
        while (await self.status()).round == r and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        st = await self.status()
        replayed = [pb.SubmitPart.FromString(p) for p in good]  # its signature, on another round
        for part in replayed:
            part.round, part.param_digest = st.round, st.param_digest
        await self.submit("replay_next_round", [p.SerializeToString() for p in replayed])
        return control

    async def heartbeats(self) -> None:
        while True:
            await self.call("Heartbeat", heartbeat_request(self.key, self.session, self.peer_id, 0, self.next())
                            .SerializeToString(),
                            self.meta())
            await asyncio.sleep(0.5)

    async def impersonation(self, victim: str, run_config: dict[str, Any]) -> None:
        """Speak for `victim` (an honest member) with this intruder's own key and session: a challenge for
        its id, a join with this key's nonce, a heartbeat, a leave, a download and a payload, each refused."""
        r, digest = (await self.status()).round, (await self.status()).param_digest
        code, _ = await self.call("Challenge", pb.ChallengeRequest(peer_id=victim, public_key=self.key.public)
                                  .SerializeToString(), self.meta())
        self.record("impersonate_Challenge", code == "OK", code)
        code, replies = await self.call("Challenge", pb.ChallengeRequest(
            peer_id=self.peer_id, public_key=self.key.public).SerializeToString(), self.meta())
        if code == "OK":
            nonce = pb.ChallengeReply.FromString(replies[0]).nonce
            code, _ = await self.call("Join", join_request(self.key, victim, nonce).SerializeToString(), self.meta())
            self.record("impersonate_Join", code == "OK", code)
        for method, msg in (("Heartbeat", heartbeat_request(self.key, self.session, victim, r, self.next())),
                            ("Leave", leave_request(self.key, self.session, victim, r, self.next())),
                            ("GetParameters", parameters_request(self.key, self.session, victim, r, self.next()))):
            code, _ = await self.call(method, msg.SerializeToString(), self.meta())
            self.record(f"impersonate_{method}", code == "OK", code)
        await self.submit("impersonate_Submit", self.parts(self.valid_payload(run_config, r), r, digest,
                                                           peer_id=victim))

    async def other_rounds(self) -> None:
        """Stale and future rounds where a peer asks for data: answered or refused, never a change."""
        r = (await self.status()).round
        for n in (r + 1000, 2**63, 0):
            key, session, me = self.key, self.session, self.peer_id
            for method, msg in (("GetParameters", parameters_request(key, session, me, n, self.next())),
                                ("GetAggregate", aggregate_request(key, session, me, n, self.next())),
                                ("Heartbeat", heartbeat_request(key, session, me, n, self.next()))):
                code, _ = await self.call(method, msg.SerializeToString(), self.meta())
                self.record(f"round_{method}", False, code)
        for bad in ("", "x" * 200, "a b", "ünï"):
            code, _ = await self.call("Join", pb.JoinRequest(peer_id=bad).SerializeToString(), self.meta())
            self.record("join_bad_peer_id", code == "OK", code)


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    it = Intruder(args.coordinator, args.token, args.seed)
    await it.tokens()
    await it.garbage()
    run_config = await it.join()
    beats = asyncio.create_task(it.heartbeats())  # stay a member, so payloads reach the decoder
    try:
        it._payload = await asyncio.to_thread(it._compress, run_config)  # seconds of torch: not in the loop
        await it.join()  # again (a member's join is idempotent; a dropped one is admitted again)
        await it.payloads(run_config)
        control = await it.replays(run_config)
        await it.impersonation(args.victim, run_config)
    finally:
        beats.cancel()
    await it.other_rounds()
    await it.channel.close()
    return {"tried": dict(it.tried), "accepted": dict(it.accepted), "codes": dict(it.codes), "control": control}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.intruder")
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--victim", default="a", help="an honest member's id to speak for")
    parser.add_argument("--token", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = asyncio.run(_main(args))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
