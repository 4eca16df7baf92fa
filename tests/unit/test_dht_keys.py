"""DHT mode's per-peer keys without a network: subkeys, statements, which key counts for a peer id, the
allowlist, the record validator and the stream messages' signatures.

The record validator and `Streams` need hivemind (skipped without it) but no socket: they are called
directly. The run over a real DHT is tests/integration/test_dht_keys.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from demonet.dht.keys import KeyBook, message_statement, parse_subkey, record_statement, subkey
from demonet.wire.identity import Identity, public_text, read_allowlist, verify

A, B, X = Identity.generate(), Identity.generate(), Identity.generate()


def test_a_subkey_names_the_peer_and_its_key() -> None:
    assert parse_subkey(subkey("peer@home", A.public)) == ("peer@home", A.public)
    for bad in ("peer", "peer@", "@" + A.public.hex(), "peer@" + A.public.hex()[:-2], "peer@" + "zz" * 32):
        assert parse_subkey(bad) is None, bad


def test_a_record_signature_holds_for_that_record_only() -> None:
    fields: list[Any] = [b"key-of-round-3", b"\xa1sub", b'{"digest": "d"}', 100.0]
    signature = A.sign(record_statement(*fields))
    assert verify(A.public, signature, record_statement(*fields))
    assert not verify(B.public, signature, record_statement(*fields))
    for i, other in enumerate([b"key-of-round-4", b"\xa1suc", b'{"digest": "e"}', 100.5]):
        changed = [*fields[:i], other, *fields[i + 1:]]
        assert not verify(A.public, signature, record_statement(*changed)), i
    # A message statement is another domain: the same bytes do not sign a record.
    assert message_statement(b"x") != record_statement(b"x", b"", b"", 0.0)


def test_a_peer_id_counts_the_first_key_seen_for_it() -> None:
    book = KeyBook(("a", A.public))
    assert book.choose("a", {X.public}) is None  # nobody speaks for this peer here
    assert book.choose("a", {A.public, X.public}) == A.public
    assert book.choose("b", {B.public}) == B.public and book.key_of("b") == B.public
    assert book.choose("b", {X.public}) is None  # pinned: another key's records are ignored
    assert book.choose("b", {B.public, X.public}) == B.public
    assert book.key_of("c") is None and book.choose("c", set()) is None


def test_two_keys_claiming_a_new_id_pin_neither() -> None:
    book = KeyBook(("a", A.public))
    assert book.choose("b", {B.public, X.public}) is None and book.key_of("b") is None
    assert book.choose("b", {B.public}) == B.public  # read alone later: pinned then


def test_under_an_allowlist_only_listed_keys_count(tmp_path: Path) -> None:
    path = tmp_path / "allow"
    path.write_text(f"# the run's keys\n{public_text(A.public)} a\n{public_text(B.public)}\n")
    allowed = read_allowlist(path)
    book = KeyBook(("a", A.public), allowed)
    assert book.choose("x", {X.public}) is None and book.key_of("x") is None  # unlisted: never a member
    assert book.choose("c", {A.public}) is None  # A may only be "a"
    assert book.choose("b", {B.public, X.public}) == B.public  # the one listed key among the claims
    assert not book.admits("b", X.public) and book.admits("anyone", B.public)
    # A key listed with its peer id owns it from the start, before any record is read.
    other = KeyBook(("z", B.public), allowed)
    assert other.key_of("a") == A.public and other.choose("a", {X.public}) is None


def test_a_reloaded_allowlist_stops_counting_the_keys_it_no_longer_lists(tmp_path: Path) -> None:
    book = KeyBook(("a", A.public), {A.public: "a", B.public: None, X.public: None})
    assert book.choose("b", {B.public}) == B.public and book.choose("x", {X.public}) == X.public
    assert book.reload({A.public: "a", B.public: None}) == ["x"]  # x's key left the list (SIGHUP)
    assert book.key_of("x") is None and book.choose("x", {X.public}) is None  # its records no longer count
    assert book.key_of("b") == B.public and book.key_of("a") == A.public  # the listed ones stay pinned
    assert book.reload({B.public: "b"}) == []  # this peer's own id stays its own, even unlisted
    assert book.key_of("a") == A.public and book.choose("b", {X.public}) is None


def test_the_record_validator_refuses_a_forged_or_altered_record() -> None:
    pytest.importorskip("hivemind")
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    from demonet.dht.validators import KeyValidator

    def record(peer: str, key: Identity, value: bytes = b"v") -> DHTRecord:
        return DHTRecord(b"k" * 20, MSGPackSerializer.dumps(subkey(peer, key.public)), value, 123.0)

    signer = KeyValidator(A)
    good = record("a", A)
    signed = DHTRecord(good.key, good.subkey, signer.sign_value(good), good.expiration_time)
    checker = KeyValidator(B)  # any node checks with the key in the subkey, not its own
    assert checker.validate(signed) and checker.strip_value(signed) == b"v"
    # Signed by A but stored under X's subkey (to replace X's record): refused.
    moved = DHTRecord(good.key, record("a", X).subkey, signed.value, good.expiration_time)
    assert not checker.validate(moved)
    for altered in (DHTRecord(good.key, good.subkey, b"w" + signed.value[1:], good.expiration_time),
                    DHTRecord(good.key, good.subkey, signed.value, 124.0),
                    DHTRecord(b"j" * 20, good.subkey, signed.value, good.expiration_time),
                    DHTRecord(good.key, MSGPackSerializer.dumps("a"), signed.value, good.expiration_time)):
        assert not checker.validate(altered)


def test_a_record_stored_by_its_own_peers_proven_call_is_taken_without_its_signature_checked() -> None:
    pytest.importorskip("hivemind")
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    from demonet.dht.validators import VOUCHED, KeyValidator

    def record(peer: str, key: Identity) -> DHTRecord:  # signed by nobody: a wrong signature's bytes
        return DHTRecord(b"k" * 20, MSGPackSerializer.dumps(subkey(peer, key.public)), b"v" + bytes(64), 123.0)

    checker = KeyValidator(B)
    assert not checker.validate(record("a", A))
    vouched = VOUCHED.set(("a", A.public))  # a STORE call that proved it comes from "a" with key A
    try:
        assert checker.validate(record("a", A))
        assert not checker.validate(record("a", X))  # another key claiming a's id is checked
        assert not checker.validate(record("x", A))  # as is A's key under another id
        assert not checker.validate(DHTRecord(b"k" * 20, MSGPackSerializer.dumps(subkey("a", A.public)), b"v", 1.0))
    finally:
        VOUCHED.reset(vouched)
    assert not checker.validate(record("a", A))


def test_a_stream_message_counts_only_under_its_senders_key() -> None:
    pytest.importorskip("hivemind")
    from demonet._proto import demonet_pb2 as pb
    from demonet.dht.options import DhtOptions
    from demonet.dht.streams import Streams

    opts = DhtOptions(run="r", token="t")
    book = KeyBook(("b", B.public))
    receiver = Streams(opts, "b", None, B, book)
    honest = Streams(opts, "a", None, A, KeyBook(("a", A.public)))
    intruder = Streams(opts, "a", None, X, KeyBook(("a", X.public)))  # the token and its own key, as "a"

    async def check(msg: pb.DhtMessage, unknown_ok: bool = False) -> str:
        assert receiver._check(msg) == ""  # the token's HMAC is good on every message here
        return await receiver._check_sender(msg, unknown_ok=unknown_ok)

    async def main() -> None:
        part = honest._message(pb.DHT_KIND_PART, 3, slice=1, members_digest="m", samples=1)
        assert await check(part) == "unknown sender 'a' (no DHT record of its key)"
        ping = honest._message(pb.DHT_KIND_PING, 0)
        assert await check(ping, unknown_ok=True) == ""
        assert book.choose("a", {A.public}) == A.public  # as read from its announcement
        assert await check(part) == ""
        assert (await check(intruder._message(pb.DHT_KIND_PART, 3, slice=1, samples=1))).startswith("bad signature")
        assert (await check(intruder._message(pb.DHT_KIND_PING, 0), unknown_ok=True)).startswith("bad signature")
        part.slice = 2  # altered after signing (and the HMAC computed again by a token holder)
        part.mac = b""
        part.mac = _mac(opts, part)
        assert (await check(part)).startswith("bad signature")

    asyncio.run(main())


def _mac(opts: Any, msg: Any) -> bytes:
    from demonet.dht import rules

    return rules.sign(opts.token.encode(), msg.SerializeToString())
