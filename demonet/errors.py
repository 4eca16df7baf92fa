"""demonet's error families, all in one place: what a peer, a round, a payload or a request can fail with.

Imports nothing from demonet. Three kinds:
- expected errors of a round (`DemonetError` and its subclasses): caught at a round boundary, logged once,
  and the round skipped, the payload restored or the peer dropped;
- refusals (`SubmitRejected`, `AggregateGone`, `Refused`, `Busy`): a coordinator's answer to a request it does
  not take, turned into a status code or a peer's `Rejected` by the adapter that received the request;
- bad input from a person (`ValueError` subclasses: a key or weights file that cannot be used).
Anything else that is raised is a bug and should crash.
"""

from __future__ import annotations

import enum

__all__ = ["AggregateGone", "BadTensor", "Busy", "DemonetError", "InvalidPayload", "KeyFileError", "NotJoined",
           "NotMember", "PeerUnavailable", "Refusal", "Refused", "Rejected", "Resync", "StaleRound", "StateNotSaved",
           "SubmitRejected", "WeightsFileError"]


# -- expected errors of a round ------------------------------------------------------------------------


class DemonetError(Exception):
    """Base of the errors that are handled at a round boundary."""


class InvalidPayload(DemonetError):
    """An inbound message failed validation; it was rejected and changed no state."""


class PeerUnavailable(DemonetError):
    """A peer could not be reached in time."""


class Rejected(DemonetError):
    """The payload was not taken into the round; the peer restores it and gets back in step."""


class Resync(Rejected):
    """This peer's parameters differ from the canonical ones: download them again, recompute the round."""


class NotMember(Rejected):
    """This peer is not a member of the round (dropped, or the coordinator forgot it): join again."""


class StaleRound(Rejected):
    """The round is over for this peer: continue from the coordinator's open round."""

    def __init__(self, message: str, *, open_round: int) -> None:
        super().__init__(message)
        self.open_round = open_round


class StateNotSaved(DemonetError):
    """The coordinator's newest snapshot could not be written: the state file on disk is older than the run."""


# -- a coordinator's refusals ----------------------------------------------------------------------------


class Refusal(enum.StrEnum):
    """Why a coordinator did not take a call's payload or request: the one list both coordinators answer with
    (the gRPC servicer as a `Refusal` of proto/demonet.proto, the in-process one as the peer's exception)."""

    STALE = "stale"
    """The round is closed: continue from the open one."""
    FUTURE = "future"
    """The round has not opened (a coordinator that lost its state): join again."""
    NOT_MEMBER = "not_member"
    """Not a member of the round: join again."""
    DUPLICATE = "duplicate"
    """This very payload is in already (a retry whose first try got in)."""
    CONFLICT = "conflict"
    """Another payload of the peer for the round is in."""
    RESYNC = "resync"
    """The peer's parameter digest differs from the canonical one: download the parameters."""
    INVALID = "invalid"
    """The payload failed validation."""
    BUSY = "busy"
    """Another stream of the peer for the round is open, or the bytes in flight are spent: try again soon."""


class SubmitRejected(Exception):
    """A submission or request the coordinator does not take (not an error of the coordinator), and why."""

    def __init__(self, reason: str, kind: Refusal) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind

    @property
    def stale(self) -> bool:
        return self.kind == Refusal.STALE


class AggregateGone(Exception):
    """A round's aggregate cannot be had (`resubmit`: the coordinator lost this member's payload for the open
    round, which it still holds; else the round has not opened, or is too old: download the parameters)."""

    def __init__(self, reason: str, *, resubmit: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.resubmit = reason, resubmit


class Refused(Exception):
    """A join or signed request that is not admitted; the reason is for people."""


class NotJoined(Refused):
    """A signed request under a peer id no key has joined as (or whose key left the allowlist): join first."""


class Busy(Exception):
    """A Submit stream that may not start now: the peer has one open, or the bytes in flight are spent."""


# -- bad input -------------------------------------------------------------------------------------------


class WeightsFileError(ValueError):
    """A state folder or a safetensors file that cannot be used; the message names the file and why."""


class KeyFileError(ValueError):
    """A key file that cannot be read as an Ed25519 private key, or one others may read."""


class BadTensor(Exception):
    """Tensor `tensor` of a batch is malformed. `demonet.wire` names it and raises InvalidPayload or ValueError."""

    def __init__(self, tensor: int, message: str) -> None:
        super().__init__(message)
        self.tensor = tensor
