"""demonet: decentralized training with DeMo (decoupled momentum optimization).

`demonet.Task` (what a run trains: a model, each peer's batches, a loss) and `demonet.join` (a user's
own training loop as one peer of a run) are imported on first use, so that `import demonet` alone (the
health probe) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from demonet.joined import JoinedRun

__all__ = ["Task", "__version__", "join"]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Task":
        from demonet.train.task import Task

        return Task
    raise AttributeError(f"module 'demonet' has no attribute {name!r}")


def join(coordinator: str | None = None, **kwargs: Any) -> JoinedRun:
    """Join a run from your own training loop: ``with demonet.join(coordinator="HOST:PORT") as run:``.

    The same as `demonet.joined.join` (its arguments and docs/own-loop.md), imported on first use so
    that ``import demonet`` stays light.
    """
    from demonet.joined import join as _join

    return _join(coordinator, **kwargs)
