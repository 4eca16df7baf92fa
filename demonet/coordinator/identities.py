"""Who may speak for which peer id: keys, join challenges, sessions and the admission policy. Pure logic.

A peer proves that it holds its Ed25519 key by signing a fresh, single-use challenge the coordinator
issued (`challenge`, then `join`). The first key that joins under a peer id owns that id for the run;
another key is refused under it. A join gives the binding a session (random bytes, the same for every
later join of that key, persisted with the state), and every later request that changes state or
carries a payload is signed over the session, the peer id, the round and what it carries
(`demonet.wire.identity.statement`): a signature from another run, session, round or request kind
does not verify, and one payload per peer per round refuses a replay in the same round.

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

__all__ = ["ADMISSIONS", "Binding", "Identities", "read_allowlist"]

logger = logging.getLogger(__name__)

ADMISSIONS = ("token", "allowlist", "open")
CHALLENGE_TTL_S = 30.0
"""How long a challenge can be answered."""
MAX_CHALLENGES = 4096
"""Outstanding challenges kept; the oldest is forgotten first (a flood of requests costs memory only up to here)."""
NONCE_BYTES = 32
SESSION_BYTES = 16


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
        """Check the answer to a challenge and bind `peer_id` to `public` (a new binding gets a session).

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
        bound = self.bindings.get(peer_id)
        if bound is None:
            bound = self.bindings[peer_id] = Binding(public, secrets.token_bytes(SESSION_BYTES))
            logger.info("[coordinator] %s is key %s", peer_id, bound.fingerprint)
        return bound

    def check(self, peer_id: str, signature: bytes, message: bytes) -> None:
        """That `peer_id`'s key signed `message`.

        Raises:
            NotJoined: `peer_id` has no key here (it must join).
            Refused: the signature does not verify.
        """
        bound = self.bindings.get(peer_id)
        if bound is None:
            raise NotJoined(f"{peer_id!r} has not joined with a key")
        if not verify(bound.public, signature, message):
            raise Refused(f"the signature does not verify for {peer_id!r}'s key {bound.fingerprint}")

    def session(self, peer_id: str) -> bytes | None:
        bound = self.bindings.get(peer_id)
        return None if bound is None else bound.session

    def reload(self, allowed: dict[bytes, str | None]) -> list[str]:
        """Replace the allowlist; returns the peer ids whose key is no longer admitted (their bindings go)."""
        self.allowed = allowed
        removed = [p for p, b in self.bindings.items() if b.public not in allowed or allowed[b.public] not in (None, p)]
        for peer_id in removed:
            del self.bindings[peer_id]
        return removed

    def _expire(self, now: float) -> None:
        while self._challenges:
            nonce, issued = next(iter(self._challenges.items()))
            if issued.expires_at > now:
                break
            del self._challenges[nonce]

    def state_dict(self) -> dict[str, Any]:
        """What survives a restart: the bindings (public keys and sessions; no secret)."""
        return {p: {"key": b.public.hex(), "session": b.session.hex()} for p, b in self.bindings.items()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.bindings = {p: Binding(bytes.fromhex(b["key"]), bytes.fromhex(b["session"])) for p, b in state.items()}
