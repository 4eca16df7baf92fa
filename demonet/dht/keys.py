"""Per-peer keys in DHT mode, the pure part: what a peer signs, and which key speaks for which peer id.

A DHT record is stored under the subkey ``<peer id>@<hex public key>`` and signed by that key
(`record_statement`); a stream message is signed over its bytes with `mac` and `signature` empty
(`message_statement`), a link's first call and its reply over their bytes and the link's two ends
(`link_statement`). `KeyBook` decides which key's records count for a peer id: the one the
allowlist names, else the first key this peer saw for it in the run (trust on first use). Imports the
wire layer's `statement`; must not import asyncio, hivemind or any other demonet.dht module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

from demonet.wire.identity import KEY_BYTES, statement

__all__ = ["KeyBook", "link_statement", "message_statement", "parse_subkey", "record_statement", "subkey"]


def subkey(peer_id: str, public: bytes) -> str:
    """The DHT subkey of a peer's records: its id and the key that signs them (so two keys claiming one
    id store two records, and neither can replace the other's)."""
    return f"{peer_id}@{public.hex()}"


def parse_subkey(text: str) -> tuple[str, bytes] | None:
    """(peer id, public key) of a subkey made by `subkey`; None for anything else."""
    peer_id, sep, hex_key = text.rpartition("@")
    if not sep or not peer_id or len(hex_key) != 2 * KEY_BYTES:
        return None
    try:
        return peer_id, bytes.fromhex(hex_key)
    except ValueError:
        return None


def record_statement(key_id: bytes, subkey_bytes: bytes, value: bytes, expiration_time: float) -> bytes:
    """What a DHT record's key signs: the DHT key (a hash of ``demonet/<run>/<what>/<round>``: the run, the
    record's kind and its round), the subkey (peer id and key), the value (everything the record says)
    and its expiration time, so that no signature carries over to another record, round or run."""
    return statement("dht-record", key_id, subkey_bytes, value, float(expiration_time))


def message_statement(body: bytes) -> bytes:
    """What a stream message's sender signs: the SHA-256 of the message serialized with `mac` and
    `signature` empty (its run, round, sender, kind, send time and part are all in it). Signed over the
    digest, not the bytes: Ed25519 hashes its message twice with SHA-512 to sign, and parts are 1 MiB."""
    return statement("dht-message", hashlib.sha256(body).digest())


def link_statement(body: bytes, opener: str, callee: str) -> bytes:
    """What a link's HELLO call and its reply sign (demonet.dht.links): `message_statement`'s digest and the
    libp2p peer ids of the peer that opened the link and of the one it called. Each end's daemon vouches
    for the other end's peer id (libp2p's secure channel), so a HELLO signed for one link counts on no
    other: one replayed by a third peer names that peer's id in neither place."""
    return statement("dht-link", hashlib.sha256(body).digest(), opener, callee)


class KeyBook:
    """Which key speaks for which peer id, in this peer's view of the run.

    Args:
        own: this peer's id and public key (pinned from the start: nobody else speaks for it here).
        allowed: with admission "allowlist", key -> the one peer id it may use (None: any); records and
            messages of other keys never count. None: any key (admission "token" or "open").
    """

    def __init__(self, own: tuple[str, bytes], allowed: Mapping[bytes, str | None] | None = None) -> None:
        self.allowed = dict(allowed) if allowed is not None else None
        self._own = own[0]
        self._pins: dict[str, bytes] = {own[0]: own[1]}
        self._pin_listed()

    def _pin_listed(self) -> None:
        for public, peer_id in (self.allowed or {}).items():
            if peer_id is not None:
                self._pins.setdefault(peer_id, public)

    def reload(self, allowed: Mapping[bytes, str | None]) -> list[str]:
        """Replace the allowlist (SIGHUP). The ids pinned to a key it no longer admits are unpinned, so
        their records and messages stop counting from the next read (they leave the rounds); returns them."""
        self.allowed = dict(allowed)
        dropped = sorted(p for p, k in self._pins.items() if p != self._own and not self.admits(p, k))
        for peer_id in dropped:
            del self._pins[peer_id]
        self._pin_listed()
        return dropped

    def admits(self, peer_id: str, public: bytes) -> bool:
        """Whether the allowlist (if any) lets `public` speak as `peer_id`."""
        if self.allowed is None:
            return True
        return public in self.allowed and self.allowed[public] in (None, peer_id)

    def key_of(self, peer_id: str) -> bytes | None:
        """The key pinned for `peer_id`; None while no record of it has been read."""
        return self._pins.get(peer_id)

    def choose(self, peer_id: str, keys: Iterable[bytes]) -> bytes | None:
        """Which of the `keys` that records claim for `peer_id` counts (pinned from now on), or None.

        A pinned id counts only its pinned key. An id not pinned yet is pinned to the one admitted key
        among `keys`; with two or more (another key claims the id before this peer saw its owner's),
        none counts and none is pinned, so that what this peer reads next decides.
        """
        pinned = self._pins.get(peer_id)
        keys = set(keys)
        if pinned is not None:
            return pinned if pinned in keys else None
        admitted = [k for k in keys if self.admits(peer_id, k)]
        if len(admitted) != 1:
            return None
        self._pins[peer_id] = admitted[0]
        return admitted[0]
