"""The signed requests of coordinator mode, built in one place: the client, tests and benchmarks send these.

Wire layer: protobuf messages and `demonet.wire.identity`; no grpc. The coordinator checks the same
statements (`demonet.coordinator.identities`).
"""

from __future__ import annotations

from demonet._proto import demonet_pb2 as pb

from .identity import (
    Identity,
    aggregate_statement,
    heartbeat_statement,
    join_statement,
    leave_statement,
    parameters_statement,
    submit_statement,
    task_files_statement,
)
from .params import PROTOCOL
from .parts import DEFAULT_PART_BYTES, split

__all__ = ["aggregate_request", "digest_part", "heartbeat_request", "join_request", "leave_request",
           "parameters_request", "submit_parts", "task_files_request"]


def join_request(identity: Identity, peer_id: str, nonce: bytes) -> pb.JoinRequest:
    """The Join that answers the Challenge which gave `nonce`."""
    return pb.JoinRequest(peer_id=peer_id, public_key=identity.public, nonce=nonce, protocol=PROTOCOL,
                          signature=identity.sign(join_statement(nonce, peer_id, identity.public)))


# `counter`: a number the session has not used (>= 1); a client counts up from 1 after each join.

def heartbeat_request(identity: Identity, session: bytes, peer_id: str, round: int, counter: int
                      ) -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(peer_id=peer_id, round=round, counter=counter,
                               signature=identity.sign(heartbeat_statement(session, peer_id, round, counter)))


def leave_request(identity: Identity, session: bytes, peer_id: str, round: int, counter: int) -> pb.LeaveRequest:
    return pb.LeaveRequest(peer_id=peer_id, round=round, counter=counter,
                           signature=identity.sign(leave_statement(session, peer_id, round, counter)))


def parameters_request(identity: Identity, session: bytes, peer_id: str, round: int, counter: int, *,
                       resync: bool = False) -> pb.ParametersRequest:
    return pb.ParametersRequest(peer_id=peer_id, round=round, resync=resync, counter=counter, signature=identity.sign(
        parameters_statement(session, peer_id, round, resync, counter)))


def task_files_request(identity: Identity, session: bytes, peer_id: str, counter: int) -> pb.TaskFilesRequest:
    return pb.TaskFilesRequest(peer_id=peer_id, counter=counter,
                               signature=identity.sign(task_files_statement(session, peer_id, counter)))


def aggregate_request(identity: Identity, session: bytes, peer_id: str, round: int, counter: int, *,
                      submitting: bool = False) -> pb.AggregateRequest:
    """A member's GetAggregate: limited per key and counted as its bytes (unsigned, it is the public path)."""
    return pb.AggregateRequest(peer_id=peer_id, round=round, submitting=submitting, counter=counter,
                               signature=identity.sign(aggregate_statement(session, peer_id, round, submitting,
                                                                           counter)))


def submit_parts(identity: Identity, session: bytes, peer_id: str, round: int, data: bytes, *, param_digest: str,
                 loss: float, part_bytes: int = DEFAULT_PART_BYTES, digest_follows: bool = False,
                 samples: int = 1, need_s: float = 0.0, least_s: float = 0.0, train_s: float = 0.0,
                 micro_batches: int = 0, compute_s: float = 0.0) -> list[pb.SubmitPart]:
    """A serialized payload as the SubmitPart messages of one Submit stream; the first one carries the signature.

    `digest_follows`: the parameter digest is not known yet (an overlapped peer sending round r+1 while round
    r is open); `param_digest` must be "", and `digest_part` gives the stream's last message once it is.
    `samples`: how many samples the payload was computed from (the merge's weight), in the first part;
    `need_s`, `least_s`: this peer's round of its own micro-batches and of one (the automatic round length);
    `train_s`: one micro-batch's forward and backward alone; `micro_batches`, `compute_s`: the payload's
    micro-batches and their seconds, for the dashboards (in the first part, not in the statement).
    """
    if digest_follows and param_digest:
        raise ValueError("digest_follows: the digest comes in the last message (digest_part), not the first")
    parts = split(data, part_bytes=part_bytes)
    signature = identity.sign(submit_statement(session, peer_id, round, parts[0].payload_digest, param_digest, loss,
                                               samples, need_s, least_s, train_s))
    return [pb.SubmitPart(peer_id=peer_id, round=round, param_digest=param_digest, loss=loss, part=part,
                          signature=signature if i == 0 else b"", digest_follows=digest_follows and i == 0,
                          samples=samples if i == 0 else 0, need_s=need_s if i == 0 else 0.0,
                          least_s=least_s if i == 0 else 0.0, train_s=train_s if i == 0 else 0.0,
                          micro_batches=micro_batches if i == 0 else 0, compute_s=compute_s if i == 0 else 0.0)
            for i, part in enumerate(parts)]


def digest_part(identity: Identity, session: bytes, first: pb.SubmitPart, param_digest: str) -> pb.SubmitPart:
    """The last message of a `digest_follows` stream whose first part is `first`: the parameter digest, signed
    with the payload's digest and loss (`submit_statement`)."""
    if not param_digest:
        raise ValueError("param_digest is empty")
    statement = submit_statement(session, first.peer_id, first.round, first.part.payload_digest, param_digest,
                                 first.loss, first.samples, first.need_s, first.least_s, first.train_s)
    return pb.SubmitPart(peer_id=first.peer_id, round=first.round, param_digest=param_digest, loss=first.loss,
                         signature=identity.sign(statement))
