"""The dashboard's pieces without sockets: the bounded record, both modes' documents, the HTTP answers,
and `demonet status`'s tables."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from demonet.cli.status import format_status
from demonet.coordinator.metrics import Metrics
from demonet.coordinator.rounds import RoundConfig, Rounds
from demonet.coordinator.status import status_document
from demonet.dashboard import RunRecord, page_routes
from demonet.dashboard.server import _respond
from demonet.dht.rules import Announcement
from demonet.dht.view import DhtView
from tests import dashboard_schema
from tests.dashboard_schema import check_document

DOCS = Path(__file__).resolve().parents[2] / "docs" / "dashboard.md"


def test_the_record_is_bounded_and_keeps_the_latest() -> None:
    record = RunRecord(max_rounds=4, max_refusals=3, max_members=5)
    for i in range(10):
        record.uploaded(f"p{i}", 100, 0.5, 1.0)
        record.refused(f"p{i}", i, "stale", "x" * 1000)
        record.round_closed(i, members=[f"p{i}"], contributors=[f"p{i}"], aborted=False, loss=1.0, round_s=1.0,
                            close_s=0.1, bytes_up=1, bytes_down=2)
    assert [r["round"] for r in record.rounds] == [6, 7, 8, 9]
    assert [r["peer"] for r in record.refusals] == ["p7", "p8", "p9"]
    assert all(len(r["reason"]) <= 300 for r in record.refusals)
    assert list(record.members) == ["p5", "p6", "p7", "p8", "p9"]
    assert record.members["p9"].link_bps == 200.0


def test_rounds_count_contributions_and_misses_and_json_has_no_nan() -> None:
    record = RunRecord()
    record.round_closed(0, members=["a", "b"], contributors=["a"], aborted=False, loss=math.nan, round_s=-1.0,
                        close_s=math.inf, bytes_up=5, bytes_down=6)
    record.round_closed(1, members=["a", "b"], contributors=["a", "b"], aborted=True, loss=2.0, round_s=1.0,
                        close_s=0.5, bytes_up=5, bytes_down=6)
    a, b = record.members["a"], record.members["b"]
    assert (a.contributed, a.missed, b.contributed, b.missed) == (1, 1, 0, 2)  # an aborted round: nobody's in
    doc = record.document("coordinator", "coordinator", {}, {"a": ("member", 0.5)}, since=0)
    assert [r["round"] for r in doc["rounds"]] == [1]
    first = record.document("coordinator", "coordinator", {}, {})["rounds"][0]
    assert (first["loss"], first["round_s"], first["close_s"]) == (None, 0.0, None)
    json.dumps(doc, allow_nan=False)
    assert [(m["id"], m["state"]) for m in doc["members"]] == [("a", "member"), ("b", "left")]


def test_the_coordinator_document_follows_the_rounds_and_metrics() -> None:
    rounds, metrics = Rounds(cfg=RoundConfig(round_timeout_s=10.0, start_peers=2), now=0.0), Metrics()

    def doc(now: float) -> dict:
        d = status_document(rounds, metrics, now=now, param_digest="ab" * 16, total_rounds=3)
        check_document(d, "coordinator")
        return d

    rounds.join("a", 0.0)
    assert doc(1.0)["run"]["phase"] == "waiting" and doc(1.0)["run"]["seconds_left"] is None
    rounds.join("b", 1.0)
    rounds.submit("a", 0, 2.0)
    metrics.uploaded("a", 1000, 0.01, 3.5)
    metrics.add("bytes_down", 700, peer="b")
    metrics.refused("b", 0, "stale", "round 0 is closed")
    d = doc(3.0)
    assert (d["run"]["phase"], d["run"]["seconds_left"], d["run"]["submitted"]) == ("open", 8.0, 1)
    states = {m["id"]: (m["state"], m["last_seen_s"]) for m in d["members"]}
    assert states == {"a": ("submitted", 1.0), "b": ("member", 2.0)}
    metrics.phase.set(1)
    assert doc(3.0)["run"]["phase"] == "closing"
    metrics.phase.set(0)
    metrics.closed(False, 0.2, 3.5, round=0, members=("a", "b"), contributors=("a",), round_s=2.5)
    rounds.submit("b", 0, 3.0)
    rounds.close(4.0)
    d = doc(4.0)
    assert d["rounds"][0] | {"time": 0} == {"round": 0, "time": 0, "aborted": False, "loss": 3.5, "round_s": 2.5,
                                            "close_s": 0.2, "members": 2, "contributors": 1, "bytes_up": 1000,
                                            "bytes_down": 700}
    a = next(m for m in d["members"] if m["id"] == "a")
    assert (a["contributed"], a["missed"], a["bytes_up"], a["link_bps"], a["last_loss"]) == (1, 0, 1000, 1e5, 3.5)
    assert d["refusals"][0]["kind"] == "stale" and d["run"]["bytes_up"] == 1000
    assert (a["samples"], a["topk"], a["weight"], a["upload_s"], a["need_s"]) == (None, None, None, 0.01, None)


def test_each_members_samples_k_and_weight_in_the_document() -> None:
    """A mixed swarm's round: the fast peer's payload of 8 samples at k 32, the slow one's of 2 at k 8, merged
    with weights 8 and 2: each member's row says so (what the dashboard shades the slow peer by)."""
    record = RunRecord()
    record.uploaded("fast", 4000, 0.01, 3.0, samples=8, topk=32, need_s=0.3)
    record.uploaded("slow", 1000, 0.5, 3.1, samples=2, topk=8, need_s=1.2)
    record.weighted(["fast", "slow"], [8.0, 2.0])
    live = {"fast": ("member", 0.1), "slow": ("member", 0.1)}
    rows = {m["id"]: m for m in record.document("coordinator", "coordinator", {}, live)["members"]}
    assert (rows["fast"]["samples"], rows["fast"]["topk"], rows["fast"]["weight"]) == (8, 32, 0.8)
    assert (rows["slow"]["samples"], rows["slow"]["topk"], rows["slow"]["upload_s"], rows["slow"]["need_s"]) == (
        2, 8, 0.5, 1.2)
    assert rows["slow"]["weight"] == pytest.approx(0.2)
    record.weighted(["fast", "slow"], [])  # an unweighted merge: alike
    assert record.document("coordinator", "coordinator", {}, live)["members"][0]["weight"] == 0.5


