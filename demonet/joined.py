"""A user's own training loop as a peer of a run: `join` and the optimizer it hands out.

Service layer. The user's thread trains; a background thread runs an asyncio event loop with the one
`demonet.loop.RoundLoop` over the run's transport (the gRPC coordinator, or the DHT: each
imported only when used). The loop's replica is the user's model, and its `train_step` is a handoff:
it tells the user's thread that the loop waits for the round, and blocks until `opt.step()` hands
the round back. Joining, heartbeats, catch-up, resyncs, restores, metrics rows and checkpoints are
therefore the loop's own. docs/own-loop.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import queue
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from demonet.config import TOKEN_ENV, Config, load_config
from demonet.errors import InvalidPayload, PeerUnavailable
from demonet.joining import RunTransport, open_coordinator, open_dht
from demonet.loop import RoundLog, RoundLoop
from demonet.loop.lifecycle import warm_up
from demonet.optim import DeMo, Payload
from demonet.train.trainer import Trainer
from demonet.transport import JoinInfo, keep_alive

__all__ = ["CLOSE_TIMEOUT_S", "JoinedDeMo", "JoinedRun", "join"]

CLOSE_TIMEOUT_S = 60.0
"""Leaving waits this long for the loop to end (the open round, at most `STOP_GRACE_S` of it, and the
last checkpoint), then cancels it."""

_LEAVE = object()
"""Put on the loop's queue by `JoinedRun.close`: the user's code has left."""


class _Left(Exception):
    """Raised in the loop's `train_step` when the user's code left while the loop waited for a round."""


class _Handoff(Trainer):
    """The user's model as the loop's replica: `train_step` waits for the user's `opt.step()`."""

    def __init__(self, model: torch.nn.Module, opt: DeMo, *, checkpoint: Path | None,
                 to_user: queue.Queue[tuple[str, BaseException | None]], to_loop: queue.Queue[Any]) -> None:
        device = next(model.parameters()).device
        super().__init__(model, opt, iter(()), _no_loss, device=device, checkpoint=checkpoint)
        self.to_user, self.to_loop = to_user, to_loop

    def forward_backward(self, until: float | None = None) -> float:
        """Hand the round to the user's thread and wait for its loss: its backward is done by then. The user's
        loop trains what it trains (`until` is not used); its samples are the run's batch size, or what
        `opt.step(samples=...)` says."""
        self.to_user.put(("ready", None))
        got = self.to_loop.get()
        if got is _LEAVE:
            raise _Left()
        loss, samples = got
        self.pace.trained(1, samples)
        return float(loss)

    def compress(self, undoable: bool = False) -> Payload:
        """The user's gradients into the momentum, and the round's payload (the user's loop zeroes them)."""
        return self.opt.compress(undoable=undoable)


def _no_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    raise AssertionError("a joined run's user computes the loss")


class JoinedDeMo(DeMo):
    """DeMo with the run's [optim] whose `step()` is one round of the run (`JoinedRun.optimizer` builds it).

    `step` compresses the gradients, submits the payload, waits for the round's outcome and applies it
    (or restores the payload); `zero_grad`, `state_dict` and `param_groups` are DeMo's. Changing `lr`
    or `weight_decay` would make this peer apply aggregates differently from the others: do not.
    """

    _run: JoinedRun | None = None

    def step(self, closure: Callable[[], Any] | None = None, *,
             loss: torch.Tensor | float | None = None, samples: int | None = None) -> Any:
        """One round; returns the closure's loss, if a closure was given.

        Args:
            closure: recomputes the loss (torch's optimizer convention); it is what the round reports.
            loss: the round's loss for the metrics row and the coordinator (NaN when neither is given).
            samples: how many samples the round's gradients are the mean of: the payload's weight in the
                merge (default: the run's `[train] batch_size`).

        Raises:
            PeerUnavailable: the run could not be reached (`JoinedRun.done` is then true).
            RuntimeError: the run is over, or the optimizer is not a joined run's.
        """
        if self._run is None:
            raise RuntimeError("this JoinedDeMo belongs to no run: build it with run.optimizer(model)")
        value = None
        if closure is not None:
            with torch.enable_grad():
                value = closure()
        reported = value if loss is None else loss
        if isinstance(reported, torch.Tensor):
            reported = reported.detach()
        if samples is not None and samples < 1:
            raise ValueError(f"samples should be >= 1, got {samples}")
        self._run.exchange(math.nan if reported is None else float(reported), samples)
        return value


