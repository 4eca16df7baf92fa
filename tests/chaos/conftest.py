"""The chaos fixtures: a network lab, always torn down, and a cluster (one launcher per mode) on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from demonet.lab import netlab
from tests.chaos.cluster import CoordinatorCluster
from tests.procs import Reaper

OK, WHY = netlab.available()

LAUNCHERS = {"coordinator": CoordinatorCluster}
"""Modes the scenarios run in. DHT mode (`tests.chaos.dht_cluster.DhtCluster`) runs its own scenarios in
test_dht.py: these ones assert on the coordinator (its digests, drops, restart, RPCs), which it has not."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/chaos/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.chaos)
            item.add_marker(pytest.mark.slow)
            if not OK:
                item.add_marker(pytest.mark.skip(reason=f"chaos tests need network namespaces: {WHY}"))


@pytest.fixture
def lab() -> Iterator[netlab.Lab]:
    netlab.sweep()  # namespaces a killed earlier run left behind
    with netlab.Lab() as lab:
        yield lab


@pytest.fixture(params=sorted(LAUNCHERS))
def cluster(request: pytest.FixtureRequest, lab: netlab.Lab, tmp_path: Path,
            reap_children: Reaper) -> CoordinatorCluster:
    # reap_children is set up after lab, so it ends the cluster's processes before the lab is torn down.
    return LAUNCHERS[request.param](lab, tmp_path, reap_children)