def test_a_dht_peer_describes_the_run_in_the_same_document() -> None:
    view = DhtView("a", total_rounds=10, window_s=5.0)
    check_document(view.document(), "dht")
    announced = {p: Announcement(p, 0.0, "good" if p != "c" else "bad", loss=loss)
                 for p, loss in (("a", 2.0), ("b", 4.0), ("c", None))}
    view.entered(0)
    view.frozen(0, ["a", "b", "c"], announced, "good")
    view.exchanged(0, contributors=["a", "b"], slice_owners=["a", "b", "a"], aborted=False, bytes_up=10,
                   bytes_down=20)
    view.refused = lambda: 3
    d = view.document()
    check_document(d, "dht")
    run = d["run"]
    assert (run["round"], run["phase"], run["last_loss"], run["rejected"]) == (1, "training", 3.0, 3)
    members = {m["id"]: m for m in d["members"]}
    assert {p: (m["state"], m["slices"], m["resyncs"]) for p, m in members.items()} == {
        "a": ("member", 2, 0), "b": ("member", 1, 0), "c": ("resync", 0, 1)}
    assert (members["a"]["bytes_up"], members["b"]["bytes_up"]) == (10, None)  # only its own bytes are known
    assert d["rounds"][0]["members"] == 3 and d["rounds"][0]["contributors"] == 2


