"""demonet: decentralized training with DeMo (decoupled momentum optimization)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from demonet.joined import JoinedRun

__all__ = ["__version__", "join"]

__version__ = "0.1.0"


def join(coordinator: str | None = None, **kwargs: Any) -> JoinedRun:
    """Join a run from your own training loop: ``with demonet.join(coordinator="HOST:PORT") as run:``.

    The same as `demonet.joined.join` (its arguments and docs/own-loop.md), imported on first use so
    that ``import demonet`` stays light.
    """
    from demonet.joined import join as _join

    return _join(coordinator, **kwargs)
