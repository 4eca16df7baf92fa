"""The DHT-mode `Gatherer`: peers meet on a hivemind DHT and exchange payloads over its libp2p streams.

Net layer: a facade over its parts, imported only when DHT mode is asked for (hivemind is the
optional extra ``dht``): the node (demonet.dht.node: signed records, streams; hivemind's node:
demonet.dht.hive), the round board (board: announcements, freeze, joiners), the exchange
(exchange: reduce-scatter, merge, all-gather) and the parameter donor (donor). Must not import grpc
or demonet.transport.grpc.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping

import torch

from demonet.errors import InvalidPayload
from demonet.optim import Payload
from demonet.transport import Digest, NotMember, Pace, Resync, RoundResult
from demonet.wire.identity import Identity
from demonet.wire.merge import check_samples
from demonet.wire.pace import RoundPace

from . import rules
from .ahead import encode_parts
from .board import FrozeWithout, RoundBoard
from .donor import ParamDonor
from .exchange import SliceExchange
from .node import DhtNode
from .options import DhtOptions
from .validators import HmacValidator
from .view import DhtView

__all__ = ["DhtGatherer", "DhtOptions", "HmacValidator"]

logger = logging.getLogger(__name__)


class DhtGatherer:
    """One peer's node in the DHT and its libp2p endpoint; a `Gatherer`. Create it with `DhtGatherer.create`.

    Timeouts (DHT time, the same clock on every peer):

    - ``window_s``: from a round's first announcement to its freeze at the latest.
    - ``exchange_timeout_s``: parts must reach their owners this long after the freeze, and merged
      slices must be fetched this long after that; a slice still missing then is asked from the
      other members, and dropped by everyone if none holds it.
    """

    digest_follows = False
    """A round is announced with the digest it starts from: `gather` waits for it before anything else."""

    def __init__(self, node: DhtNode, specs: rules.Specs) -> None:
        self.opts, self.peer_id, self.specs = node.opts, node.peer_id, dict(specs)
        self._node = node
        self._board = RoundBoard(node)
        self._exchange = SliceExchange(node)
        self._donor = ParamDonor(node)
        self.view: DhtView | None = None
        """This peer's view of the run for its dashboard, fed each round; None: no dashboard."""
        self._board.on_minority = self._minority
        self._excluded: frozenset[str] = frozenset()  # the owners left out of the last round (for the log)
        self._slow: frozenset[str] = frozenset()  # the members slow by their link in the last round (for the log)
        self._steady: tuple[int, list[str], list[str], dict[str, str]] | None = None
        """(r, members, owners, addresses) of the last round when it was whole (every member's payload in,
        no joiner, no slice lost): round r + 1's parts are sent ahead of its freeze, cut for the same."""
        opts = node.opts
        self.pace = RoundPace(fixed_s=opts.round_s, lockstep=opts.lockstep, max_micro_batches=opts.max_micro_batches,
                              round_timeout_s=opts.window_s, spans=opts.spans, late=False)
        """The round length every round's result names (`RoundResult.next_round_s`), from the frozen members'
        announced speeds: each peer computes it from the same announcements (docs/dht.md#mixed-speed-peers)."""
        self._encoded: tuple[int, rules.SlicePlan, Payload, list[bytes]] | None = None
        """(round, plan, payload, parts): the parts `encode_ahead` encoded in the training's thread, and the
        payload they were cut from (`gather` sends them only for that very payload)."""

    def reload_allowlist(self, allowed: Mapping[bytes, str | None]) -> list[str]:
        """A new allowlist (`keys.KeyBook.reload`): returns the peer ids whose key it no longer admits."""
        return self._node.book.reload(allowed)

    @classmethod
    async def create(cls, opts: DhtOptions, peer_id: str, specs: rules.Specs, *,
                     identity: Identity | None = None) -> DhtGatherer:
        """Start this peer's DHT node (a p2pd daemon) and serve the streams of its parts.

        `identity` (this peer's Ed25519 key) signs its records and stream messages; None: a new key for
        this process alone (a restart is then another key, which the other peers do not take for this id).

        The initial peers may not be up yet (they start at the same time, or restart): the node is
        started again every few seconds for up to ``bootstrap_timeout_s``.

        Raises:
            PeerUnavailable: no initial peer could be reached in that time.
        """
        node = await DhtNode.start(opts, peer_id, identity)
        try:
            self = cls(node, specs)  # its parts register their stream handlers before any request can come
            await node.streams.open()
        except BaseException:
            await node.close()
            raise
        return self

    @property
    def refused(self) -> int:
        """Stream messages refused (bad MAC, another run, replayed, unknown sender, bad signature, a part's
        sample count outside [1, max_samples_per_round])."""
        return self._node.streams.refused

    @property
    def capped(self) -> int:
        """Payloads whose claimed samples this peer capped in the slices it merged as their owner."""
        return self._exchange.capped

    def visible_maddrs(self) -> list[str]:
        return self._node.visible_maddrs()

    async def close(self) -> None:
        with contextlib.suppress(Exception):  # noqa: BLE001 - a store that failed was logged; closing anyway
            await self._board.stored()
        await self._node.close()

    async def check_initial_peers(self) -> int:
        """Ping the initial peers' stream handlers; returns how many answered as peers of this run.

        Raises:
            PermissionError: one refused this peer's messages, or answered without the run token's HMAC.
        """
        return await self._node.check_initial_peers()

    # -- joining ---------------------------------------------------------------------------------------

    async def head_round(self) -> int | None:
        """The latest round any peer of the run has started, or None if the DHT knows no run yet."""
        return await self._board.head_round()

    async def leave(self, round: int) -> bool:
        """Say that this peer leaves the run before `round` (`RoundBoard.leave`); whether every node took it."""
        return await self._board.leave(round)

    async def register(self, rounds: Iterable[int]) -> None:
        """Ask to be admitted at these rounds (the members of the round before decide at its freeze)."""
        await self._board.register(rounds)

    def offer(self, round: int, named_params: Callable[[], list[tuple[str, torch.Tensor]]]) -> None:
        """Serve this peer's parameters as those of `round` until the round ends (its state, which
        joiners read to find donors, is stored with its announcement)."""
        self._donor.offer(round, named_params)

    async def admitted(self, round: int, timeout_s: float) -> bool | None:
        """Whether the members of `round` expect this peer (None: no member said so within `timeout_s`)."""
        return await self._board.admitted(round, timeout_s)

    async def load_parameters(self, round: int, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
                              ) -> tuple[dict[str, torch.Tensor], int, list[str]]:
        """Load the parameters at the start of `round` from several donors, a range of tensors from each.

        The donors are the members that published the majority digest; a range whose donor fails
        or sends bad data is asked from the next donor. The whole is checked against the digest.

        Returns:
            (tensors by name, bytes received, the donors that served a range).

        Raises:
            PeerUnavailable: no donor, or a range no donor could serve.
            InvalidPayload: the assembled parameters do not match the donors' digest.
        """
        states = await self._board.member_states(round)
        good, donors = self._donor.donors(round, states)
        self._board.adopt_expected(round, states, donors)
        return await self._donor.load(round, expected, good, donors, states)

    # -- one round -------------------------------------------------------------------------------------

    def _minority(self, round: int, minority: bool) -> None:
        if self.view is not None:
            self.view.minority(round, minority)

    def _steady_before(self, round: int) -> tuple[int, list[str], list[str], dict[str, str]] | None:
        """`_steady` where it is the round just before `round` and its members are all `round` waits for: the
        parts are then cut for them ahead of the freeze; else None."""
        steady = self._steady
        if steady is None or steady[0] != round - 1 or self._board.expected.get(round) != set(steady[1]):
            return None
        return steady

    def encode_ahead(self, round: int) -> Callable[[Payload], None] | None:
        """Where `round` will likely send its parts ahead (`gather`: the round before was whole, and its members
        are all this round waits for), a function that cuts and encodes the payload's parts for them, to run
        in the training's thread right after the compress (`demonet.transport.EncodesAhead`); else None.

        The peer that trains last then sends its parts with its announcement, instead of encoding them on
        its event loop while every peer's exchange runs on the same cores."""
        steady = self._steady_before(round)
        if steady is None:
            return None
        plan = self._exchange.plan_for(self.specs, steady[2])

        def encode(payload: Payload) -> None:
            self._encoded = (round, plan, payload, encode_parts(round, plan, payload))

        return encode

    async def gather(self, round: int, payload: Payload, *, loss: float, param_digest: Digest,
                     samples: int = 1, pace: Pace | None = None) -> RoundResult:
        """Announce, freeze the membership, reduce-scatter the payload's slices, all-gather the merged slices.

        See `demonet.transport.Gatherer.gather`. `RoundResult.param_digest` is empty: in DHT mode the
        digests are compared at the next round's freeze (a peer whose digest is not the majority's
        gets `Resync` there and loads the parameters again). `samples` travels with each part: the
        payload's weight in every slice's merge (capped there, as by the coordinator).

        Raises:
            NotMember: this peer announced after the round froze.
            Resync: this peer's parameters are not the majority's.
            ValueError: `samples` is below 1 or above the run's max_samples_per_round (nothing is sent).
        """
        try:
            check_samples(samples, self.opts.rules.max_samples)
        except InvalidPayload as e:  # this peer's own count: a bug or a bad argument, not a peer's fault
            raise ValueError(str(e)) from None
        digest = await param_digest.known()  # a round is announced with it
        r, board = round, self._board
        expected = board.expected.get(r)
        if expected is not None:  # parts cut for another member list that came after the exchange
            expected |= self._exchange.other_lists(r - 1)  # in place: the board holds this very set
        if self.view is not None:
            self.view.entered(r)
        # The round before was whole, and its members are all this round waits for: send the parts ahead,
        # cut for them, once the announcement's store is on its way (`SliceExchange.send_ahead`).
        steady = self._steady_before(r)
        self._steady = None
        encoded, self._encoded = self._encoded, None
        ahead = None
        if steady is not None:
            def ahead() -> None:
                self._exchange.send_ahead(r, payload, specs=self.specs, members=steady[1], owners=steady[2],
                                          addresses=steady[3], samples=samples,
                                          encoded=(encoded[1], encoded[3]) if encoded is not None
                                          and encoded[0] == r and encoded[2] is payload else None)
        try:
            return await self._gather(r, payload, digest, loss, ahead, samples, pace)
        finally:
            self._exchange.drop_ahead(r)  # not taken up by the exchange: the round ended before it, or froze otherwise

    async def _gather(self, r: int, payload: Payload, param_digest: str, loss: float,
                      ahead: Callable[[], None] | None, samples: int, pace: Pace | None) -> RoundResult:
        board, view = self._board, self.view
        gets = self._node.gets
        try:
            frozen, announced = await board.enter(r, param_digest, loss, stored=ahead, pace=pace)
        except FrozeWithout as e:  # a member that counted this peer in is told at once, and does not wait for it
            await self._exchange.left_out(r, e.members)
            raise
        digests = {p: announced[p].digest for p in frozen.members}
        next_round_s = self._next_round_s(frozen.members, announced)
        spans = self.peer_id in self.pace.spanning
        good = rules.majority_digest(digests)
        members = [p for p in frozen.members if digests[p] == good]
        if view is not None:
            view.frozen(r, frozen.members, announced, good, spanning=self.pace.spanning)
        # Joiners admitted for the next round: registered among this round's announcements.
        joiners = board.joiners(r + 1, frozen.deadline)
        if param_digest != good:
            board.previous[r + 1] = set(members)
            board.expected[r + 1] = set(members) | joiners
            raise Resync(f"round {r}: parameter digest {param_digest[:12]} is not the majority's {good[:12]}")
        if r in board.waited:  # a majority found after a wait, past its exchange: nobody applies the round
            # Nobody contributed, so the base stays (`rules.next_base`): a late majority may count a far-side
            # member whose announcement was stored before a cut, and a base cut down to it would let the
            # near side hold a majority of it (2 of {b, c, d} when {a, b} | {c, d} split).
            board.previous[r + 1] = set(rules.next_base(board.bases.get(r), members, ()))
            board.expected[r + 1] = set(members) | joiners
            self._donor.withdraw()
            if view is not None:
                view.exchanged(r, contributors=(), slice_owners=(), aborted=True, bytes_up=0, bytes_down=0)
            return RoundResult(round=r, aggregate=None, contributors=(), param_digest="", aborted=True,
                               bytes_up=0, bytes_down=0, next_round_s=next_round_s, spans=spans)
        owners = [p for p in members if not announced[p].client]
        if not owners:
            raise NotMember(f"round {r}: no member can be dialed (all are in client mode)")
        excluded = rules.excluded_owners(announced, members, r, self.opts.exclude_rounds)
        if excluded and not set(owners) <= excluded:  # reported by a majority: they own no slice for a while
            owners = [p for p in owners if p not in excluded]
            if excluded != self._excluded:
                logger.warning("[%s round=%d] %s own no slice: reported by a majority for disagreeing slices",
                               self.peer_id, r, ", ".join(sorted(excluded)))
        self._excluded = excluded
        slow = rules.slow_links(announced, members)
        if slow and not set(owners) <= slow:  # their links would hold every member's exchange
            owners = [p for p in owners if p not in slow]
            if slow != self._slow:
                logger.info("[%s round=%d] %s own no slice: slow by their link", self.peer_id, r,
                            ", ".join(sorted(slow)))
        self._slow = slow
        addresses = {p: announced[p].address for p in members}
        done = await self._exchange.run(r, payload, specs=self.specs, members=members, owners=owners,
                                        addresses=addresses, frozen_at=frozen.deadline, samples=samples)
        for p in done.disagreed:
            board.reports[p] = r
        if view is not None:
            view.verified(r, disagreed=sorted(done.disagreed), excluded=sorted(excluded), capped=sorted(done.capped),
                          max_ratio=self.opts.rules.max_sample_ratio)
        # The next round waits for the members whose payload and own slice made it into this one, and for
        # the peers that froze this one with another member list (alive: the lists agree again once both
        # expect the same peers), and counts its majority over this round's members only if the
        # contributors were a majority.
        base = board.bases.get(r)
        board.expected[r + 1] = (set(done.contributors) - done.dead_owners) | done.other_lists | joiners
        board.previous[r + 1] = set(rules.next_base(base, members, done.contributors))
        # The slices this peer got must hold the payloads of a majority of the base, as the freeze must
        # hold its announcements: a peer cut off right after it froze with the others' announcements
        # merges its own slice from its own part alone, and would apply that round by itself.
        applies = done.aggregate is not None and rules.has_majority(done.contributors, base)
        if done.aggregate is not None and not applies:
            logger.warning("[%s round=%d] the slices this peer got hold the payloads of %s only, not a majority of "
                           "the %d members of the round before: applying nothing (cut off during the exchange?)",
                           self.peer_id, r, ", ".join(done.contributors), len(base or ()))
        self._donor.withdraw()
        if view is not None:
            view.exchanged(r, contributors=done.contributors, slice_owners=done.slice_owners, aborted=not applies,
                           claims=done.claims, topks={**done.topks, self.peer_id: payload.topk()},
                           max_ratio=self.opts.rules.max_sample_ratio,
                           bytes_up=done.bytes_up, bytes_down=done.bytes_down)
        if applies and not joiners and set(done.contributors) == set(members) and not done.dead_owners \
                and not done.disagreed:
            self._steady = (r, members, owners, addresses)
            self._exchange.expect(r + 1, specs=self.specs, members=members, owners=owners)
        phases = {**board.phases(), **done.phases, "dht_reads": self._node.gets - gets, "verified": done.checked}
        upload = self._node.streams.uploads.of(r)  # this peer's parts, timed by their receipts (its link's k)
        if upload is not None:
            phases["upload_bytes"], phases["upload"] = float(upload[0]), upload[1]
        if not applies:
            return RoundResult(round=r, aggregate=None, contributors=(), param_digest="", aborted=True,
                               bytes_up=done.bytes_up, bytes_down=done.bytes_down, phases=phases,
                               next_round_s=next_round_s, spans=spans)
        return RoundResult(round=r, aggregate=done.aggregate, contributors=done.contributors, param_digest="",
                           aborted=False, bytes_up=done.bytes_up, bytes_down=done.bytes_down, kept=done.kept,
                           phases=phases, next_round_s=next_round_s, spans=spans)

    def _next_round_s(self, members: Iterable[str], announced: Mapping[str, rules.Announcement]) -> float:
        """The next round's length (`pace`) from the speeds the frozen `members` announced. Every member reads
        the same announcements, so the peers agree on it but for the smoothing of one that joined later; it only
        sets each peer's own training cut-off (the freeze waits for the expected members either way)."""
        for p in members:
            reported = announced[p].pace
            if reported is not None:
                self.pace.report(p, *reported)
        return self.pace.close(members)