def test_a_dht_peer_shows_each_members_samples_weight_k_speed_and_whether_it_spans() -> None:
    """From the announcements (their speeds) and the parts this peer merged (their claimed samples and k), as the merge
    weighs them: a claim over the cap weighs the cap; a peer that holds no part of some contributor shows none."""
    view = DhtView("a", total_rounds=10, window_s=5.0)
    announced = {p: Announcement(p, 0.0, "good", loss=1.0, pace=pace, work=work) for p, pace, work in (
        ("a", (0.3, 0.3, 0.25), (1, 0.25, 0.4)), ("b", (0.3, 0.3, 0.25), (1, 0.26, 0.05)),
        ("c", (0.3, 0.3, 0.25), None), ("slow", (1.1, 1.1, 1.0), (0, 0.0, 0.0)))}
    view.frozen(0, list(announced), announced, "good", spanning={"slow"})
    view.exchanged(0, contributors=["a", "b", "c", "slow"], slice_owners=["a", "b", "c", "slow"], aborted=False,
                   bytes_up=1, bytes_down=1, claims={"a": 16, "b": 16, "c": 10**9, "slow": 4}, max_ratio=4.0,
                   topks={"a": 128, "b": 128, "slow": 40, "gone": 7})
    members = {m["id"]: m for m in view.document()["members"]}
    # the k of the parts it merged (c's: none held here; a peer not in the round: not shown), its own upload
    assert {p: m["topk"] for p, m in members.items()} == {"a": 128, "b": 128, "c": None, "slow": 40}
    # each one's last upload as it announced it (its parts timed by their receipts; none measured: not shown)
    assert {p: m["upload_s"] for p, m in members.items()} == {"a": 0.4, "b": 0.05, "c": None, "slow": None}
    assert {p: m["state"] for p, m in members.items()} == {"a": "member", "b": "member", "c": "member",
                                                          "slow": "spanning"}
    assert {p: m["samples"] for p, m in members.items()} == {"a": 16, "b": 16, "c": 10**9, "slow": 4}
    total = 16 + 16 + 4 * 16 + 4  # c's claim weighs 4 times the median of the others' (16)
    assert {p: m["weight"] for p, m in members.items()} == pytest.approx(
        {"a": 16 / total, "b": 16 / total, "c": 64 / total, "slow": 4 / total})
    assert (members["a"]["need_s"], members["slow"]["need_s"]) == (0.3, 1.1)
    assert {p: (m["micro_batches"], m["compute_s"]) for p, m in members.items()} == {  # as each announced it
        "a": (1, 0.25), "b": (1, 0.26), "c": (None, None), "slow": (0, 0.0)}
    view.frozen(1, list(announced), announced, "good")
    view.exchanged(1, contributors=["a", "b"], slice_owners=["a", "b"], aborted=False, bytes_up=1, bytes_down=1,
                   claims={"a": 32})  # b's part is not held here: the round's weights are not known
    members = {m["id"]: m for m in view.document()["members"]}
    assert (members["a"]["samples"], members["a"]["weight"]) == (16, pytest.approx(16 / total))
    assert members["slow"]["state"] == "missed"


def test_a_dht_peer_without_a_majority_says_so() -> None:
    view = DhtView("c", total_rounds=10, window_s=5.0)
    view.entered(4)
    view.minority(4, True)
    d = view.document()
    check_document(d, "dht")
    assert (d["run"]["round"], d["run"]["phase"]) == (4, "minority")
    view.minority(4, False)
    assert view.document()["run"]["phase"] == "exchanging"


def test_a_dht_peer_lists_disagreeing_slices_and_excluded_owners() -> None:
    view = DhtView("a", total_rounds=10, window_s=5.0)
    announced = {p: Announcement(p, 0.0, "good") for p in "abcm"}
    view.entered(6)
    view.frozen(6, list("abcm"), announced, "good")
    view.verified(6, disagreed=["b", "m"], excluded=[])
    view.exchanged(6, contributors=list("abcm"), slice_owners=list("abcm"), aborted=False, bytes_up=1, bytes_down=1)
    view.entered(7)
    view.frozen(7, list("abcm"), announced, "good")
    view.verified(7, disagreed=[], excluded=["b", "m"])
    view.exchanged(7, contributors=list("abcm"), slice_owners=list("ac"), aborted=False, bytes_up=1, bytes_down=1)
    d = view.document()
    check_document(d, "dht")
    assert [(r["peer"], r["round"], r["kind"]) for r in d["refusals"]] == [("b, m", 6, "disagreement")]
    states = {m["id"]: (m["state"], m["slices"]) for m in d["members"]}
    assert states == {"a": ("member", 1), "b": ("excluded", 0), "c": ("member", 1), "m": ("excluded", 0)}


