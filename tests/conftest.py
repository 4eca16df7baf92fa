"""Fixtures for every test folder. Tests import helpers from plain modules (tests.procs), never from here."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.procs import Reaper


@pytest.fixture
def reap_children() -> Iterator[Reaper]:
    """Register every process (and log file) a test starts here: at teardown, also when the test fails,
    each one still running is SIGKILLed (with its process group if added with group=True) and reaped."""
    reaper = Reaper()
    yield reaper
    reaper.close()
