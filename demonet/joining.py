"""The transports a user's own loop joins a run over (`demonet.join`): a coordinator, or the DHT, each imported only
when used. Service layer: the gRPC client or the DHT peer's parts; never the user's loop (`demonet.joined`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from demonet.config import Config
from demonet.optim import DeMo
from demonet.train.data import data_seed
from demonet.transport import Gatherer, JoinInfo, Membership

__all__ = ["RunTransport", "open_coordinator", "open_dht"]


@dataclass
class RunTransport:
    """What a joined run trains over: its membership and gatherer, and how it stands when it starts."""

    membership: Membership
    gatherer: Gatherer
    info: JoinInfo
    prepare: Callable[[DeMo], Awaitable[JoinInfo]]
    """Called on the event loop with the user's optimizer right before the rounds start; where the run stands then."""
    maddrs: tuple[str, ...] = ()
    """DHT mode: this peer's multiaddrs, for the others' initial peers."""


async def open_coordinator(address: str, token: str, peer_id: str, root_cert: bytes | None,
                       reconnect_timeout_s: float, key: Path | None) -> RunTransport:
    from demonet.transport.coordinated import CoordinatorMembership
    from demonet.transport.grpc import GrpcClient
    from demonet.wire.identity import Identity

    identity = Identity.load_or_create(key) if key is not None else None
    membership = CoordinatorMembership(GrpcClient(address, token=token, peer_id=peer_id, root_cert=root_cert,
                                                  reconnect_timeout_s=reconnect_timeout_s, identity=identity),
                                       address)
    try:
        info = await membership.join()
    except BaseException:
        await membership.close()
        raise

    async def prepare(opt: DeMo) -> JoinInfo:
        return info  # the first download gets the round the coordinator is at by then

    return RunTransport(membership, membership.client, info, prepare)


async def open_dht(cfg: Config, token: str, peer_id: str, run: str, initial_peers: Sequence[str], total_rounds: int,
               options: Mapping[str, Any], key: Path | None) -> RunTransport:
    from demonet.dht.gatherer import DhtGatherer, DhtOptions
    from demonet.dht.membership import DhtMembership
    from demonet.dht.peer import allowed_keys
    from demonet.dht.rules import stacks_slices
    from demonet.wire.identity import Identity
    from demonet.wire.merge import MergeRules

    opts = DhtOptions(**{"run": run, "token": token, "initial_peers": tuple(initial_peers),
                         "window_s": cfg.net.round_timeout_s, "start_peers": cfg.net.start_peers,
                         "leave_after_s": cfg.net.leave_after_s, "verify_fraction": cfg.net.verify_slices,
                         "exclude_rounds": cfg.net.exclude_owner_rounds, "slice_entries": cfg.net.slice_entries,
                         "stack_slices": stacks_slices(cfg.optim.encoding), "rules": MergeRules.from_config(cfg),
                         "allowed": allowed_keys(cfg), **options})
    identity = Identity.load_or_create(key) if key is not None else None
    gatherer = await DhtGatherer.create(opts, peer_id, {}, identity=identity)
    membership = DhtMembership(gatherer, JoinInfo(
        peer_id=peer_id, round=0, run_config=cfg.to_dict(), data_seed=data_seed(cfg.train.seed, peer_id),
        round_timeout_s=opts.window_s, heartbeat_interval_s=0.0, total_rounds=total_rounds))
    try:
        await gatherer.check_initial_peers()
    except BaseException:
        await membership.close()
        raise

    async def prepare(opt: DeMo) -> JoinInfo:
        gatherer.specs = dict(opt.param_specs())
        return await membership.join()  # where the run stands now, not when `join` was called

    return RunTransport(membership, gatherer, membership.info, prepare, tuple(gatherer.visible_maddrs()))