def test_the_http_answers() -> None:
    routes = page_routes(lambda since: {"since": since})
    ok = _respond(routes, "GET /status.json?since=4 HTTP/1.1")
    head, body = ok.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 OK") and b"application/json" in head and json.loads(body) == {"since": 4}
    assert b"default-src 'none'" in head and b"Cache-Control: no-store" in head
    assert json.loads(_respond(routes, "GET /status.json?since=x HTTP/1.1").split(b"\r\n\r\n", 1)[1]) == {"since": None}
    page = _respond(routes, "GET / HTTP/1.1")
    assert b'src="dashboard.js"' in page and b"http" not in page.split(b"\r\n\r\n", 1)[1].replace(b"http-equiv", b"")
    assert _respond(routes, "HEAD / HTTP/1.1").endswith(b"\r\n\r\n")
    assert _respond(routes, "GET /nope HTTP/1.1").startswith(b"HTTP/1.1 404")
    assert _respond(routes, "POST / HTTP/1.1").startswith(b"HTTP/1.1 405")
    assert _respond(routes, "garbage").startswith(b"HTTP/1.1 400")
    script = _respond(routes, "GET /dashboard.js HTTP/1.1")
    assert b"innerHTML" not in script and b"https://" not in script  # text only; nothing from elsewhere


def test_status_prints_tables() -> None:
    view = DhtView("a", total_rounds=0, window_s=5.0)
    view.entered(0)
    view.frozen(0, ["a"], {"a": Announcement("a", 0.0, "d", loss=1.5)}, "d")
    view.exchanged(0, contributors=["a"], slice_owners=["a"], aborted=False, bytes_up=1500, bytes_down=2_500_000)
    view.record.refused("x", 3, "invalid", "bad payload")
    text = format_status(view.document())
    assert "DHT peer a: round 1, training" in text and "slices" in text
    assert "2.5 MB" in text and "invalid" in text and "bad payload" in text
    idle = status_document(Rounds(cfg=RoundConfig(), now=0.0), Metrics(), now=0.0, param_digest="", total_rounds=0)
    empty = format_status(idle)
    assert "members: none" in empty and "recent refusals: none" in empty


def test_the_docs_describe_every_field() -> None:
    text = DOCS.read_text()
    for fields in (dashboard_schema.RUN, dashboard_schema.ROUND, dashboard_schema.MEMBER, dashboard_schema.REFUSAL):
        missing = [f for f in fields if f"`{f}`" not in text]
        assert not missing, f"docs/dashboard.md does not describe {missing}"


def test_an_idle_member_shows_as_idle() -> None:
    rounds, metrics = Rounds(cfg=RoundConfig(round_timeout_s=10.0, max_idle_rounds=1), now=0.0), Metrics()
    rounds.join("a", 0.0)
    rounds.members["f"] = rounds.members["n"] = 0.0
    rounds.submit("a", 0, 1.0)
    rounds.submit("f", 0, 1.0)
    rounds.close(2.0)
    rounds.submit("a", 1, 3.0)
    rounds.close(10.0)  # "f" missed its one round: idle; "n" never had a payload in: new, not waited on
    d = status_document(rounds, metrics, now=11.0, param_digest="", total_rounds=0)
    check_document(d, "coordinator")
    assert d["run"]["members"] == 3 and d["run"]["idle"] == 1
    assert {m["id"]: m["state"] for m in d["members"]} == {"a": "member", "f": "idle", "n": "new"}
    assert "3 members (1 idle)" in format_status(d)


_NODE_HARNESS = """
const d = require(process.argv[1]);
class El {
  constructor(tag) { this.tag = tag; this.attrs = {}; this.children = []; this.textContent = ""; }
  setAttribute(k, v) { this.attrs[k] = v; }
  appendChild(c) { this.children.push(c); }
  removeChild(c) { this.children.splice(this.children.indexOf(c), 1); }
  get firstChild() { return this.children[0] || null; }
}
d.setSvgFactory((tag) => new El(tag));
const svg = new El("svg");
const cases = JSON.parse(process.argv[2]);
const out = {};
for (const [name, c] of Object.entries(cases.charts)) {
  d.chart(svg, c.series, c.opts);
  out[name] = {top: Number(svg.attrs["data-top"]), texts: svg.children.filter((e) => e.tag === "text")
    .map((e) => e.textContent)};
}
out.pace = cases.pace.map((c) => d.pace(c.rows, c.total, c.round));
console.log(JSON.stringify(out));
"""


