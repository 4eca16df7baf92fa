"""Who may speak for which peer id: keys, join challenges, sessions and the admission policy. Pure logic.

A peer proves that it holds its Ed25519 key by signing a fresh, single-use challenge the coordinator
issued (`challenge`, then `join`). The first key that joins under a peer id owns that id for the run
(until it is `forget`-ten: a member that never contributed); another key is refused under it. Every join
gives the binding a new session (random bytes, persisted with the state), and every later request that
changes state or carries a payload is signed over the session, the peer id, the round and what it carries
(`demonet.wire.identity.statement`): a signature from another run, session, round or request kind does
not verify. Heartbeat, Leave, GetParameters and a member's GetAggregate also sign a counter, each number
taken once per session (`Counters`); one payload per peer per round refuses a replayed Submit.

Admission policies (`[net] admission`):
- ``token``: the run token admits any new key; each key speaks only for itself.
- ``allowlist``: only the keys listed in the `[net] allowlist` file; `reload` drops the removed ones.
- ``open``: any key, without the token (a public volunteer run; robust aggregation bounds the harm).

No asyncio, no network: the caller passes the time into every call.
"""

from __future__ import annotations

import logging
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from demonet.errors import NotJoined, Refused
from demonet.wire.identity import KEY_BYTES, fingerprint, join_statement, read_allowlist, verify

__all__ = ["ADMISSIONS", "Binding", "Counters", "Identities", "Replayed", "read_allowlist"]

logger = logging.getLogger(__name__)

ADMISSIONS = ("token", "allowlist", "open")
CHALLENGE_TTL_S = 30.0
"""How long a challenge can be answered."""
MAX_CHALLENGES = 4096
"""Outstanding challenges kept; the oldest is forgotten first (a flood of requests costs memory only up to here)."""
NONCE_BYTES = 32
SESSION_BYTES = 16
COUNTER_WINDOW = 1024
"""A counter may arrive this far below the session's highest one (requests overtaking one another); older
ones are refused, as are numbers taken already."""


class Replayed(Refused):
    """A counted request whose counter its session had used: a replay (or a client that counts wrong)."""


@dataclass
class Counters:
    """The counters one session has used: each number once, none at or below `floor` (a resumed state's
    highest), none `COUNTER_WINDOW` or more below the highest."""

    floor: int = 0
    high: int = 0
    taken: set[int] = field(default_factory=set)

    def take(self, n: int) -> None:
        """Use `n`.

        Raises:
            Refused: `n` is not >= 1, was used, or is too old.
        """
        if n < 1:
            raise Refused(f"counter {n}: a counted request carries a counter >= 1")
        if n in self.taken or n <= max(self.floor, self.high - COUNTER_WINDOW):
            raise Replayed(f"counter {n} was used already or is too old in this session (a replayed request?)")
        self.taken.add(n)
        if n > self.high:
            self.high = n
            if len(self.taken) > 2 * COUNTER_WINDOW:
                self.taken = {m for m in self.taken if m > self.high - COUNTER_WINDOW}


@dataclass(frozen=True)
class Binding:
    """A peer id's key and session."""

    public: bytes
    session: bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public)


@dataclass
class _Challenge:
    peer_id: str
    public: bytes
    expires_at: float


