"""DHT mode: peers meet on a hivemind DHT and exchange payload slices over libp2p streams, no coordinator.

Importing this package first defers `scipy.optimize`: hivemind's package imports its averaging machinery,
whose load balancer imports `scipy.optimize` at its top (0.6 s of CPU here, in every peer and every DHT
process) for a `linprog` it calls only when averaging, which DHT mode never does. Until then
``sys.modules["scipy.optimize"]`` holds a `_Deferred` stand-in, which imports the real module at the first
access to any of its attributes and hands over to it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any


class _Deferred(types.ModuleType):
    """A module's stand-in until one of its attributes is read: then the module is imported (it replaces
    the stand-in in `sys.modules` and in its parent package) and the attribute is read from it."""

    def __getattr__(self, attr: str) -> Any:
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), attr)


def _defer(name: str) -> None:
    """Put a `_Deferred` stand-in for module `name` in `sys.modules`, unless the module is imported already
    or cannot be found (then its importer says so, as without the stand-in)."""
    if name in sys.modules:
        return
    try:
        spec = importlib.util.find_spec(name)
    except ImportError:  # its parent package is missing
        return
    if spec is None:
        return
    module = _Deferred(name)
    module.__file__ = spec.origin  # what walks over sys.modules reads (inspect.getmodule): no import for it
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)


_defer("scipy.optimize")
