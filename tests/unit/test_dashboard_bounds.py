"""The status document stays small when thousands of ids join: it lists the most relevant members (contributors
first, then the most recently heard from) and counts the others by state, in both modes, in `demonet status` and
on the page."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from demonet.cli.status import format_status
from demonet.coordinator.metrics import Metrics
from demonet.coordinator.rounds import RoundConfig, Rounds
from demonet.coordinator.status import status_document
from demonet.dashboard.record import MAX_LISTED
from demonet.dht.rules import Announcement
from demonet.dht.view import DhtView
from tests.dashboard_schema import check_document

SCRIPT = Path(__file__).resolve().parents[2] / "demonet" / "dashboard" / "dashboard.js"


def _swarm(num_ids: int) -> tuple[Rounds, Metrics]:
    """Two honest peers that contributed to round 0 and `num_ids` ids that joined and never sent a payload (the
    most recent heard from last), 3 of them joiners; one more honest peer that left after contributing."""
    rounds, metrics = Rounds(cfg=RoundConfig(round_timeout_s=10.0, start_peers=3), now=0.0), Metrics()
    for p in ("honest-a", "honest-b", "gone"):
        rounds.join(p, 0.0)
    for p in ("honest-a", "honest-b", "gone"):
        rounds.submit(p, 0, 1.0)
        metrics.uploaded(p, 1000, 0.01, 3.0)
    rounds.close(1.0)
    metrics.closed(False, 0.1, 3.0, round=0, members=("honest-a", "honest-b", "gone"),
                   contributors=("honest-a", "honest-b", "gone"), round_s=1.0)
    del rounds.members["gone"]
    for i in range(num_ids):
        rounds.members[f"sybil-{i:05d}"] = 2.0 + i / num_ids  # heard from between 2 s and 3 s
    for i in range(3):
        rounds.joiners[f"late-{i}"] = 3.5
    return rounds, metrics


@pytest.mark.parametrize("num_ids", [1000, 5000])
def test_thousands_of_ids_give_a_bounded_document_whose_counts_add_up(num_ids: int) -> None:
    rounds, metrics = _swarm(num_ids)
    doc = status_document(rounds, metrics, now=4.0, param_digest="ab" * 16, total_rounds=0)
    check_document(doc, "coordinator")
    listed = {m["id"]: m["state"] for m in doc["members"]}
    assert len(listed) == MAX_LISTED
    # the contributors first (the one that left too), then the most recently heard from
    assert listed["honest-a"] == listed["honest-b"] == "member" and listed["gone"] == "left"
    assert all(listed[f"late-{i}"] == "joining" for i in range(3))
    newest = {f"sybil-{i:05d}" for i in range(num_ids - (MAX_LISTED - 6), num_ids)}
    assert {p for p in listed if p.startswith("sybil-")} == newest
    # every id is either listed or counted, once, in its state
    assert all(listed[p] == "new" for p in newest)  # no payload of theirs accepted: not waited on
    assert doc["members_omitted"] == {"new": num_ids - len(newest)}
    assert len(listed) + sum(doc["members_omitted"].values()) == num_ids + 6
    assert doc["run"]["members"] == num_ids + 2 and doc["run"]["joiners"] == 3
    size = len(json.dumps(doc, allow_nan=False))
    assert size < 80_000, size  # 200 rows of about 300 bytes; 1,002 members used to make 244 KB
    text = format_status(doc)
    assert f"... and {num_ids - len(newest)} more not listed: {num_ids - len(newest)} new" in text
    assert len(text.splitlines()) < MAX_LISTED + 30


def test_the_document_size_does_not_grow_with_the_ids() -> None:
    sizes = []
    for num_ids in (500, 4000):
        rounds, metrics = _swarm(num_ids)
        doc = status_document(rounds, metrics, now=4.0, param_digest="", total_rounds=0)
        sizes.append(len(json.dumps(doc["members"])))
    assert abs(sizes[1] - sizes[0]) < 200, sizes  # the same 200 rows' worth, whatever the ids behind them


def test_a_small_run_lists_everyone_and_omits_nothing() -> None:
    rounds, metrics = _swarm(10)
    doc = status_document(rounds, metrics, now=4.0, param_digest="", total_rounds=0)
    check_document(doc, "coordinator")
    assert len(doc["members"]) == 16 and doc["members_omitted"] == {}
    assert "not listed" not in format_status(doc)


def test_a_dht_peer_with_thousands_of_members_counts_the_rest_by_state() -> None:
    view = DhtView("a", total_rounds=0, window_s=5.0)
    members = ["a", *(f"m{i:04d}" for i in range(3000))]
    contributors = [p for p in members if p.endswith(("00", "a"))]
    announced = {p: Announcement(p, 0.0, "bad" if p.endswith("7") else "good", loss=1.0) for p in members}
    view.entered(0)
    view.frozen(0, members, announced, "good")
    view.exchanged(0, contributors=contributors, slice_owners=["a"], aborted=False, bytes_up=10, bytes_down=10)
    doc = view.document()
    check_document(doc, "dht")
    assert len(doc["members"]) == MAX_LISTED
    # the contributors are listed, with their counters (the record kept them over 3,000 ids that sent nothing)
    assert {m["id"] for m in doc["members"] if m["contributed"] == 1} == set(contributors)
    states: dict[str, int] = {}
    for m in doc["members"]:
        states[m["state"]] = states.get(m["state"], 0) + 1
    for state, count in doc["members_omitted"].items():
        states[state] = states.get(state, 0) + count
    assert states == {"member": 31, "resync": 300, "missed": 2670}


def test_the_page_says_how_many_members_it_does_not_list() -> None:
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("no node on PATH: the page's functions are checked in node")
    harness = ("const d = require(process.argv[1]); console.log(JSON.stringify("
               "[d.omittedText({member: 800, joining: 2}), d.omittedText({}), d.omittedText(undefined)]));")
    proc = subprocess.run([node, "-e", harness, str(SCRIPT)], capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["… and 802 more not listed: 800 member, 2 joining", "", ""]
