"""The validators of DHT-mode records: the run token's HMAC and the storing peer's Ed25519 signature.

Net layer, used by demonet.dht.node (imports hivemind). Must not import grpc, demonet.transport.grpc,
the streams or the round components.
"""

from __future__ import annotations

import contextvars

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from demonet.wire import identity as ids

from . import keys, rules

__all__ = ["VOUCHED", "HmacValidator", "KeyValidator"]

_MAC_BYTES = 32

VOUCHED: contextvars.ContextVar[tuple[str, bytes] | None] = contextvars.ContextVar("vouched", default=None)
"""(peer id, key) of the peer whose STORE call is being served: a link's hello, or the call's own signature,
proved that the call comes from it (`demonet.dht.node.DhtNode._serve_store`)."""


class HmacValidator(RecordValidatorBase):  # type: ignore[misc]
    """Signs every DHT record this node stores with an HMAC of the run token and refuses records without it.

    hivemind calls `validate` when another node asks this one to store a record and when a record
    comes back from a search, so a node without the token can neither place records on this
    node nor have its records read by this node's peer.
    """

    def __init__(self, token: bytes) -> None:
        self._token = token

    @staticmethod
    def _body(record: DHTRecord, value: bytes) -> bytes:
        return b"|".join([record.key, record.subkey, value, repr(float(record.expiration_time)).encode()])

    def sign_value(self, record: DHTRecord) -> bytes:
        return bytes(record.value) + rules.sign(self._token, self._body(record, record.value))

    def validate(self, record: DHTRecord) -> bool:
        value = bytes(record.value)
        if len(value) <= _MAC_BYTES:
            return False
        return rules.verify(self._token, self._body(record, value[:-_MAC_BYTES]), value[-_MAC_BYTES:])

    def strip_value(self, record: DHTRecord) -> bytes:
        return bytes(record.value)[:-_MAC_BYTES]


class KeyValidator(RecordValidatorBase):  # type: ignore[misc]
    """Signs this node's records with its peer's Ed25519 key and refuses records whose signature does not
    verify against the key named in their subkey (``<peer id>@<hex key>``, `keys.subkey`).

    Applied inside the run token's HMAC (a lower priority signs first and validates last), so a node
    without the token is refused before any signature is checked. A record of the peer `VOUCHED` names
    (its id and key), stored by that peer's own call, is taken without checking its signature: the call
    proved already that it comes from that peer, which could sign the record as well. The signature is
    kept with it, and every node that reads the record from this one checks it. Which key counts for a peer id is
    the reader's decision (`keys.KeyBook`), not the store's: a valid record of another key under an
    honest peer's id is stored beside the honest one, never over it, and its readers ignore it.
    """

    def __init__(self, identity: ids.Identity) -> None:
        self._identity = identity

    @property
    def priority(self) -> int:
        return -1

    def sign_value(self, record: DHTRecord) -> bytes:
        value = bytes(record.value)
        return value + self._identity.sign(keys.record_statement(record.key, record.subkey, value,
                                                                 record.expiration_time))

    def validate(self, record: DHTRecord) -> bool:
        value = bytes(record.value)
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # msgpack raises several types for bytes that are not one of its values
            return False
        claim = keys.parse_subkey(subkey) if isinstance(subkey, str) else None
        if claim is None or len(value) <= ids.SIGNATURE_BYTES:
            return False
        if claim == VOUCHED.get():
            return True
        body, signature = value[:-ids.SIGNATURE_BYTES], value[-ids.SIGNATURE_BYTES:]
        return ids.verify(claim[1], signature, keys.record_statement(record.key, record.subkey, body,
                                                                     record.expiration_time))

    def strip_value(self, record: DHTRecord) -> bytes:
        return bytes(record.value)[:-ids.SIGNATURE_BYTES]