class JoinedRun:
    """A run joined by the user's own training loop (`join` returns it; use it as a context manager).

    Attributes:
        peer_id: this peer's id.
        reason: why `done` became true: "the run is over", "stopped", "left", or the error.
    """

    def __init__(self, peer_id: str, *, out: Path | None, checkpoint_every: int) -> None:
        self.peer_id, self.out, self.checkpoint_every = peer_id, out, checkpoint_every
        self.reason = ""
        self._config: Config | None = None
        self._aio = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._aio.run_forever, name=f"demonet-{peer_id}", daemon=True)
        self._thread.start()
        self._stop = asyncio.Event()
        self._to_user: queue.Queue[tuple[str, BaseException | None]] = queue.Queue()
        self._to_loop: queue.Queue[Any] = queue.Queue()
        self._transport: RunTransport | None = None
        self._loop: RoundLoop | None = None
        self._beats: asyncio.Task[None] | None = None
        self._drive: asyncio.Task[None] | None = None
        self._finished = self._closed = self._stopping = False
        self._old_sigterm: Any = None

    # -- what the user's loop reads -------------------------------------------------------------------

    @property
    def config(self) -> Config:
        """The run's config: the coordinator's, or the one given in DHT mode (build the model from its [model])."""
        assert self._config is not None
        return self._config

    @property
    def round(self) -> int:
        """The round the next `opt.step()` belongs to."""
        if self._loop is not None:
            return self._loop.round
        return self._transport.info.round if self._transport is not None else 0

    @property
    def done(self) -> bool:
        """True after the run's last round, a stop (SIGTERM, `stop`), or when the run became unreachable."""
        return self._finished or self._stopping

    @property
    def digest(self) -> str:
        """This peer's parameter digest after the last round ("" before `optimizer`)."""
        return self._loop.digest if self._loop is not None else ""

    @property
    def maddrs(self) -> tuple[str, ...]:
        """DHT mode: this peer's multiaddrs, to give the other peers as initial peers; () otherwise."""
        return self._transport.maddrs if self._transport is not None else ()

    # -- the user's calls -----------------------------------------------------------------------------

    def optimizer(self, model: torch.nn.Module) -> JoinedDeMo:
        """Load the run's parameters into `model` and build DeMo over it with the run's [optim].

        Raises:
            ValueError: the model's parameter names, shapes or dtypes differ from the run's (the first
                difference is named; the model is not changed).
            PeerUnavailable: the run could not be reached.
        """
        if self._loop is not None:
            raise RuntimeError("run.optimizer was called already: a joined run trains one model")
        assert self._transport is not None
        opt = JoinedDeMo.from_settings(model.named_parameters(), self.config.optim)
        assert isinstance(opt, JoinedDeMo)
        replica = _Handoff(model, opt, checkpoint=self.out / f"peer-{self.peer_id}.pt" if self.out else None,
                           to_user=self._to_user, to_loop=self._to_loop)
        metrics = self.out / f"metrics-{self.peer_id}.jsonl" if self.out else None
        self._loop = RoundLoop(replica, self._transport.membership, self._transport.gatherer, self.peer_id, metrics,
                               self.checkpoint_every, self._stop)
        self._call(self._start(opt))
        try:
            self._wait()  # until the loop waits for the first round: the parameters are loaded
        except InvalidPayload as e:
            raise ValueError(f"the model does not fit the run's parameters: {e}") from e
        opt._run = self
        return opt

    def exchange(self, loss: float, samples: int | None = None) -> None:
        """Hand the round to the loop and block until its outcome is applied (`JoinedDeMo.step`)."""
        if self._loop is None:
            raise RuntimeError("call run.optimizer(model) first")
        if self._finished:
            raise RuntimeError(f"the run is done ({self.reason})")
        self._to_loop.put((loss, samples if samples is not None else self.config.train.batch_size))
        self._wait()

    def stop(self) -> None:
        """End after the open round, as SIGTERM does: `done` becomes true (thread-safe)."""
        self.reason, self._stopping = self.reason or "stopped", True
        self._aio.call_soon_threadsafe(self._stop.set)

    def close(self) -> None:
        """Leave the run: end the loop (the last checkpoint is saved), close the transport, stop the thread."""
        if self._closed:
            return
        self._closed = True
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
        self._aio.call_soon_threadsafe(self._stop.set)  # a round in flight: wait for it at most STOP_GRACE_S
        self._to_loop.put(_LEAVE)  # a loop waiting for the user's next round leaves at once
        with contextlib.suppress(Exception):
            self._call(self._shutdown(), timeout_s=CLOSE_TIMEOUT_S + 30.0)
        self._aio.call_soon_threadsafe(self._aio.stop)
        self._thread.join(timeout=10.0)
        if not self._thread.is_alive():
            self._aio.close()

    def __enter__(self) -> JoinedRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the background thread ------------------------------------------------------------------------

    def _call(self, coro: Awaitable[Any], timeout_s: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._aio).result(timeout_s)  # type: ignore[arg-type]

    def _open(self, make: Callable[[], Awaitable[RunTransport]]) -> JoinedRun:
        try:
            self._call(self._open_async(make))
        except BaseException:
            self.close()
            raise
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, lambda *_: self.stop())
        return self

    async def _open_async(self, make: Callable[[], Awaitable[RunTransport]]) -> None:
        await asyncio.to_thread(warm_up)
        self._transport = t = await make()
        self._config = load_config(None, {}, overrides=t.info.run_config)
        if t.info.heartbeat_interval_s > 0:  # a member while the user builds the model
            self._beats = asyncio.create_task(keep_alive(t.membership, lambda: t.info.round,
                                                         t.info.heartbeat_interval_s,
                                                         RoundLog(self.peer_id, lambda: self.round)))

    async def _start(self, opt: DeMo) -> None:
        assert self._transport is not None
        info = await self._transport.prepare(opt)
        if self._beats is not None:  # the loop beats from here on
            self._beats.cancel()
        self._drive = asyncio.create_task(self._run_loop(info))

    async def _run_loop(self, info: JoinInfo) -> None:
        assert self._loop is not None
        error: BaseException | None = None
        try:
            if await self._loop.run(info):
                error = self._loop.unreachable or PeerUnavailable("the run could not be reached")
                self.reason = f"unreachable: {error}"
            else:
                self.reason = "stopped" if self._stop.is_set() else "the run is over"
        except _Left:
            self.reason = self.reason or "left"
        except Exception as e:  # handed to the user's thread, which raises it
            error, self.reason = e, f"failed: {e}"
        finally:
            self._to_user.put(("done", error))

    def _wait(self) -> None:
        kind, error = self._to_user.get()
        if kind == "ready":
            return
        self._finished = True
        if error is not None:
            raise error

    async def _shutdown(self) -> None:
        if self._drive is not None:
            await asyncio.wait({self._drive}, timeout=CLOSE_TIMEOUT_S)
        if self._transport is not None:
            with contextlib.suppress(Exception):
                await self._transport.membership.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await asyncio.wait_for(self._aio.shutdown_default_executor(), 30.0)


