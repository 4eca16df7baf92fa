"""The expected errors of demonet: a peer, a round or a payload failed, not the program.

Imports nothing from demonet. Anything else that is raised is a bug and should crash.
"""

__all__ = ["DemonetError", "InvalidPayload", "PeerUnavailable", "RoundAborted"]


class DemonetError(Exception):
    """Base of the errors that are handled at a round boundary."""


class InvalidPayload(DemonetError):
    """An inbound message failed validation; it was rejected and changed no state."""


class PeerUnavailable(DemonetError):
    """A peer could not be reached in time."""


class RoundAborted(DemonetError):
    """A round ended without an aggregate (no quorum, deadline, shutdown)."""
