"""The dashboard on real runs: `demonet up` prints its address; its /status.json on a live coordinator with
real peer processes has every field, typed; `demonet status` reads it over gRPC and HTTP; headless
Chromium draws the page; the ports go where the flags say. (A DHT peer's dashboard: test_dht.py.)"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from demonet import cli
from demonet.config import load_config
from demonet.coordinator import CoordinatorOptions, HttpPorts, serve
from tests.dashboard_schema import check_document
from tests.integration.common import tiny_config
from tests.procs import Reaper, free_port

pytestmark = pytest.mark.slow

PEERS = ("peer-0", "peer-1", "peer-2")
START_TIMEOUT_S = 120.0  # imports and warm-up of 4 processes on a shared 2-core machine


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as reply:
        body: bytes = reply.read()
    return body


def _doc(url: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(_get(url + "status.json"))
    return doc


def _until(what: str, check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@dataclass
class Up:
    proc: subprocess.Popen[bytes]
    stderr: Path
    url: str
    out: Path

    def line(self, prefix: str) -> str:
        return next((ln for ln in self.stderr.read_text().splitlines() if ln.startswith(prefix)), "")


def _up(tmp: Path, reaper: Reaper, peers: int) -> Up:
    """`demonet up` of the tiny model for as many rounds as the tests need, in a process group of its own."""
    (tmp / "tiny.toml").write_text(tiny_config(round_timeout_s=5.0))
    stderr = tmp / "up.err"
    proc = reaper.add(subprocess.Popen(
        [sys.executable, "-m", "demonet", "up", "--peers", str(peers), "--steps", "100000", "--out", str(tmp / "run"),
         "--config", str(tmp / "tiny.toml"), "--no-progress"],
        stdout=reaper.open(tmp / "up.out"), stderr=reaper.open(stderr), start_new_session=True), group=True)
    up = Up(proc, stderr, "", tmp / "run")

    def announced() -> str:
        assert proc.poll() is None, stderr.read_text()[-3000:]
        return up.line("dashboard: ")

    up.url = _until("the dashboard's address", announced, START_TIMEOUT_S).removeprefix("dashboard: ").strip()
    return up


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    reaper = Reaper()
    try:
        yield _up(tmp_path_factory.mktemp("up"), reaper, peers=len(PEERS))
    finally:
        reaper.close()  # SIGKILL to its process group: `demonet up`, its coordinator and its peers


def _coordinator(up: Up) -> tuple[str, str]:
    """The coordinator's gRPC address (from `demonet up`'s log) and the run token (from its environment)."""
    address = re.search(r"coordinator listening on (\S+);", up.stderr.read_text())
    assert address, up.stderr.read_text()
    child = next(c for c in psutil.Process(up.proc.pid).children() if "coordinator" in c.cmdline())
    return address.group(1), child.environ()["DEMONET_TOKEN"]


def _live(up: Up) -> dict[str, Any]:
    """The document once every peer has contributed to a few rounds and has a measured link."""
    def ready() -> dict[str, Any] | None:
        doc = _doc(up.url)
        members = {m["id"]: m for m in doc["members"]}
        done = set(members) == set(PEERS) and all(m["contributed"] >= 3 and m["link_bps"] for m in members.values())
        return doc if done else None
    doc: dict[str, Any] = _until("three rounds of every peer", ready)
    return doc


def test_up_prints_the_dashboard_address(cluster: Up) -> None:
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", cluster.url), cluster.url
    assert cluster.line("dashboard: ") == f"dashboard: {cluster.url}"
    assert b'<script src="dashboard.js"' in _get(cluster.url)


def test_status_json_of_a_live_coordinator_with_real_peers(cluster: Up) -> None:
    doc = _live(cluster)
    check_document(doc, "coordinator")
    run = doc["run"]
    assert run["rounds_closed"] >= 3 and run["phase"] in ("open", "closing") and run["total_rounds"] == 100000
    assert run["members"] == len(PEERS) and run["bytes_up"] > 0 and run["bytes_down"] > 0
    assert run["last_loss"] is not None and len(run["param_digest"]) == 32
    full = [r for r in doc["rounds"] if r["contributors"] == len(PEERS)]
    assert full and all(r["loss"] > 0 and r["round_s"] >= r["close_s"] > 0 and r["bytes_up"] > 0 for r in full)
    for m in doc["members"]:
        assert m["state"] in ("member", "submitted") and m["last_seen_s"] < 30
        assert m["bytes_up"] > 0 and m["bytes_down"] > 0 and m["link_bps"] > 0 and m["last_loss"] > 0
    newest = doc["rounds"][-1]["round"]
    since = json.loads(_get(f"{cluster.url}status.json?since={newest}"))
    assert all(r["round"] > newest for r in since["rounds"])


def test_the_dashboard_shows_no_secret(cluster: Up) -> None:
    _, token = _coordinator(cluster)
    for path in ("", "status.json", "dashboard.js", "dashboard.css", "metrics"):
        body = _get(cluster.url + path)
        assert token.encode() not in body and b"PRIVATE KEY" not in body, path
    assert b"demonet_rounds_closed_total" in _get(cluster.url + "metrics")


def test_demonet_status_over_grpc_and_http(cluster: Up, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    address, token = _coordinator(cluster)

    def status(*args: str) -> tuple[int, str, str]:
        code = cli.main(["status", *args])
        out, err = capsys.readouterr()
        return code, out, err

    monkeypatch.setenv("DEMONET_TOKEN", token)
    code, table, _ = status("--coordinator", address)
    assert code == 0 and table.startswith("coordinator: round ") and all(p in table for p in PEERS), table
    check_document(json.loads(status("--coordinator", address, "--json")[1]), "coordinator")
    check_document(json.loads(status("--dashboard", cluster.url, "--json")[1]), "coordinator")
    monkeypatch.setenv("DEMONET_TOKEN", "not-the-run-token")
    code, _, err = status("--coordinator", address)
    assert code == 1 and "token" in err
    refusals = _until("the refusal", lambda: [r for r in _doc(cluster.url)["refusals"] if r["kind"] == "unauthorized"])
    assert refusals[-1]["reason"] == "missing or wrong run token" and "not-the-run-token" not in json.dumps(refusals)


def test_the_page_in_headless_chromium(cluster: Up, tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on PATH: `apt-get install chromium` (.ci/run installs it where apt-get works)")
    _live(cluster)
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000"]
    dom = subprocess.run([*flags, "--dump-dom", cluster.url], capture_output=True, text=True, timeout=90)
    assert dom.returncode == 0, dom.stderr[-2000:]
    rows = re.findall(r'<tr[^>]*data-peer="([^"]+)"', dom.stdout)
    assert sorted(rows) == list(PEERS), dom.stdout[-3000:]
    points = re.search(r'<svg id="loss-chart"[^>]*data-points="(\d+)"', dom.stdout)
    assert points and int(points.group(1)) >= 3, dom.stdout[-3000:]
    assert "cannot read status.json" not in dom.stdout
    shot = tmp_path / "dashboard.png"
    subprocess.run([*flags, "--window-size=1400,1100", f"--screenshot={shot}", cluster.url], capture_output=True,
                   timeout=90, check=True)
    assert shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 10_000


async def test_the_ports_go_where_the_flags_say(tmp_path: Path) -> None:
    """--metrics-port alone: /metrics and the dashboard there; with --dashboard-port: the dashboard apart,
    on the gRPC interface; --no-dashboard: /metrics only."""
    (tmp_path / "run.toml").write_text(tiny_config(round_timeout_s=5.0, steps=3))
    cfg = load_config(tmp_path / "run.toml", {})

    async def fetch(url: str) -> bytes:
        return await asyncio.to_thread(_get, url)

    for ports in (HttpPorts(metrics=free_port()), HttpPorts(metrics=free_port(), dashboard=0),
                  HttpPorts(metrics=free_port(), dashboard_on=False)):
        urls: list[str] = []
        listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(cfg, CoordinatorOptions(token="t", total_rounds=3), listen="127.0.0.1:0",
                                         http=ports, on_listening=listening.set_result, on_dashboard=urls.append))
        try:
            await asyncio.wait_for(listening, 30)
            metrics = f"http://127.0.0.1:{ports.metrics}/"
            assert b"demonet_round " in await fetch(metrics + "metrics")
            if not ports.dashboard_on:
                assert urls == [] and not (await fetch(metrics + "status.json")).startswith(b"{")
                continue
            (url,) = urls
            if ports.dashboard is None:
                assert url == f"http://localhost:{ports.metrics}/"
            else:
                assert url.startswith("http://127.0.0.1:") and url != metrics
                assert not (await fetch(metrics + "status.json")).startswith(b"{")  # prometheus_client's page
            check_document(json.loads(await fetch(url.replace("localhost", "127.0.0.1") + "status.json")),
                           "coordinator")
            with pytest.raises(urllib.error.HTTPError, match="404"):
                await fetch(url.replace("localhost", "127.0.0.1") + "nothing-here")
        finally:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