def _in_node(cases: dict[str, Any]) -> dict[str, Any]:
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("no node on PATH: the page's functions are checked in node")
    script = Path(__file__).resolve().parents[2] / "demonet" / "dashboard" / "dashboard.js"
    proc = subprocess.run([node, "-e", _NODE_HARNESS, str(script), json.dumps(cases)], capture_output=True, text=True,
                          timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_the_byte_chart_is_not_flattened_by_the_parameter_download() -> None:
    # Round 0 carries every peer's parameter download (13.5 MB); the rounds after it move ~190 kB in, ~110 kB out.
    ins = [[r, 190_000 + 1000 * (r % 3)] for r in range(40)]
    outs = [[0, 13_500_000]] + [[r, 110_000] for r in range(1, 40)]
    series = [{"cls": "s0", "points": ins}, {"cls": "s1", "points": outs}]
    got = _in_node({"charts": {"bytes": {"series": series, "opts": {"zero": True, "outliers": True}},
                               "plain": {"series": series, "opts": {"zero": True}},
                               "first": {"series": [{"cls": "s1", "points": outs[:1]}],
                                         "opts": {"zero": True, "outliers": True}}},
                    "pace": []})
    assert got["bytes"]["top"] == pytest.approx(1.1 * 192_000)  # the largest round after the download, a tenth more
    assert "off the chart: round 0 13.5 MB" in got["bytes"]["texts"]
    assert got["plain"]["top"] == 13_500_000 and not any("off the chart" in t for t in got["plain"]["texts"])
    assert got["first"]["top"] == 13_500_000  # round 0 alone: it is the axis, on the chart
    assert not any("off the chart" in t for t in got["first"]["texts"])


def test_the_page_computes_rounds_per_second_and_the_time_left() -> None:
    rows = [{"round": r, "time": 1000.0 + 0.5 * r} for r in range(30)]  # 2 rounds a second
    got = _in_node({"charts": {}, "pace": [{"rows": rows, "total": 200, "round": 30},
                                           {"rows": rows, "total": 0, "round": 30},
                                           {"rows": rows[:1], "total": 200, "round": 1}]})
    assert got["pace"][0] == {"perSecond": 2.0, "secondsLeft": 85.0}
    assert got["pace"][1] == {"perSecond": 2.0, "secondsLeft": None}  # a run with no end
    assert got["pace"][2] == {"perSecond": None, "secondsLeft": None}  # one round: no pace yet


def test_the_progress_bar_of_up_shows_no_loss_before_a_round() -> None:
    from demonet.cli.up import bar_figures

    assert bar_figures(math.nan, 0) == {"peers": "joining"}  # it opened with `loss=nan, peers=0`
    assert bar_figures(math.nan, 3) == {"peers": "3"}
    assert bar_figures(4.12345, 4) == {"loss": "4.123", "peers": "4"}


def test_status_gives_the_pace_and_calls_the_deadline_a_deadline() -> None:
    # "29.9 s left" read as the run's time left while rounds took 0.5 s: it is the open round's deadline.
    rounds = Rounds(cfg=RoundConfig(), now=0.0)
    metrics = Metrics()
    for r in range(30):
        metrics.record.round_closed(r, members=["a"], contributors=["a"], aborted=False, loss=1.0, round_s=0.5,
                                    close_s=0.01, bytes_up=1, bytes_down=1)
    doc = status_document(rounds, metrics, now=0.0, param_digest="", total_rounds=200)
    doc["run"].update(round=30, seconds_left=29.9)
    for i, row in enumerate(doc["rounds"]):
        row["time"] = 1000.0 + 0.5 * i  # 2 rounds a second
    head = format_status(doc).splitlines()[0]
    assert "round deadline in 29.9 s, 2.00 rounds/s, about 85 s left;" in head, head
    doc["run"]["total_rounds"] = 0
    assert ", 2.00 rounds/s;" in format_status(doc).splitlines()[0]
    doc["rounds"] = doc["rounds"][:1]
    assert "rounds/s" not in format_status(doc)
