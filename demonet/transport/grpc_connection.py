"""The gRPC client's connection to the coordinator: the channel, the run token, this key's signed session, the
retries, and the unary calls (join, heartbeat, leave, status). `demonet.transport.grpc.GrpcClient` builds the
rounds' streams and the `Gatherer` on it.

Net layer: imports grpc, the wire layer and the generated stubs; never the model, the training loop
or torch.distributed. Every RPC carries the run token; every wait on the network has a deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import grpc.aio

from demonet._proto import demonet_pb2 as pb
from demonet._proto import demonet_pb2_grpc
from demonet.errors import PeerUnavailable
from demonet.wire import params as wire_params
from demonet.wire.identity import Identity
from demonet.wire.signed import heartbeat_request, join_request, leave_request

from . import JoinInfo, NotMember, grpc_retry
from .grpc_replies import CoordinatorStatus, coordinator_status, join_info

__all__ = ["CoordinatorConnection"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_RECONNECT_BACKOFF_MAX_MS = 1000
_CONNECT_TIMEOUT_MS = 10_000
"""How long one connection attempt may take (gRPC's `grpc.min_reconnect_backoff_ms`, which is the attempt's
deadline as well as a backoff floor): the TCP, TLS and HTTP/2 handshakes take 2 to 4 round trips, and a
lost SYN is sent again by the kernel after 1 s and 3 s. A failed attempt (refused: a restarting
coordinator) fails at once and is tried again after the short backoff all the same."""
_MAX_MESSAGE_BYTES = 64 << 20  # parts are 2 MiB; room for a coordinator that cuts larger ones


class CoordinatorConnection:
    """One peer's (or an operator's) connection to the coordinator: its channel, its signed session and its unary
    calls. `demonet.transport.grpc.GrpcClient` adds the streams of the rounds (an operator's status needs none).

    Timeouts, each a deadline on the gRPC call it names:

    - ``call_timeout_s``: one unary call (Join, Heartbeat, Status): connecting, request and reply.

    A call that fails with UNAVAILABLE, DEADLINE_EXCEEDED or CANCELLED is tried again, with capped
    exponential backoff, until ``reconnect_timeout_s`` has passed since its first failure (the
    coordinator may be restarting); then `PeerUnavailable`.

    Args:
        address: HOST:PORT of the coordinator.
        token: the run token (sent as "authorization: Bearer <token>").
        peer_id: this peer's id; empty for a client that only asks for the status.
        root_cert: PEM root certificate(s) to verify the coordinator's TLS certificate; None for
            a plaintext channel.
        reconnect_timeout_s: how long one call keeps retrying while the coordinator is unreachable.
        call_timeout_s: the deadline of one unary call.
        identity: this peer's key (it joins with it and signs every later call); None: a key made for this
            client alone, so the peer id is this process's for the run (a restarted process with a new key
            is refused under it): peers that restart pass the key they keep (`Identity.load_or_create`).
    """

    def __init__(self, address: str, *, token: str, peer_id: str = "", root_cert: bytes | None = None,
                 reconnect_timeout_s: float = 120.0, call_timeout_s: float = 10.0,
                 identity: Identity | None = None) -> None:
        if not token:
            raise ValueError("token should be non-empty")
        options = [("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                   # gRPC's own reconnect backoff grows to 120 s by default: after a coordinator outage
                   # of a few seconds, a peer could try again only after the restarted coordinator had
                   # dropped it (it gives members a heartbeat timeout to come back). Probe every second.
                   # An attempt's deadline is the larger of the backoff and the minimum: with the minimum
                   # at the backoff's 200 ms, behind a proxy holding each byte 0.8 s each way a peer needed
                   # several attempts, and behind 1.5 s none got through ("timed out before receiving
                   # SETTINGS frame").
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", _CONNECT_TIMEOUT_MS),
                   ("grpc.max_reconnect_backoff_ms", _RECONNECT_BACKOFF_MAX_MS)]
        if root_cert is None:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        else:
            creds = grpc.ssl_channel_credentials(root_certificates=root_cert)
            self._channel = grpc.aio.secure_channel(address, creds, options=options)
        # The generated stub is untyped: its callables return awaitable calls of pb messages.
        self._stub: Any = demonet_pb2_grpc.CoordinatorStub(self._channel)  # type: ignore[no-untyped-call]
        self._metadata = (("authorization", f"Bearer {token}"),)
        self.address = address
        self.peer_id = peer_id
        self.reconnect_timeout_s = reconnect_timeout_s
        self.call_timeout_s = call_timeout_s
        self.round_timeout_s = 30.0
        """Set from the JoinReply; the stream deadlines derive from it."""
        self._identity = identity
        self._session = b""
        """From the JoinReply: what this key's signatures cover."""
        self._counter = 0
        """The last counter this session signed (a counted request takes the next; a join starts again)."""
        self._joining = asyncio.Lock()

    @property
    def identity(self) -> Identity:
        if self._identity is None:
            self._identity = Identity.generate()
        return self._identity

    def _next(self) -> int:
        """The next counter of this session (each counted request, and each retry of one, takes its own)."""
        self._counter += 1
        return self._counter

    # -- retries ---------------------------------------------------------------------------------------

    async def _call(self, what: str, attempt: Callable[[], Awaitable[_T]]) -> _T:
        """`grpc_retry.call` on this client's channel: retried while the coordinator is unreachable, for up to
        reconnect_timeout_s from the first failure, and after the waits a call over its rate is told.

        A call signed in a session that a join of this client replaced meanwhile (the heartbeats and a catch-up
        run beside each other) is refused PERMISSION_DENIED: it is signed again in the new session (each
        attempt signs anew), and a Submit, whose parts are signed once, is refused as from a non-member (its
        round is the old membership's). A refusal within the current session stays final."""
        while True:
            session = self._session
            try:
                return await grpc_retry.call(what, attempt, channel=self._channel, address=self.address,
                                             peer_id=self.peer_id, reconnect_timeout_s=self.reconnect_timeout_s)
            except grpc_retry.CallRefused as e:
                if e.code != grpc.StatusCode.PERMISSION_DENIED or not session or self._session == session:
                    raise
                if what.startswith("Submit"):
                    raise NotMember(f"{what}: signed in a session this peer's join replaced") from None
                logger.info("[%s] %s: signed in a session a join replaced meanwhile; signing it again",
                            self.peer_id, what)

    # -- unary calls -----------------------------------------------------------------------------------

    async def join(self, *, probe: bool = False) -> JoinInfo:
        """Join the run (again: a reconnect returns the round to resume at); `probe`: only learn its config
        and parameters, without being admitted (to build and check a model first)."""
        async def attempt() -> Any:
            request = pb.JoinRequest(peer_id=self.peer_id, probe=True, protocol=wire_params.PROTOCOL)
            if not probe:  # answer a fresh challenge with this key (a retry asks for a new one)
                public = self.identity.public
                challenge = await self._stub.Challenge(pb.ChallengeRequest(peer_id=self.peer_id, public_key=public),
                                                       metadata=self._metadata, timeout=self.call_timeout_s)
                request = join_request(self.identity, self.peer_id, challenge.nonce)
            return await self._stub.Join(request, metadata=self._metadata, timeout=self.call_timeout_s)

        try:
            async with self._joining:  # one join at a time: the session kept is the coordinator's latest
                reply = await self._call("Join", attempt)
                info = join_info(reply, self.peer_id, self.address)  # another protocol: refused here, first
                if not probe:
                    self._session, self._counter = reply.session, 0
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:  # refused for its protocol version
                raise
            raise PermissionError(f"Join: the coordinator at {self.address} refused this peer: {e.details()}") from None
        self.round_timeout_s = reply.round_timeout_s
        return info

    async def heartbeat(self, round: int) -> tuple[int, bool]:
        """Tell the coordinator this peer works on `round`.

        Returns:
            (the coordinator's open round, whether this peer is still a member or an admitted joiner).
        """
        reply = await self._call("Heartbeat", lambda: self._stub.Heartbeat(  # a retry is signed anew
            heartbeat_request(self.identity, self._session, self.peer_id, round, self._next()),
            metadata=self._metadata, timeout=self.call_timeout_s))
        return int(reply.round), bool(reply.member)

    async def leave(self, round: int) -> bool:
        """Tell the coordinator this member stops at `round` (a graceful stop), so that rounds stop waiting
        for it. One try, not retried: a peer on its way out does not wait for an unreachable coordinator,
        which then drops it after its heartbeat timeout as before. Returns whether the coordinator took it."""
        if not self._session:  # never joined: no member
            return False
        request = leave_request(self.identity, self._session, self.peer_id, round, self._next())
        try:
            reply = await self._stub.Leave(request, metadata=self._metadata, timeout=self.call_timeout_s)
        except grpc.aio.AioRpcError as e:  # UNIMPLEMENTED from a coordinator of an earlier version included
            logger.warning("[%s round=%d] Leave: %s %s; the coordinator drops this peer after its heartbeat "
                           "timeout", self.peer_id, round, e.code().name, e.details())
            return False
        return bool(reply.left)

    async def status(self) -> CoordinatorStatus:
        """The coordinator's open round, members and counters."""
        reply = await self._call("Status", lambda: self._stub.Status(pb.StatusRequest(), metadata=self._metadata,
                                                                     timeout=self.call_timeout_s))
        return coordinator_status(reply)

    async def status_document(self) -> dict[str, Any]:
        """The coordinator's dashboard document (docs/dashboard.md): the run, recent rounds, members, refusals.

        Raises:
            PeerUnavailable: the coordinator could not be reached in time, or sends no document (older).
        """
        reply = await self._call("Status", lambda: self._stub.Status(pb.StatusRequest(detail=True),
                                                                     metadata=self._metadata,
                                                                     timeout=self.call_timeout_s))
        if not reply.detail_json:
            raise PeerUnavailable(f"the coordinator at {self.address} sends no status document (an older version)")
        document: dict[str, Any] = json.loads(reply.detail_json)
        return document

    async def close(self) -> None:
        """Close the channel; calls still open are cancelled."""
        await self._channel.close()
