"""The round loop: train, compress, gather, settle, round after round, over any transport.

`RoundLoop` drives a replica (`Replica`: a `demonet.train.trainer.Trainer` or a FlexDeMo rank) through a
`demonet.transport.Membership` and a `demonet.transport.Gatherer`: the gRPC coordinator, the in-process
coordinator of `demonet train`, the DHT and a FlexDeMo node's rank 0 are all the same loop. Imports the
transport protocols; no grpc, no hivemind, no service module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch

from demonet.errors import DemonetError, PeerUnavailable
from demonet.optim import Payload
from demonet.transport import Expected, Gatherer, JoinInfo, Membership, Parameters, Resync, RoundResult, keep_alive

__all__ = ["STOP_GRACE_S", "Replica", "RoundLog", "RoundLoop", "stop_on_signals", "warm_up"]

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
"""After SIGTERM, how long a peer still waits for the open round's aggregate before abandoning it."""


class Replica(Protocol):
    """The torch side of a peer, as the loop uses it (blocking calls: the loop runs them in a thread)."""

    def expected(self) -> Expected: ...
    def named_parameters(self) -> list[tuple[str, torch.Tensor]]: ...
    def digest(self) -> str: ...
    def load(self, tensors: dict[str, torch.Tensor]) -> None: ...
    def train_step(self) -> tuple[float, Payload]: ...
    def restore(self, payload: Payload) -> None: ...
    def settle(self, payload: Payload, result: RoundResult, contributed: bool) -> None: ...
    def save(self, meta: dict[str, Any]) -> None: ...
    def saved(self) -> dict[str, Any] | None: ...
    def resume(self, *, momentum: bool) -> None: ...


class RoundLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Prefixes every line with ``[peer round=N]``."""

    def __init__(self, peer_id: str, round_of: Any) -> None:
        super().__init__(logger, {})
        self.peer_id, self.round_of = peer_id, round_of

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"[{self.peer_id} round={self.round_of()}] {msg}", kwargs


@dataclass(eq=False)
class RoundLoop:
    """One peer's rounds until the run's last one, `stop`, or an unreachable run.

    Args:
        replica: the model, optimizer and data of this peer.
        membership, gatherer: the transport.
        peer_id: this peer's id (its metrics rows and checkpoint carry it).
        metrics: the JSON-lines file every round appends a row to; None: no rows (a FlexDeMo rank > 0).
        checkpoint_every: save every this many rounds (and at the end); 0: only at the end.
        stop: set it (SIGTERM) to end after the open round.
        stop_grace_s: after `stop`, how long to wait for the open round before abandoning it; None:
            wait for its end (the ranks of a FlexDeMo node must all take the same steps).
    """

    replica: Replica
    membership: Membership
    gatherer: Gatherer
    peer_id: str
    metrics: Path | None
    checkpoint_every: int = 10
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    stop_grace_s: float | None = STOP_GRACE_S
    round: int = 0
    digest: str = ""
    resyncs: int = 0
    """Whole-parameter downloads because this peer's digest differed from the canonical one (the
    `resyncs` field of every metrics row): each is the dense transfer the compressed rounds avoid."""
    total_rounds: int = 0
    row_extra: dict[str, Any] = field(default_factory=dict)
    """Fields added to every metrics row (a FlexDeMo node's rank count)."""
    unreachable: PeerUnavailable | None = None
    """Why `run` returned 1: the run could not be reached (None otherwise)."""
    log: RoundLog = field(init=False)

    def __post_init__(self) -> None:
        self.log = RoundLog(self.peer_id, lambda: self.round)

    async def run(self, info: JoinInfo) -> int:
        """Download the parameters to start from, resume the checkpoint, then run rounds.

        Returns:
            0 after the run's last round or a graceful stop; 1 if the run could not be reached.
        """
        self.round, self.total_rounds = info.round, info.total_rounds
        if self.total_rounds and self.round >= self.total_rounds:
            self.log.info("the run is over")
            return 0
        beats = None
        if info.heartbeat_interval_s > 0:  # alive from here on, the first download included
            beats = asyncio.create_task(keep_alive(self.membership, lambda: self.round, info.heartbeat_interval_s,
                                                   self.log))
        started = False
        try:
            first = await self.membership.first_parameters(info, self.replica.expected())
            if first is None:
                self.digest = await asyncio.to_thread(self.replica.digest)
                self.log.info("starting from the initial parameters (digest %s)", self.digest[:12])
            else:
                await self._load(first)
            await asyncio.to_thread(self._resume)
            started = True
            return await self._rounds(beats)
        except PeerUnavailable as e:
            self.log.error("%s", e)
            self.unreachable = e
            return 1
        finally:
            if beats is not None:
                beats.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beats
            if started:
                await asyncio.to_thread(self._save)

    async def _rounds(self, beats: asyncio.Task[None] | None) -> int:
        if self.metrics is not None:
            self.metrics.parent.mkdir(parents=True, exist_ok=True)
        with open(self.metrics, "a") if self.metrics is not None else contextlib.nullcontext(None) as metrics:
            while await self.membership.agree(not self.stop.is_set()
                                              and (not self.total_rounds or self.round < self.total_rounds)):
                if not await self.run_round(metrics):
                    break
                if beats is not None and beats.done():
                    beats.result()  # a bug in the heartbeat task: raise it here
        self.log.info("stopping" if self.stop.is_set() else "the run is over")
        return 0

    # -- state ---------------------------------------------------------------------------------------

    async def _load(self, params: Parameters) -> None:
        await asyncio.to_thread(self.replica.load, params.tensors)
        self.round, self.digest = params.round, await asyncio.to_thread(self.replica.digest)
        self.log.info("parameters of round %d loaded from %s (%d bytes, digest %s)", params.round, params.source,
                      params.size, self.digest[:12])

    def _save(self) -> None:
        self.replica.save({"peer_id": self.peer_id, "round": self.round, "param_digest": self.digest,
                           "resyncs": self.resyncs})

    def _resume(self) -> None:
        """Take the momentum from the checkpoint if it was saved at the round the parameters are at.

        Otherwise the momentum starts at zero, as a late joiner's does. The data stream continues
        where it stopped either way (same seed), so a restarted peer does not see its batches again,
        and so does the count of resyncs its metrics rows carry.
        """
        saved = self.replica.saved()
        if saved is None:
            return
        self.resyncs = int(saved.get("resyncs", 0))
        momentum = saved.get("peer_id") == self.peer_id and saved.get("round") == self.round
        self.replica.resume(momentum=momentum)
        if momentum:
            self.log.info("resumed the momentum from the checkpoint")
        else:
            self.log.info("checkpoint is from round %s: starting with zero momentum", saved.get("round"))

    # -- one round -----------------------------------------------------------------------------------

    async def gather_or_stop(self, payload: Payload, loss: float) -> RoundResult | None:
        """The round's outcome; None if `stop` came and the round did not end within `stop_grace_s`."""
        gather = asyncio.create_task(self.gatherer.gather(self.round, payload, loss=loss, param_digest=self.digest))
        if self.stop_grace_s is None:
            return await gather
        stopped = asyncio.create_task(self.stop.wait())
        try:
            await asyncio.wait({gather, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if not gather.done():
            self.log.info("stopping: waiting up to %.0f s for the round to close", self.stop_grace_s)
            await asyncio.wait({gather}, timeout=self.stop_grace_s)
        if not gather.done():
            gather.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gather
            return None
        return gather.result()

    def _settle(self, payload: Payload, result: RoundResult) -> str:
        """Restore and apply by the outcome, then the new digest (one trip to a worker thread)."""
        self.replica.settle(payload, result, self.peer_id in result.contributors)
        return self.replica.digest()

    async def run_round(self, metrics: TextIO | None) -> bool:
        """Train, gather and settle one round; False when the peer should stop (SIGTERM)."""
        await self.membership.begin_round(self.round, self.digest, self.replica.named_parameters)
        t0 = time.perf_counter()
        loss, payload = await asyncio.to_thread(self.replica.train_step)
        compute_s = time.perf_counter() - t0  # the blocking torch work: the step, then settling
        try:
            result = await self.gather_or_stop(payload, loss)
        except DemonetError as e:  # the payload reached no aggregate this peer will apply
            await asyncio.to_thread(self.replica.restore, payload)
            if isinstance(e, PeerUnavailable):
                raise
            if isinstance(e, Resync):  # the run holds other parameters
                self.resyncs += 1
            self.log.warning("%s: %s; catching up", type(e).__name__, e)
            await self._load(await self.membership.catch_up(e, self.round, self.replica.expected()))
            return True
        if result is None:
            await asyncio.to_thread(self.replica.restore, payload)
            self.log.info("abandoned the round")
            return False
        t1 = time.perf_counter()
        self.digest = await asyncio.to_thread(self._settle, payload, result)
        compute_s += time.perf_counter() - t1
        row: dict[str, Any] = {
            "round": self.round, "peer": self.peer_id, "loss": loss, "bytes_up": result.bytes_up,
            "bytes_down": result.bytes_down, "param_digest": self.digest, "round_time_s": time.perf_counter() - t0,
            "compute_s": compute_s, "contributors": len(result.contributors), "aborted": result.aborted,
            "canonical_digest": result.param_digest, **self.row_extra}
        if await self.membership.agree(bool(result.param_digest) and self.digest != result.param_digest):
            self.log.warning("digest %s after applying, the run has %s: downloading parameters", self.digest[:12],
                             result.param_digest[:12])
            await self._load(await self.membership.parameters(self.round + 1, self.replica.expected(), resync=True))
            self.resyncs += 1
            row["param_digest"], row["resynced"] = self.digest, True
        else:
            self.round += 1
        row["resyncs"], row["time"] = self.resyncs, time.time()
        if metrics is not None:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
        self.log.info("loss %.4f, up %d B, down %d B, %d contributors%s", loss, result.bytes_up, result.bytes_down,
                      len(result.contributors), " (aborted)" if result.aborted else "")
        if self.checkpoint_every and self.round % self.checkpoint_every == 0:
            await asyncio.to_thread(self._save)
        return True


def warm_up() -> None:
    """Pay torch's one-time costs before joining: the optimizer's lazy import of torch._dynamo and the
    first backward take seconds, and a peer admitted at once must train within the round timeout."""
    p = torch.zeros(2, requires_grad=True)
    torch.optim.SGD([p], lr=0.1)
    torch.autograd.backward((p * 2).sum())


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set `stop` while inside."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
