"""demonet: decentralized training with DeMo (decoupled momentum optimization).

`demonet.Task` is what a run trains (a model, each peer's batches, a loss); it is imported on first use,
so that `import demonet` alone (the health probe) stays light.
"""

from typing import Any

__version__ = "0.1.0"

__all__ = ["Task", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Task":
        from demonet.train.task import Task

        return Task
    raise AttributeError(f"module 'demonet' has no attribute {name!r}")
