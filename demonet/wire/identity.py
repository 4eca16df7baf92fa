"""A peer's identity: an Ed25519 key, and the signed statements a peer makes with it.

Wire layer: imports `cryptography` and the standard library; never grpc or a transport. A peer's
identity is its public key; the coordinator binds a peer id to the first key that joined under it.
Every statement is signed over a domain-separated, length-prefixed encoding of its fields
(`statement`), so a signature for one kind of request, run, session or round is worthless for another.

Key files (`demonet keygen`): PEM PKCS#8, unencrypted, mode 0600. Public keys travel as their 32 raw
bytes and are written for people as ``ed25519:<64 hex digits>`` (`public_text`); the fingerprint
shown in status tables is the first 16 hex digits of the SHA-256 of the raw public key.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from demonet.errors import KeyFileError

__all__ = ["KEY_BYTES", "SIGNATURE_BYTES", "Identity", "aggregate_statement", "fingerprint", "heartbeat_statement",
           "join_statement",
           "leave_statement", "parameters_statement", "parse_public", "public_text", "read_allowlist", "statement",
           "submit_statement", "task_files_statement", "verify"]

KEY_BYTES = 32
SIGNATURE_BYTES = 64
_DOMAIN = b"demonet/v1\0"
_PREFIX = "ed25519:"


def statement(kind: str, *fields: bytes | str | int | float | bool) -> bytes:
    """The bytes a peer signs: the domain, the kind, then every field length-prefixed.

    Integers are 8-byte little-endian unsigned, floats 8-byte IEEE doubles, booleans one byte, strings
    UTF-8; each field is preceded by a one-byte type tag and its 4-byte length, so no two different
    field lists give the same bytes.
    """
    out = [_DOMAIN, kind.encode(), b"\0"]
    for value in fields:
        if isinstance(value, bool):
            tag, data = b"b", bytes([value])
        elif isinstance(value, int):
            tag, data = b"i", struct.pack("<Q", value)
        elif isinstance(value, float):
            tag, data = b"f", struct.pack("<d", value)
        elif isinstance(value, str):
            tag, data = b"s", value.encode()
        else:
            tag, data = b"y", bytes(value)
        out += [tag, struct.pack("<I", len(data)), data]
    return b"".join(out)


def fingerprint(public: bytes) -> str:
    """How people see a key: the first 16 hex digits of the SHA-256 of its 32 raw bytes."""
    return hashlib.sha256(public).hexdigest()[:16]


def public_text(public: bytes) -> str:
    """``ed25519:<64 hex digits>``: a public key in an allowlist file or a log."""
    return _PREFIX + public.hex()


def parse_public(text: str) -> bytes:
    """The 32 raw bytes of a public key written as ``ed25519:<64 hex digits>`` (or the bare hex).

    Raises:
        ValueError: not such a key.
    """
    body = text.strip()
    body = body[len(_PREFIX):] if body.startswith(_PREFIX) else body
    try:
        raw = bytes.fromhex(body)
    except ValueError:
        raise ValueError(f"{text!r} is not an Ed25519 public key ({_PREFIX}<64 hex digits>)") from None
    if len(raw) != KEY_BYTES:
        raise ValueError(f"{text!r} is not an Ed25519 public key: {len(raw)} bytes, expected {KEY_BYTES}")
    return raw


def read_allowlist(path: Path) -> dict[bytes, str | None]:
    """The keys an allowlist file admits: one ``ed25519:<hex>`` per line, optionally followed by the one
    peer id that key may use; ``#`` starts a comment.

    Raises:
        OSError: the file cannot be read.
        ValueError: a line that is not a key (with its line number).
    """
    keys: dict[bytes, str | None] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:
            raise ValueError(f"{path}:{n}: expected 'ed25519:<hex> [peer_id]', got {line.strip()!r}")
        try:
            keys[parse_public(words[0])] = words[1] if len(words) == 2 else None
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
    return keys


def verify(public: bytes, signature: bytes, message: bytes) -> bool:
    """Whether `signature` is `public`'s over `message`; False for a malformed key or signature."""
    if len(public) != KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


class Identity:
    """A peer's private key. `public` (32 raw bytes) is who it is; `sign` speaks for it."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public)

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)

    def save(self, path: Path) -> None:
        """Write the key (PEM PKCS#8, mode 0600), never over an existing file.

        Raises:
            FileExistsError: `path` exists.
        """
        pem = self._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)

    @classmethod
    def load(cls, path: Path) -> Identity:
        """Read a key written by `save` (or `demonet keygen`).

        Raises:
            FileNotFoundError: no such file.
            KeyFileError: not an Ed25519 private key, or group or others may read it.
        """
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise KeyFileError(f"{path}: mode {mode:o} lets others read the key; run chmod 600 {path}")
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as e:
            raise KeyFileError(f"{path}: not a PEM private key without a password ({e})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"{path}: a {type(key).__name__}, expected an Ed25519 private key")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: Path) -> Identity:
        """The key in `path`, made and saved there first if there is none (a restart keeps the identity)."""
        if not path.exists():
            try:
                cls.generate().save(path)
            except FileExistsError:  # another process made it first: use that one
                pass
        return cls.load(path)


# -- the statements a peer signs in coordinator mode (the coordinator checks the same bytes) --------------

def join_statement(nonce: bytes, peer_id: str, public: bytes) -> bytes:
    return statement("join", nonce, peer_id, public)


# The counted statements end with the session's counter: the coordinator takes each number once per session
# (`demonet.coordinator.identities.Counters`), so a captured request is void once it arrived.

def heartbeat_statement(session: bytes, peer_id: str, round: int, counter: int) -> bytes:
    return statement("heartbeat", session, peer_id, round, counter)


def leave_statement(session: bytes, peer_id: str, round: int, counter: int) -> bytes:
    return statement("leave", session, peer_id, round, counter)


def parameters_statement(session: bytes, peer_id: str, round: int, resync: bool, counter: int) -> bytes:
    return statement("parameters", session, peer_id, round, resync, counter)


def aggregate_statement(session: bytes, peer_id: str, round: int, submitting: bool, counter: int) -> bytes:
    return statement("aggregate", session, peer_id, round, submitting, counter)


def task_files_statement(session: bytes, peer_id: str, counter: int) -> bytes:
    return statement("task-files", session, peer_id, counter)


def submit_statement(session: bytes, peer_id: str, round: int, payload_digest: bytes, param_digest: str,
                     loss: float, samples: int = 1, need_s: float = 0.0, least_s: float = 0.0,
                     train_s: float = 0.0) -> bytes:
    return statement("submit", session, peer_id, round, payload_digest, param_digest, float(loss), int(samples),
                     float(need_s), float(least_s), float(train_s))
