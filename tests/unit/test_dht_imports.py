"""Importing DHT mode leaves `scipy.optimize` unrun (hivemind imports it for its averaging, which DHT mode
never calls: 0.6 s of CPU in every peer), and `scipy.optimize` works all the same for
whoever uses it. Each case runs in a fresh interpreter, so no earlier import hides the effect."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("hivemind")

BALANCE = ("from hivemind.averaging.load_balancing import load_balance_peers; "
           "print(load_balance_peers(100, [1.0, 2.0, 3.0]))")
"""hivemind's load balancer, which calls scipy.optimize.linprog."""


def _python(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split("\n")[:-1]


def test_dht_mode_imports_hivemind_without_running_scipy_optimize() -> None:
    code = ("import sys, demonet.dht.hive, demonet.dht.streams, demonet.dht.node, hivemind; "
            "print('hivemind.averaging.load_balancing' in sys.modules, 'scipy.optimize._optimize' in sys.modules)")
    assert _python(code) == ["True False"]


def test_scipy_optimize_is_the_real_module_once_used() -> None:
    expected = _python(BALANCE)  # without demonet: scipy.optimize imported as usual
    code = ("import sys, demonet.dht.streams; " + BALANCE + "; import scipy, scipy.optimize; "
            "from scipy.optimize import linprog; m = sys.modules['scipy.optimize']; "
            "print(type(m).__name__, scipy.optimize is m, m.linprog is linprog)")
    assert _python(code) == [*expected, "module True True"]


def test_an_imported_scipy_optimize_is_left_as_it_is() -> None:
    code = "import sys, scipy.optimize as so; import demonet.dht.streams; print(sys.modules['scipy.optimize'] is so)"
    assert _python(code) == ["True"]
