"""Keys, signed statements and the coordinator's identity rules (pure logic; the process tests are in
tests/integration/test_identity.py)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from demonet.coordinator.identities import (
    CHALLENGE_TTL_S,
    COUNTER_WINDOW,
    MAX_CHALLENGES,
    Identities,
    NotJoined,
    Refused,
    Replayed,
    read_allowlist,
)
from demonet.wire.identity import (
    Identity,
    KeyFileError,
    fingerprint,
    heartbeat_statement,
    join_statement,
    leave_statement,
    parse_public,
    public_text,
    statement,
    submit_statement,
    verify,
)


def test_a_key_file_is_private_kept_and_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "peer.key"
    made = Identity.load_or_create(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert Identity.load_or_create(path).public == made.public  # a restart keeps the identity
    with pytest.raises(FileExistsError):
        Identity.generate().save(path)
    assert Identity.load(path).public == made.public
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        Identity.load(path)
    os.chmod(path, 0o600)
    path.write_text("not a key")
    with pytest.raises(KeyFileError, match="not a PEM private key"):
        Identity.load(path)


def test_public_keys_round_trip_as_text() -> None:
    key = Identity.generate()
    assert parse_public(public_text(key.public)) == key.public == parse_public(key.public.hex())
    assert key.fingerprint == fingerprint(key.public) and len(key.fingerprint) == 16
    for bad in ("ed25519:zz", "ed25519:" + "00" * 31, ""):
        with pytest.raises(ValueError, match="not an Ed25519 public key"):
            parse_public(bad)


def test_every_field_of_a_statement_is_signed() -> None:
    key = Identity.generate()
    fields = (b"session", "p1", 7, b"\x01" * 32, "digest", 2.5)
    signed = key.sign(submit_statement(*fields))  # type: ignore[arg-type]
    assert verify(key.public, signed, submit_statement(*fields))  # type: ignore[arg-type]
    for i in range(len(fields)):  # tamper with each field in turn
        tampered = list(fields)
        value = tampered[i]
        tampered[i] = (value + b"x" if isinstance(value, bytes) else value + "x" if isinstance(value, str)
                       else value + 1)
        assert not verify(key.public, signed, submit_statement(*tampered))  # type: ignore[arg-type]
    assert not verify(Identity.generate().public, signed, submit_statement(*fields))  # type: ignore[arg-type]
    assert not verify(key.public, signed[:-1] + bytes([signed[-1] ^ 1]), submit_statement(*fields))  # type: ignore[arg-type]
    assert not verify(b"short", signed, b"") and not verify(key.public, b"short", b"")
    # Length prefixes: moving bytes between fields, or changing a field's type, changes the statement.
    assert statement("k", "ab", "c") != statement("k", "a", "bc")
    assert statement("k", 1) != statement("k", True) != statement("k", b"\x01")
    assert statement("k", 1.0) == statement("k", 1.0) and struct.pack("<d", 1.0) in statement("k", 1.0)


def _joined(ids: Identities, peer_id: str, key: Identity, now: float = 0.0) -> bytes:
    nonce = ids.challenge(peer_id, key.public, now)
    return ids.join(peer_id, key.public, nonce, key.sign(join_statement(nonce, peer_id, key.public)), now).session


def test_a_peer_id_belongs_to_the_first_key_that_joins_under_it() -> None:
    ids = Identities("token")
    alice, mallory = Identity.generate(), Identity.generate()
    old = _joined(ids, "alice", alice)
    session = _joined(ids, "alice", alice, now=5.0)
    assert session != old  # the same key again: a new session, so what the old one signed is void
    with pytest.raises(Refused, match="belongs to another key"):
        ids.challenge("alice", mallory.public, 0.0)
    assert _joined(ids, "mallory", mallory) != session  # its own id is fine
    message = submit_statement(session, "alice", 3, b"d" * 32, "digest", 1.0)
    ids.check("alice", alice.sign(message), message)
    with pytest.raises(Refused, match="does not verify"):  # mallory signing for alice
        ids.check("alice", mallory.sign(message), message)
    with pytest.raises(NotJoined):
        ids.check("nobody", alice.sign(message), message)
    replayed = alice.sign(leave_statement(old, "alice", 3, 1))  # signed in the session before the rejoin
    with pytest.raises(Refused, match="does not verify"):  # checked against the statement of the session now
        ids.check("alice", replayed, leave_statement(session, "alice", 3, 1), 1)


def test_a_counter_is_taken_once_per_session_and_out_of_order_within_the_window() -> None:
    ids = Identities("token")
    key = Identity.generate()
    session = _joined(ids, "p", key)

    def heartbeat(n: int) -> None:
        message = heartbeat_statement(session, "p", 0, n)
        ids.check("p", key.sign(message), message, n)

    heartbeat(2)
    heartbeat(1)  # overtaken by 2: still fresh
    for used in (1, 2, 0):
        with pytest.raises(Replayed if used else Refused):
            heartbeat(used)
    heartbeat(COUNTER_WINDOW + 10)
    with pytest.raises(Replayed, match="too old"):
        heartbeat(5)  # far below the highest: refused although never used
    restored = Identities("token")
    restored.load_state(ids.state_dict())
    with pytest.raises(Replayed):  # a resumed coordinator takes only counters above the saved highest
        heartbeat_message = heartbeat_statement(session, "p", 0, 9)
        restored.check("p", key.sign(heartbeat_message), heartbeat_message, 9)
    message = heartbeat_statement(session, "p", 0, COUNTER_WINDOW + 11)
    restored.check("p", key.sign(message), message, COUNTER_WINDOW + 11)


def test_a_forgotten_newcomer_frees_its_id_and_contributors_are_no_newcomers() -> None:
    ids = Identities("token")
    a, b = Identity.generate(), Identity.generate()
    _joined(ids, "a", a)
    _joined(ids, "b", b, now=3.0)
    ids.contributed.add("a")
    assert ids.newcomers() == ["b"] and ids.bound_at == {"a": 0.0, "b": 3.0}
    ids.forget("b")
    assert ids.newcomers() == [] and ids.session("b") is None
    _joined(ids, "b", a)  # another key may take the id now
    assert ids.bindings["b"].public == a.public


def test_a_challenge_is_single_use_fresh_and_for_one_key() -> None:
    ids = Identities("token")
    key, other = Identity.generate(), Identity.generate()
    nonce = ids.challenge("p", key.public, 0.0)
    good = key.sign(join_statement(nonce, "p", key.public))
    with pytest.raises(Refused, match="another peer id or key"):
        ids.join("p", other.public, nonce, other.sign(join_statement(nonce, "p", other.public)), 1.0)
    nonce = ids.challenge("p", key.public, 0.0)  # the wrong answer used the first one up
    with pytest.raises(Refused, match="does not verify"):
        ids.join("p", key.public, nonce, good, 1.0)  # a signature over another nonce
    assert ids.bindings == {}  # nothing refused changed anything
    nonce = ids.challenge("p", key.public, 0.0)
    answer = key.sign(join_statement(nonce, "p", key.public))
    with pytest.raises(Refused, match="no such challenge"):
        ids.join("p", key.public, nonce, answer, CHALLENGE_TTL_S + 0.1)  # expired
    nonce = ids.challenge("p", key.public, 100.0)
    answer = key.sign(join_statement(nonce, "p", key.public))
    ids.join("p", key.public, nonce, answer, 101.0)
    with pytest.raises(Refused, match="no such challenge"):
        ids.join("p", key.public, nonce, answer, 101.0)  # a replayed join
    with pytest.raises(Refused, match="32"):
        ids.challenge("q", b"\x00" * 31, 0.0)


def test_outstanding_challenges_are_bounded() -> None:
    ids = Identities("open")
    key = Identity.generate()
    first = ids.challenge("p", key.public, 0.0)
    for _ in range(MAX_CHALLENGES):
        ids.challenge("p", key.public, 0.0)
    assert len(ids._challenges) == MAX_CHALLENGES
    with pytest.raises(Refused, match="no such challenge"):  # the oldest was forgotten
        ids.join("p", key.public, first, key.sign(join_statement(first, "p", key.public)), 0.0)


def test_the_allowlist_admits_its_keys_and_a_reload_drops_the_removed_ones(tmp_path: Path) -> None:
    alice, bob, carol = Identity.generate(), Identity.generate(), Identity.generate()
    path = tmp_path / "allow.txt"
    path.write_text(f"# the run's peers\n{public_text(alice.public)} alice\n{public_text(bob.public)}\n\n")
    allowed = read_allowlist(path)
    assert allowed == {alice.public: "alice", bob.public: None}
    ids = Identities("allowlist", allowed)
    assert ids.needs_token and not Identities("open").needs_token
    _joined(ids, "alice", alice)
    _joined(ids, "bob-1", bob)
    with pytest.raises(Refused, match="not on the run's allowlist"):
        ids.challenge("carol", carol.public, 0.0)
    with pytest.raises(Refused, match="may join only as 'alice'"):
        ids.challenge("alice-2", alice.public, 0.0)
    assert ids.reload({alice.public: "alice"}) == ["bob-1"]
    assert set(ids.bindings) == {"alice"}
    with pytest.raises(Refused, match="not on the run's allowlist"):
        ids.challenge("bob-1", bob.public, 0.0)
    path.write_text(f"{public_text(alice.public)} alice extra\n")
    with pytest.raises(ValueError, match="allow.txt:1"):
        read_allowlist(path)
    path.write_text("ed25519:1234\n")
    with pytest.raises(ValueError, match="allow.txt:1"):
        read_allowlist(path)
    with pytest.raises(ValueError, match="admission"):
        Identities("everyone")
    with pytest.raises(ValueError, match="allowed keys"):
        Identities("allowlist")


def test_bindings_survive_a_restart() -> None:
    ids = Identities("token")
    key = Identity.generate()
    session = _joined(ids, "p", key)
    again = Identities("token")
    again.load_state(ids.state_dict())
    assert again.session("p") == session
    with pytest.raises(Refused, match="belongs to another key"):
        again.challenge("p", Identity.generate().public, 0.0)