@dataclass
class Identities:
    """The bindings of peer ids to keys, the outstanding challenges and the admission policy."""

    admission: str = "token"
    allowed: dict[bytes, str | None] | None = None
    """With ``allowlist``: key -> the peer id it may use (None: any)."""
    bindings: dict[str, Binding] = field(default_factory=dict)
    counters: dict[str, Counters] = field(default_factory=dict)
    """Peer -> the counters its session has used."""
    contributed: set[str] = field(default_factory=set)
    """Peers that had a payload accepted since they were bound."""
    bound_at: dict[str, float] = field(default_factory=dict)
    """Peer -> when its key was bound (a resumed state: when it was loaded)."""
    _challenges: OrderedDict[bytes, _Challenge] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission should be one of {', '.join(ADMISSIONS)}, got {self.admission!r}")
        if self.admission == "allowlist" and self.allowed is None:
            raise ValueError("admission 'allowlist' needs the allowed keys")

    @property
    def needs_token(self) -> bool:
        return self.admission != "open"

    def _admissible(self, peer_id: str, public: bytes) -> None:
        if len(public) != KEY_BYTES:
            raise Refused(f"a public key of {len(public)} bytes; an Ed25519 key has {KEY_BYTES}")
        if self.admission == "allowlist":
            assert self.allowed is not None
            if public not in self.allowed:
                raise Refused(f"key {fingerprint(public)} is not on the run's allowlist")
            only = self.allowed[public]
            if only is not None and only != peer_id:
                raise Refused(f"key {fingerprint(public)} may join only as {only!r}, not {peer_id!r}")
        bound = self.bindings.get(peer_id)
        if bound is not None and bound.public != public:
            raise Refused(f"peer id {peer_id!r} belongs to another key ({bound.fingerprint}); this key is "
                          f"{fingerprint(public)}: use another peer id, or the key that joined as {peer_id!r}")

    def challenge(self, peer_id: str, public: bytes, now: float) -> bytes:
        """A fresh nonce for `public` to sign as `peer_id` (refused at once when it could not join)."""
        self._admissible(peer_id, public)
        self._expire(now)
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._challenges[nonce] = _Challenge(peer_id, public, now + CHALLENGE_TTL_S)
        while len(self._challenges) > MAX_CHALLENGES:
            self._challenges.popitem(last=False)
        return nonce

    def join(self, peer_id: str, public: bytes, nonce: bytes, signature: bytes, now: float) -> Binding:
        """Check the answer to a challenge and bind `peer_id` to `public`, with a new session (what any earlier
        session signed is void: a replay of it does not verify).

        Raises:
            Refused: an unknown, used, expired or other peer's challenge, a signature that does not
                verify, or a key the policy or an existing binding refuses.
        """
        self._expire(now)
        issued = self._challenges.pop(nonce, None)
        if issued is None:
            raise Refused("no such challenge: it expired, was used, or was never issued; ask for a new one")
        if (issued.peer_id, issued.public) != (peer_id, public):
            raise Refused("the challenge was issued to another peer id or key")
        if not verify(public, signature, join_statement(nonce, peer_id, public)):
            raise Refused(f"the join signature does not verify for key {fingerprint(public)}")
        self._admissible(peer_id, public)
        if peer_id not in self.bindings:
            logger.info("[coordinator] %s is key %s", peer_id, fingerprint(public))
            self.bound_at[peer_id] = now
        bound = self.bindings[peer_id] = Binding(public, secrets.token_bytes(SESSION_BYTES))
        self.counters[peer_id] = Counters()
        return bound

    def check(self, peer_id: str, signature: bytes, message: bytes, counter: int | None = None) -> None:
        """That `peer_id`'s key signed `message`, and (for a counted request) that its session had not used
        `counter`, which is taken now.

        Raises:
            NotJoined: `peer_id` has no key here (it must join).
            Refused: the signature does not verify, or the counter was used (a replay).
        """
        bound = self.bindings.get(peer_id)
        if bound is None:
            raise NotJoined(f"{peer_id!r} has not joined with a key")
        if not verify(bound.public, signature, message):
            raise Refused(f"the signature does not verify for {peer_id!r}'s key {bound.fingerprint}")
        if counter is not None:
            self.counters.setdefault(peer_id, Counters()).take(counter)

    def forget(self, peer_id: str) -> None:
        """Let `peer_id` go: its key and session (any key may join under it again)."""
        self.bindings.pop(peer_id, None)
        self.counters.pop(peer_id, None)
        self.contributed.discard(peer_id)
        self.bound_at.pop(peer_id, None)

    def newcomers(self) -> list[str]:
        """The bound peers that never had a payload accepted."""
        return [p for p in self.bindings if p not in self.contributed]

    def session(self, peer_id: str) -> bytes | None:
        bound = self.bindings.get(peer_id)
        return None if bound is None else bound.session

    def reload(self, allowed: dict[bytes, str | None]) -> list[str]:
        """Replace the allowlist; returns the peer ids whose key is no longer admitted (their bindings go)."""
        self.allowed = allowed
        removed = [p for p, b in self.bindings.items() if b.public not in allowed or allowed[b.public] not in (None, p)]
        for peer_id in removed:
            self.forget(peer_id)
        return removed

    def _expire(self, now: float) -> None:
        while self._challenges:
            nonce, issued = next(iter(self._challenges.items()))
            if issued.expires_at > now:
                break
            del self._challenges[nonce]

    def state_dict(self) -> dict[str, Any]:
        """What survives a restart: the bindings (public keys and sessions; no secret) and each session's
        highest counter (a resumed coordinator takes only higher ones)."""
        return {p: {"key": b.public.hex(), "session": b.session.hex(),
                    "counter": self.counters[p].high if p in self.counters else 0, "contributed": p in self.contributed}
                for p, b in self.bindings.items()}

    def load_state(self, state: dict[str, Any], now: float = 0.0) -> None:
        self.bindings = {p: Binding(bytes.fromhex(b["key"]), bytes.fromhex(b["session"])) for p, b in state.items()}
        self.counters = {p: Counters(floor=int(b.get("counter", 0)), high=int(b.get("counter", 0)))
                         for p, b in state.items()}
        self.contributed = {p for p, b in state.items() if b.get("contributed", True)}
        self.bound_at = dict.fromkeys(state, now)