# The public entry point takes the `demonet peer` flags as keywords (more than STYLE's 8 arguments):
# users call it once, by name, and each keyword is documented below.
def join(coordinator: str | None = None, *, token: str | None = None, peer_id: str | None = None,
         out: str | Path | None = None, checkpoint_every: int = 10, root_cert: bytes | None = None,
         reconnect_timeout_s: float = 120.0, dht_initial_peers: Sequence[str] | None = None, run: str = "demonet",
         config: str | Path | Config | None = None, steps: int | None = None,
         dht_options: Mapping[str, Any] | None = None, key: str | Path | None = None) -> JoinedRun:
    """Join a run from your own training loop (docs/own-loop.md).

    Args:
        coordinator: HOST:PORT of the run's coordinator (coordinator mode).
        token: the run token (default: the DEMONET_TOKEN environment variable).
        peer_id: this peer's id (default HOST-PID); the same id resumes its checkpoint in `out`.
        out: folder for ``metrics-<peer_id>.jsonl`` and the checkpoint ``peer-<peer_id>.pt``; None: neither.
        checkpoint_every: save every this many rounds (and on leaving); 0: only on leaving.
        root_cert: PEM root certificate(s) of a TLS coordinator.
        reconnect_timeout_s: how long calls keep retrying an unreachable coordinator.
        dht_initial_peers: DHT mode (no coordinator): multiaddrs of peers in the run; [] starts a new DHT.
        run: DHT mode: the run's name in the DHT.
        config: DHT mode: the run's config (a TOML path or a `Config`), the same for every peer; None:
            the defaults with the DEMONET_* environment variables.
        steps: DHT mode: rounds in the run (default: train.steps).
        dht_options: DHT mode: more `demonet.dht.gatherer.DhtOptions` fields (host_maddrs, client_mode, ...).
        key: this peer's Ed25519 key file (`demonet keygen`), made if missing; its peer id is bound to it (in
            DHT mode it signs the peer's records and messages). Default: ``<out>/peer-<peer_id>.key``, or with
            no `out` a key for this process alone.

    Raises:
        ValueError: neither or both of `coordinator` and `dht_initial_peers`, or no token.
        PeerUnavailable: the run could not be reached.
    """
    if (coordinator is None) == (dht_initial_peers is None):
        raise ValueError("give either coordinator='HOST:PORT' or dht_initial_peers=[...] (DHT mode)")
    token = token if token is not None else os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(f"no token: pass token=... or set {TOKEN_ENV}")
    peer_id = peer_id or f"{socket.gethostname()}-{os.getpid()}"
    folder = Path(out) if out is not None else None
    key_file = Path(key) if key is not None else folder / f"peer-{peer_id}.key" if folder is not None else None
    if coordinator is not None:
        address = coordinator
        return JoinedRun(peer_id, out=folder, checkpoint_every=checkpoint_every)._open(
            lambda: open_coordinator(address, token, peer_id, root_cert, reconnect_timeout_s, key_file))
    cfg = config if isinstance(config, Config) else load_config(config, os.environ)
    if cfg.optim.base == "adamw":
        raise ValueError("DHT mode supports optim.base sign or sgd; adamw joiners would not get the Adam moments")
    total = steps if steps is not None else cfg.train.steps
    if total < 1:
        raise ValueError("steps should be >= 1")
    initial = tuple(dht_initial_peers or ())
    return JoinedRun(peer_id, out=folder, checkpoint_every=checkpoint_every)._open(
        lambda: open_dht(cfg, token, peer_id, run, initial, total, dht_options or {}, key_file))
