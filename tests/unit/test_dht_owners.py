"""DHT mode's slice owners (demonet.dht.rules.owner_count and owner_order): how many of a round's dialable
members own a slice, and in which order. Pure logic; the exchange with fewer owners than members over real
hivemind nodes is in tests/integration/test_dht_owners.py."""

from __future__ import annotations

import math

import pytest
import torch

from demonet.config import load_config
from demonet.dht import rules
from demonet.dht.options import DhtOptions
from demonet.optim.payload import num_chunks
from demonet.train.trainer import Trainer

# 3 x 32 entries of (64, 64) chunks and 4 x 32 of (1, 64) ones at topk 32: 224 entries of the aggregate.
SPECS = {"w": ((192, 64), (64, 64)), "b": ((256,), (1, 64))}
MEMBERS = [f"p{i}" for i in range(10)]


def test_one_owner_for_each_slice_entries_of_the_aggregate_between_four_and_every_member() -> None:
    assert rules.owner_count(10, SPECS, 32, 0) == 10  # 0: every dialable member
    assert rules.owner_count(10, SPECS, 32, 1) == 10  # more slices than members: every member
    assert rules.owner_count(10, SPECS, 32, 28) == 8  # 224 / 28
    assert rules.owner_count(10, SPECS, 32, 30) == 8  # ceil(224 / 30)
    assert rules.owner_count(10, SPECS, 32, 4096) == rules.MIN_SLICE_OWNERS
    assert rules.owner_count(3, SPECS, 32, 4096) == 3  # fewer dialable members than the minimum: all of them
    assert rules.owner_count(4, SPECS, 32, 4096) == 4
    # k counts at most the chunk's coefficients: at topk 100 the (1, 64) rows hold 64 entries, not 100.
    assert rules.owner_count(1000, SPECS, 100, 1) == 3 * 100 + 4 * 64


def test_the_embedded_model_at_the_default_has_four_owners_from_five_members() -> None:
    """The default `slice_entries` (4096) and the embedded default model (9,984 entries of the aggregate):
    every member owns a slice up to 4 members, 4 of them do beyond."""
    cfg = load_config(None)
    specs = Trainer.for_run(cfg, data_seed=0, device=torch.device("cpu")).opt.param_specs()
    entries = sum(num_chunks(shape, chunk) * min(cfg.optim.compression_topk, chunk[0] * chunk[1])
                  for shape, chunk in specs.values())
    assert entries == 9984 and cfg.net.slice_entries == DhtOptions(run="r", token="t").slice_entries == 4096
    topk = cfg.net.aggregate_topk or cfg.optim.compression_topk
    assert [rules.owner_count(n, specs, topk, cfg.net.slice_entries) for n in (2, 4, 5, 8, 16)] == [2, 4, 4, 4, 4]
    assert rules.owner_count(16, specs, topk, 1024) == math.ceil(9984 / 1024)


def test_fewer_owners_than_members_turn_with_the_round_and_every_member_owns_in_turn() -> None:
    owned = {p: 0 for p in MEMBERS}
    for r in range(100):
        order = rules.owner_order(r, MEMBERS, 4)
        assert sorted(order) == MEMBERS and order == rules.owner_order(r, MEMBERS, 4)  # the same on every peer
        assert order[0] == MEMBERS[r % len(MEMBERS)]
        for p in order[:4]:
            owned[p] += 1
    assert set(owned.values()) == {40}  # 4 slices a round, 100 rounds, 10 members: each owns 40 times
    assert rules.owner_order(7, MEMBERS, 10) == MEMBERS  # every member an owner: the sorted list, as before
    assert rules.owner_order(7, [], 0) == []


def test_a_member_that_owns_no_slice_may_verify_one() -> None:
    """The verifier of slice s is drawn among the other dialable members, owners or not."""
    order = rules.owner_order(0, MEMBERS[:6], 4)
    verifiers = set()
    for r in range(200):
        chosen = rules.verifiers(r, "m", order, 4, 1.0)
        assert chosen.keys() == {0, 1, 2, 3}
        assert all(v != order[s] for s, v in chosen.items())
        verifiers |= set(chosen.values())
    assert verifiers == set(MEMBERS[:6])


@pytest.mark.parametrize("bad", [-1, -4096])
def test_a_negative_slice_entries_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="slice_entries"):
        DhtOptions(run="r", token="t", slice_entries=bad)
    with pytest.raises(ValueError, match="slice_entries"):
        load_config(None, env={"DEMONET_NET_SLICE_ENTRIES": str(bad)})
