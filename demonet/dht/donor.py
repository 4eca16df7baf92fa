"""Parameters between DHT peers: a member serves its parameters of a round; a joiner loads them from donors.

Net layer over demonet.dht.node's streams and the wire layer's dense parameters (demonet.wire.params).
It does not read the DHT: the donors' published states come from the round board. Must not import
grpc, demonet.transport.grpc, or the round board.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload, PeerUnavailable
from demonet.wire import params as wire_params
from demonet.wire.digest import param_digest

from . import rules
from .node import DhtNode
from .streams import Reply

__all__ = ["ParamDonor"]

logger = logging.getLogger(__name__)

_MAX_DONORS = 4

NamedParams = Callable[[], list[tuple[str, torch.Tensor]]]
Specs = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
"""Parameter name -> (shape, dtype), in the model's order."""


class ParamDonor:
    """Serves this peer's parameters at the start of the round it offers; loads a round's parameters from others."""

    def __init__(self, node: DhtNode) -> None:
        self.opts, self.peer_id = node.opts, node.peer_id
        self._streams = node.streams
        self._params: tuple[int, NamedParams] | None = None
        node.streams.serve(pb.DHT_KIND_PARAMS, self._serve_params)

    def offer(self, round: int, named_params: NamedParams) -> None:
        """Serve the parameters that `named_params` gives as those of `round`, until `withdraw`."""
        self._params = (round, named_params)

    def withdraw(self) -> None:
        self._params = None

    def donors(self, round: int, states: Mapping[str, Mapping[str, Any]]) -> tuple[str, list[str]]:
        """(the majority digest, the members that published it and can serve it) of `round`'s `states`.

        Raises:
            PeerUnavailable: no state, or no reachable member with the majority digest.
        """
        digests = {p: v["digest"] for p, v in states.items() if isinstance(v.get("digest"), str)}
        if not digests:
            raise PeerUnavailable(f"no peer serves the parameters of round {round}")
        good = rules.majority_digest(digests)
        donors = sorted(p for p in digests if digests[p] == good and p != self.peer_id
                        and not states[p].get("client") and isinstance(states[p].get("address"), str))
        if not donors:
            raise PeerUnavailable(f"no reachable donor for the parameters of round {round}")
        return good, donors

    async def load(self, round: int, expected: Specs, good: str, donors: list[str],
                   states: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, torch.Tensor], int, list[str]]:
        """Load the parameters at the start of `round` from `donors`, a range of tensors from each.

        A range whose donor fails or sends bad data is asked from the next donor. The whole is
        checked against the donors' digest `good`.

        Returns:
            (tensors by name, bytes received, the donors that served a range).

        Raises:
            PeerUnavailable: a range no donor could serve.
            InvalidPayload: the assembled parameters do not match the donors' digest.
        """
        sizes = [(name, max(1, int(torch.Size(shape).numel()) * dtype.itemsize)) for name, (shape, dtype)
                 in expected.items()]
        ranges = rules.param_ranges(sizes, min(len(donors), _MAX_DONORS))
        results = await asyncio.gather(*(self._load_range(round, i, len(ranges), names, expected, donors, states)
                                          for i, names in enumerate(ranges)))
        tensors: dict[str, torch.Tensor] = {}
        for part, _, _ in results:
            tensors.update(part)
        tensors = {name: tensors[name] for name in expected}
        if param_digest(tensors.items()) != good:
            raise InvalidPayload(f"the parameters of round {round} do not match the donors' digest")
        return tensors, sum(r[1] for r in results), sorted({r[2] for r in results})

    async def _load_range(self, round: int, i: int, n: int, names: list[str], expected: Specs, donors: list[str],
                          states: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, torch.Tensor], int, str]:
        specs = {name: expected[name] for name in names}
        errors = []
        for j in range(len(donors)):
            donor = donors[(i + j) % len(donors)]  # range i starts at donor i: different donors, different ranges
            try:
                _, data = await self._streams.call(states[donor]["address"], pb.DHT_KIND_PARAMS, round, slice=i,
                                                   num_slices=n, timeout_s=self.opts.exchange_timeout_s * 3)
                got, tensors = await asyncio.to_thread(wire_params.decode_parameters, data, expected=specs)
                if got != round:
                    raise InvalidPayload(f"{donor} sent the parameters of round {got}")
                return tensors, len(data), donor
            except (PeerUnavailable, InvalidPayload) as e:
                errors.append(f"{donor}: {e}")
                logger.warning("[%s] parameter range %d/%d from %s failed: %s; trying another donor", self.peer_id,
                               i + 1, n, donor, e)
        raise PeerUnavailable(f"no donor served parameter range {i + 1}/{n} of round {round}: {'; '.join(errors)}")

    async def _serve_params(self, head: pb.DhtMessage, data: bytes | None) -> Reply:
        """Parameters at the start of round `r`, range `i` of `n`; encoded at once in the event loop, so
        the optimizer cannot step them meanwhile (it steps after `gather` returned, which also ends serving)."""
        r, i, n = head.round, head.slice, head.num_slices
        if self._params is None or self._params[0] != r or not 0 <= i < n:
            return Reply(error=f"no parameters of round {r} here")
        named = self._params[1]()
        sizes = [(name, max(1, t.numel() * t.element_size())) for name, t in named]
        ranges = rules.param_ranges(sizes, n)
        if i >= len(ranges):
            return Reply(error=f"no parameter range {i} of {n}")
        wanted = set(ranges[i])
        return Reply(data=wire_params.encode_parameters([(name, t) for name, t in named if name in wanted], round=r))
