"""DHT mode's pure rules: membership freeze, majority digest, slice plan, parameter ranges, HMAC.

No sockets and no hivemind; the transport that uses these is tested in tests/integration/test_dht.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from demonet import wire
from demonet.dht.freeze_rules import freeze
from demonet.dht.rules import (
    Announcement,
    SlicePlan,
    majority_digest,
    members_digest,
    param_ranges,
    sign,
    stacks_slices,
    verify,
)
from demonet.optim import DeMo, Payload, aggregate
from demonet.train.model import GPT, ModelConfig


def _ann(peer: str, t: float, digest: str = "d") -> Announcement:
    return Announcement(peer, t, digest)


def test_freeze_waits_for_the_expected_peers_then_takes_exactly_them() -> None:
    seen = {"a": _ann("a", 10.0), "b": _ann("b", 10.5)}
    frozen = freeze(seen, expected={"a", "b", "c"}, start_peers=1, window_s=5.0)
    assert frozen is not None and not frozen.complete and not frozen.settled and frozen.deadline == 15.0
    seen["x"] = _ann("x", 10.7)  # an announcer nobody expects (it did not register as a joiner)
    seen["c"] = _ann("c", 11.0)
    frozen = freeze(seen, expected={"a", "b", "c"}, start_peers=1, window_s=5.0)
    assert frozen is not None and frozen.complete and frozen.settled
    assert frozen.members == ("a", "b", "c") and frozen.deadline == 11.0


def test_freeze_at_the_deadline_drops_the_missing_and_takes_who_was_in_time() -> None:
    seen = {"a": _ann("a", 10.0), "b": _ann("b", 14.0), "late": _ann("late", 15.5)}
    frozen = freeze(seen, expected={"a", "b", "dead"}, start_peers=1, window_s=5.0)
    assert frozen is not None and not frozen.complete and not frozen.settled
    assert frozen.members == ("a", "b") and frozen.deadline == 15.0
    # An expected peer that announced after the deadline does not complete the round either.
    seen["dead"] = _ann("dead", 16.0)
    again = freeze(seen, expected={"a", "b", "dead"}, start_peers=1, window_s=5.0)
    assert again == frozen


def test_first_round_waits_for_start_peers_however_long() -> None:
    seen = {"a": _ann("a", 0.0), "b": _ann("b", 100.0)}
    frozen = freeze(seen, expected=None, start_peers=3, window_s=5.0)
    assert frozen is not None and frozen.members == () and frozen.deadline == float("inf")
    seen["c"] = _ann("c", 200.0)
    seen["d"] = _ann("d", 300.0)
    frozen = freeze(seen, expected=None, start_peers=3, window_s=5.0)
    assert frozen is not None and frozen.complete and not frozen.settled  # read again after the store latency
    assert frozen.members == ("a", "b", "c") and frozen.deadline == 200.0
    assert freeze({}, expected=None, start_peers=1, window_s=1.0) is None


def test_freeze_does_not_depend_on_the_order_records_are_seen() -> None:
    items = [_ann(p, t) for p, t in (("c", 3.0), ("a", 1.0), ("b", 2.0), ("z", 9.0))]
    one = freeze({a.peer_id: a for a in items}, expected=None, start_peers=2, window_s=4.0)
    two = freeze({a.peer_id: a for a in reversed(items)}, expected=None, start_peers=2, window_s=4.0)
    assert one == two


def test_majority_digest_and_ties() -> None:
    assert majority_digest({"a": "x", "b": "y", "c": "y"}) == "y"
    assert majority_digest({"a": "x", "b": "y"}) == "x"  # a tie: the smallest, on every peer
    assert members_digest(["a", "b"]) != members_digest(["a", "c"])


def test_hmac_depends_on_token_and_data() -> None:
    mac = sign(b"token", b"record")
    assert len(mac) == 32 and verify(b"token", b"record", mac)
    assert not verify(b"other", b"record", mac)
    assert not verify(b"token", b"recorD", mac)


def _payloads(num_peers: int, encoding: str = "fp32") -> tuple[DeMo, list[Payload]]:
    payloads = []
    opt = None
    for seed in range(num_peers):
        torch.manual_seed(0)
        model = GPT(ModelConfig(d_model=32, n_layers=1, n_heads=2, seq_len=16, vocab_size=64))
        opt = DeMo(model.named_parameters(), lr=0.01, compression_topk=4, compression_chunk=8, encoding=encoding)
        torch.manual_seed(seed)
        x_BT = torch.randint(0, 64, (2, 16))
        _, loss = model(x_BT, x_BT)
        assert loss is not None
        loss.backward()
        payloads.append(opt.compress())
    assert opt is not None
    return opt, payloads


@pytest.mark.parametrize("num_slices", [1, 3, 7])
def test_slices_merged_then_joined_are_the_aggregate(num_slices: int) -> None:
    """Cut every payload into slices, merge each slice on its own, join: the same bits as one merge."""
    opt, payloads = _payloads(3)
    plan = SlicePlan(opt.param_specs(), num_slices)
    merged = []
    for s in range(plan.n):
        cuts = []
        for p in payloads:  # through the wire, as the parts travel
            _, cut = wire.decode(wire.encode(plan.cut(p, s), step=5), expected=plan.slice_specs(s))
            cuts.append(cut)
        merged.append(aggregate(cuts, topk=4))
    joined = plan.join(merged)
    whole = aggregate(payloads, topk=4)
    for name, c in whole.tensors.items():
        j = joined.tensors[name]
        # The same entries per row (top-k leaves them in an order that depends on the batch of rows).
        j_order, c_order = j.idx.argsort(dim=1), c.idx.argsort(dim=1)
        assert torch.equal(j.idx.gather(1, j_order), c.idx.gather(1, c_order)), name
        assert torch.equal(j.val.gather(1, j_order), c.val.gather(1, c_order)), name
    opt.apply(joined)  # fits the model


def test_slice_plan_covers_every_row_once_and_a_missing_slice_is_empty() -> None:
    opt, payloads = _payloads(1, encoding="int8")  # per-row scales travel with their rows
    plan = SlicePlan(opt.param_specs(), 4)
    total = sum(c.idx.shape[0] for c in payloads[0].tensors.values())
    rows = [sum(c.idx.shape[0] for c in plan.cut(payloads[0], s).tensors.values()) for s in range(plan.n)]
    assert sum(rows) == total and max(rows) - min(rows) <= 1
    for s in range(plan.n):
        wire.encode(plan.cut(payloads[0], s), step=0)  # int8 scales sliced with their rows
    joined = plan.join([plan.cut(payloads[0], s) for s in range(plan.n)])
    for name, c in payloads[0].tensors.items():
        assert torch.equal(joined.tensors[name].idx, c.idx) and torch.equal(joined.tensors[name].val, c.val)
    dropped = plan.join([plan.cut(payloads[0], s) if s != 2 else None for s in range(plan.n)])
    lost = [name for name, c in dropped.tensors.items() if not torch.equal(c.val, payloads[0].tensors[name].val)]
    assert lost and all(bool((dropped.tensors[n].val == 0).any()) for n in lost)
    assert SlicePlan(opt.param_specs(), 10**6).n == total  # never more slices than rows


def _dense(payload: Payload) -> dict[str, torch.Tensor]:
    """Each tensor's rows as dense (C, h*w) coefficients: what applying it adds, padding (value 0) or not."""
    out = {}
    for name, c in payload.tensors.items():
        dense = torch.zeros(c.idx.shape[0], c.totalk, dtype=torch.float32)
        out[name] = dense.scatter_add_(1, c.idx, c.val.float())
    return out


