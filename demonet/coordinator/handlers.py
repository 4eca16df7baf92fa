"""The coordinator's gRPC method table: request parsers that never raise, and size caps checked before parsing.

Imports grpc, the generated messages and the leaf `demonet.coordinator.parts`; the servicer
(demonet.coordinator.server) answers what they give it, and is passed in, never imported.
"""

from __future__ import annotations

from typing import Any

import grpc

from demonet._proto import demonet_pb2 as pb

from .parts import Malformed

__all__ = ["add_to_server"]


_SMALL_REQUEST_BYTES = 4096
"""The most any request but a SubmitPart can need (ids of 128 characters, a key, a nonce, a signature);
a larger one is refused before it is parsed. SubmitParts are bounded by the server's message limit."""


def _parser(cls: Any, max_bytes: int | None = _SMALL_REQUEST_BYTES) -> Any:
    """`cls.FromString`, except that undecodable bytes, or more than `max_bytes` of them (not parsed at all),
    give a `Malformed` the servicer answers, instead of gRPC's own UNKNOWN status and a logged traceback."""
    def parse(data: bytes) -> Any:
        if max_bytes is not None and len(data) > max_bytes:
            return Malformed(cls.DESCRIPTOR.name, f"{len(data)} bytes, more than the {max_bytes} it can need")
        try:
            return cls.FromString(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError (and any parse failure) is bad input
            return Malformed(cls.DESCRIPTOR.name, str(e) or type(e).__name__)
    return parse


def add_to_server(servicer: Any, server: grpc.aio.Server) -> None:
    """Register the servicer (a `demonet.coordinator.server.CoordinatorServicer`) as the generated code does,
    with request parsers that never raise."""
    handlers = {
        "Challenge": grpc.unary_unary_rpc_method_handler(
            servicer.Challenge, request_deserializer=_parser(pb.ChallengeRequest),
            response_serializer=pb.ChallengeReply.SerializeToString),
        "Join": grpc.unary_unary_rpc_method_handler(
            servicer.Join, request_deserializer=_parser(pb.JoinRequest),
            response_serializer=pb.JoinReply.SerializeToString),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(
            servicer.Heartbeat, request_deserializer=_parser(pb.HeartbeatRequest),
            response_serializer=pb.HeartbeatReply.SerializeToString),
        "GetParameters": grpc.unary_stream_rpc_method_handler(
            servicer.GetParameters, request_deserializer=_parser(pb.ParametersRequest),
            response_serializer=pb.PayloadPart.SerializeToString),
        "GetTaskFiles": grpc.unary_stream_rpc_method_handler(
            servicer.GetTaskFiles, request_deserializer=_parser(pb.TaskFilesRequest),
            response_serializer=pb.PayloadPart.SerializeToString),
        "Submit": grpc.stream_unary_rpc_method_handler(
            servicer.Submit, request_deserializer=_parser(pb.SubmitPart, None),
            response_serializer=pb.SubmitReply.SerializeToString),
        "GetAggregate": grpc.unary_stream_rpc_method_handler(
            servicer.GetAggregate, request_deserializer=_parser(pb.AggregateRequest),
            response_serializer=pb.AggregateChunk.SerializeToString),
        "Status": grpc.unary_unary_rpc_method_handler(
            servicer.Status, request_deserializer=_parser(pb.StatusRequest),
            response_serializer=pb.StatusReply.SerializeToString),
        "Leave": grpc.unary_unary_rpc_method_handler(
            servicer.Leave, request_deserializer=_parser(pb.LeaveRequest),
            response_serializer=pb.LeaveReply.SerializeToString),
    }
    name = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