def test_stacked_slices_travel_one_tensor_per_chunk_shape_and_merge_as_unstacked() -> None:
    """Stacking a slice's rows of one chunk shape into one tensor changes the bytes, not what is applied."""
    opt, payloads = _payloads(3)
    specs = opt.param_specs()
    stacked, apart = SlicePlan(specs, 3), SlicePlan(specs, 3, stack=False)
    merged: dict[bool, list[Payload]] = {True: [], False: []}
    for s in range(stacked.n):
        chunks = {specs[p.name][1] for p in stacked.slices[s]}
        assert len(stacked.slice_specs(s)) == len(chunks) < len(apart.slice_specs(s))
        size = {}
        for plan in (stacked, apart):
            parts = [plan.cut(p, s) for p in payloads]
            assert {n: (c.shape, c.chunk) for n, c in parts[0].tensors.items()} == plan.slice_specs(s)
            data = [wire.encode(part, step=5) for part in parts]
            size[plan.stack] = len(data[0])
            cuts = [wire.decode(d, expected=plan.slice_specs(s))[1] for d in data]
            merged[plan.stack].append(aggregate(cuts, topk=4))
        assert size[True] < size[False]  # fewer tensor headers
    one, two = _dense(stacked.join(merged[True])), _dense(apart.join(merged[False]))
    assert one.keys() == two.keys() == specs.keys()
    for name in specs:
        assert torch.equal(one[name], two[name]), name
    whole = stacked.join([stacked.cut(payloads[1], s) for s in range(stacked.n)])  # cut then joined: unchanged
    for name, c in payloads[1].tensors.items():
        assert torch.equal(whole.tensors[name].idx, c.idx) and torch.equal(whole.tensors[name].val, c.val)


def test_fp16_payloads_are_cut_unstacked_and_a_stacked_cut_of_them_is_refused() -> None:
    opt, payloads = _payloads(1, encoding="fp16")  # one scale per tensor: rows of two tensors cannot share one
    assert not stacks_slices("fp16") and all(stacks_slices(e) for e in ("fp32", "bf16", "int8", "sign"))
    with pytest.raises(ValueError, match="cannot be stacked"):
        for s in range(3):
            SlicePlan(opt.param_specs(), 3).cut(payloads[0], s)
    plan = SlicePlan(opt.param_specs(), 3, stack=False)
    cuts = [wire.decode(wire.encode(plan.cut(payloads[0], s), step=0), expected=plan.slice_specs(s))[1]
            for s in range(plan.n)]
    joined, sent = _dense(plan.join(cuts)), _dense(payloads[0])  # rows come sorted by index
    for name in sent:
        assert torch.equal(joined[name], sent[name]), name


def test_param_ranges_are_contiguous_balanced_and_never_empty() -> None:
    sizes = [("a", 10), ("b", 10), ("c", 100), ("d", 1)]
    for n in range(1, 6):
        ranges = param_ranges(sizes, n)
        assert [name for r in ranges for name in r] == ["a", "b", "c", "d"]
        assert len(ranges) == min(n, 4) and all(ranges)
    assert param_ranges([("a", 5), ("b", 5), ("c", 5), ("d", 5)], 2) == [["a", "b"], ["c", "d"]]
    assert param_ranges([], 3) == []


def test_importing_demonet_needs_no_hivemind() -> None:
    code = ("import sys, demonet.cli, demonet.dht.peer, demonet.dht.rules; "
            "print('hivemind' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
