"""DHT mode with real processes: hivemind DHT nodes and libp2p streams on loopback, no coordinator.

- `demonet up --dht`: three peer processes train a run whose digests agree every round, and write
  the same run folder as coordinator mode; peer-0's dashboard shows its view of the run meanwhile.
- Faults in one run (starting hivemind processes is what costs here): a peer SIGKILLed (with its
  p2pd daemon) while the others carry on; a late joiner in client mode (as behind NAT)
  that loads the parameters from several donors and is in sync from its first round; a peer with a
  wrong run token kept out.
- In one process: the records and the stream messages of a wrong-token node are refused.

Every peer runs in its own session, and the `reap_children` fixture kills each session's process group
(the peer and its p2pd) by id at the end, also when the test fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.dashboard_schema import check_document
from tests.integration.common import run_coroutine, tiny_config
from tests.procs import Reaper

pytest.importorskip("hivemind")
pytestmark = pytest.mark.slow

TOKEN = "dht-test-token"
WAIT_S = 90.0
"""Bound of every wait in these tests (starting a peer, torch and a p2pd daemon, takes seconds on a busy CPU)."""
GATE = """
import sys
from demonet.cli import main
from demonet.loop.lifecycle import warm_up as _warm_up
import demonet.dht.gatherer
_warm_up()
print("gate: ready", flush=True)
sys.stdin.readline()
raise SystemExit(main(sys.argv[1:]))
"""


async def gatherers_on_loopback(run: str, names: list[str], specs: dict[str, Any], **opts: Any
                                ) -> tuple[dict[str, Any], dict[str, str]]:
    """`DhtGatherer`s for `names` on loopback, the first the others' initial peer, each with a key of its own
    that every other one has pinned; returns them and their stream addresses (close them when done)."""
    from demonet.dht.gatherer import DhtGatherer, DhtOptions
    from demonet.wire.identity import Identity

    def options(initial: tuple[str, ...] = ()) -> DhtOptions:
        return DhtOptions(run=run, token=TOKEN, initial_peers=initial, host_maddrs=("/ip4/127.0.0.1/tcp/0",), **opts)

    ids = {p: Identity.generate() for p in names}
    first = names[0]
    nodes = {first: await DhtGatherer.create(options(), first, specs, identity=ids[first])}
    for p in names[1:]:
        nodes[p] = await DhtGatherer.create(options((nodes[first].visible_maddrs()[0],)), p, specs, identity=ids[p])
    for p in names:
        for q in names:
            if q != p:
                assert nodes[p]._node.book.choose(q, [ids[q].public]) == ids[q].public
    return nodes, {p: nodes[p]._node.address for p in names}


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class _Peers:
    """The peer processes of one test, each in its own session (so its p2pd dies with it)."""

    def __init__(self, tmp: Path, reaper: Reaper, *, steps: int, start_peers: int, overlap: int = 0,
                 round_timeout_s: float = 3.0, **net: float) -> None:
        self.tmp, self.out, self.reaper = tmp, tmp / "out", reaper
        (tmp / "run.toml").write_text(tiny_config(round_timeout_s=round_timeout_s, overlap=overlap, **net))
        self.base = ["peer", "--dht", "--run", "faults", "--host-maddr", "/ip4/127.0.0.1/tcp/0", "--config",
                     str(tmp / "run.toml"), "--steps", str(steps), "--start-peers", str(start_peers),
                     "--exchange-timeout-s", "2", "--out", str(self.out), "--threads", "1"]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.maddr = ""

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, name: str, *extra: str, token: str = TOKEN, gated: bool = False,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        argv = [*self.base, "--peer-id", name, *extra]
        if self.maddr:
            argv += ["--initial-peers", self.maddr]
        log = self.reaper.open(self.tmp / f"{name}.log", "ab")
        cmd = [sys.executable, "-c", GATE, *argv] if gated else [sys.executable, "-m", "demonet", *argv]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if gated else subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "DEMONET_TOKEN": token, **(env or {})},
                                start_new_session=True)
        self.procs[name] = self.reaper.add(proc, group=True)
        return proc

    def bootstrap(self, name: str, *extra: str, env: dict[str, str] | None = None) -> None:
        """Start the first peer and take its multiaddr for the others' --initial-peers."""
        self.start(name, *extra, env=env)
        wait_for(lambda: "dht listening on " in self.log(name), f"{name}'s DHT node", self)
        line = next(ln for ln in self.log(name).splitlines() if ln.startswith("dht listening on "))
        self.maddr = line.removeprefix("dht listening on ").strip()

    def release(self, name: str) -> None:
        wait_for(lambda: "gate: ready" in self.log(name), f"{name} to warm up", self)
        stdin = self.procs[name].stdin
        assert stdin is not None
        stdin.write(b"go\n")
        stdin.close()

    def kill(self, name: str) -> None:
        """SIGKILL the peer's whole session: the peer and its p2pd, as a machine dies."""
        self.reaper.kill(self.procs[name])

    def stop(self, names: list[str]) -> None:
        """SIGTERM (a graceful stop at the round boundary), then SIGKILL whatever is left after 30 s."""
        self.reaper.stop([self.procs[name] for name in names], 30.0)

    def rows(self, name: str) -> list[dict[str, Any]]:
        return _rows(self.out / f"metrics-{name}.jsonl")

    def dump(self) -> str:
        return "\n".join(f"--- {name}\n{self.log(name)[-3000:]}" for name in self.procs)


def wait_for(ok: Callable[[], bool], what: str, peers: _Peers, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n{peers.dump()}")


def _socket_folders(proc: subprocess.Popen[bytes]) -> list[Path]:
    """The folders that hold the p2pd sockets of a peer and of its children (`demonet.dht.sockets`)."""
    from demonet.dht.sockets import SOCKETS_ROOT

    pids = [proc.pid, *(child.pid for child in psutil.Process(proc.pid).children(recursive=True))]
    return [folder for pid in pids for folder in Path(SOCKETS_ROOT).glob(f"demonet-p2p-{pid}-*")]


def _digests_by_round(rows: list[dict[str, Any]]) -> dict[int, set[str]]:
    by_round: dict[int, set[str]] = {}
    for r in rows:
        by_round.setdefault(int(r["round"]), set()).add(r["param_digest"])
    return by_round


def _dashboard_of_peer_0(proc: subprocess.Popen[bytes], stderr: Path) -> dict[str, Any]:
    """peer-0's /status.json once it has seen two rounds of all three peers (while the run goes on)."""
    deadline = time.monotonic() + 2 * WAIT_S
    url, doc = "", {}
    while time.monotonic() < deadline and proc.poll() is None:
        url = url or next((ln.removeprefix("dashboard: ") for ln in stderr.read_text().splitlines()
                           if ln.startswith("dashboard: ")), "")
        if url:
            try:
                with urllib.request.urlopen(url + "status.json", timeout=10) as reply:
                    doc = json.loads(reply.read())
            except urllib.error.URLError:  # peer-0 stopped (the run failed): the message below says why
                time.sleep(0.5)
                continue
            if doc["run"]["rounds_closed"] >= 2 and len(doc["members"]) == 3:
                return doc
        time.sleep(0.1)
    raise AssertionError(f"no dashboard with two rounds of three peers (last: {doc}); {stderr.read_text()[-2000:]}")


def test_up_dht_run_folder(tmp_path: Path, reap_children: Reaper) -> None:
    """`demonet up --dht`: three peers, every round with three contributors and one digest; peer-0 serves
    its view of the run on the dashboard that `demonet up` announces, in the coordinator's document."""
    (tmp_path / "run.toml").write_text(tiny_config(round_timeout_s=5.0))
    out, steps = tmp_path / "run", 60  # rounds of tens of milliseconds: long enough for the dashboard's reads
    proc = reap_children.add(subprocess.Popen(
        [sys.executable, "-m", "demonet", "up", "--dht", "--peers", "3", "--steps", str(steps), "--out", str(out),
         "--config", str(tmp_path / "run.toml"), "--no-progress"], stdout=subprocess.DEVNULL,
        stderr=reap_children.open(tmp_path / "up.err"), start_new_session=True), group=True)
    doc = _dashboard_of_peer_0(proc, tmp_path / "up.err")
    check_document(doc, "dht")
    members = {m["id"]: m for m in doc["members"]}
    assert doc["source"] == "peer-0" and set(members) == {"peer-0", "peer-1", "peer-2"}, doc
    assert sum(m["slices"] for m in members.values()) >= 1 and members["peer-0"]["bytes_up"] > 0, members
    assert all(m["last_loss"] is not None and m["contributed"] >= 1 for m in members.values()), members
    assert proc.wait(timeout=240) == 0, (tmp_path / "up.err").read_text()[-3000:] + "\n".join(
        p.read_text(errors="replace")[-2000:] for p in sorted((out / "logs").glob("*.log")))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["digests_agree"] and summary["rounds"] == steps and summary["peers"] == 3, summary
    rows = _rows(out / "metrics.jsonl")
    assert len(rows) == 3 * steps and all(r["contributors"] == 3 for r in rows), rows
    assert all(r["resyncs"] == 0 for r in rows), rows  # DHT peers count resyncs in their rows too
    assert all(r["bytes_down"] > 0 and r["bytes_up"] > 0 for r in rows)
    # Where the time went; a verified slice each round (the default fraction, 3 slices), and honest
    # mergers always agree.
    assert all({"announce", "freeze", "scatter", "gather", "dht_reads"} <= set(r["phases"]) for r in rows), rows[0]
    assert all(r["phases"]["verified"] >= 1 for r in rows), rows
    # The first round searches the DHT for its start_peers; later ones decide from the announcements
    # stored on the peer's own node, with no search once all of the round's members are there.
    assert all(r["phases"]["dht_reads"] >= 1 for r in rows if r["round"] == 0), rows
    later = [r["phases"]["dht_reads"] for r in rows if r["round"] > 0]
    assert sum(n == 0 for n in later) >= 0.9 * len(later), later
    logs = "".join(p.read_text(errors="replace") for p in (out / "logs").glob("*.log"))
    assert "disagree" not in logs and "own no slice" not in logs
    assert (out / "loss.png").stat().st_size > 0


def test_kill_late_joiner_and_wrong_token(tmp_path: Path, reap_children: Reaper) -> None:
    """A peer SIGKILLed mid-run, a late joiner loaded from several donors, a wrong-token peer: one run."""
    peers = _Peers(tmp_path, reap_children, steps=1000, start_peers=3)
    peers.bootstrap("a")
    peers.start("b")
    peers.start("c")
    peers.start("j", "--client-mode", gated=True)  # as behind NAT: dials out only
    # A peer with another token: refused by the first peer it contacts, it never enters a round.
    bad = peers.start("x", token="not-the-run-token")
    wait_for(lambda: len(peers.rows("c")) >= 3, "three rounds with c", peers)
    # A peer keeps its p2pd sockets (the daemon's, and its own client's) in a folder of its own; c's, killed
    # with it, is removed by the next DHT node to start on the machine (j's), and the others' at their stop.
    killed_sockets = _socket_folders(peers.procs["c"])
    assert len(killed_sockets) == 1 and len(list(killed_sockets[0].glob("hivemind-p2p*.sock"))) == 2, [
        list(f.iterdir()) for f in killed_sockets]
    peers.kill("c")
    killed_at = len(peers.rows("a"))
    # The others carry on without c: rounds with two contributors, one digest.
    wait_for(lambda: len(peers.rows("a")) >= killed_at + 4, "rounds after the kill", peers)
    after = [r for r in peers.rows("a")[killed_at:] if r["contributors"] == 2]
    assert after, peers.rows("a")

    wait_for(lambda: bad.poll() is not None, "the wrong-token peer to exit", peers)
    assert bad.returncode == 2, peers.log("x")
    assert "wrong run token" in peers.log("x")
    assert "bad run token" in peers.log("a")

    peers.release("j")
    wait_for(lambda: len(peers.rows("j")) >= 3, "three rounds of the late joiner", peers)
    assert not any(folder.exists() for folder in killed_sockets), killed_sockets
    sockets = [folder for name in ("a", "b", "j") for folder in _socket_folders(peers.procs[name])]
    assert len(sockets) == 3, sockets  # one folder for each peer
    # The peers stop one after the other, each after its open round: those left go on without the ones that left.
    before_stop = len(peers.rows("a"))
    peers.stop(["a", "b", "j"])
    assert peers.procs["a"].returncode == 0 and peers.procs["b"].returncode == 0, peers.dump()
    assert not any(folder.exists() for folder in sockets), sockets

    assert "loaded from 2 donors" in peers.log("j"), peers.log("j")
    rows = {name: peers.rows(name) for name in ("a", "b", "j")}
    digests = _digests_by_round([r for rs in rows.values() for r in rs])
    assert all(len(d) == 1 for d in digests.values()), {k: v for k, v in digests.items() if len(v) > 1}
    first = rows["j"][0]
    assert first["param_digest"] in digests[first["round"]] and len(digests[first["round"]]) == 1
    assert not first.get("resynced"), first
    assert max(r["contributors"] for r in rows["a"][before_stop - 3:before_stop]) == 3, rows["a"]  # j contributes
    assert all(r["contributors"] <= 3 for rs in rows.values() for r in rs)  # x never does


def test_peers_that_stop_gracefully_leave_and_the_last_one_goes_on_alone(tmp_path: Path, reap_children: Reaper) -> None:
    """Three peers; c is stopped (SIGTERM), then b (SIGINT to its process group, as a Ctrl-C): each says it
    leaves (its record among the next round's announcements), so no round waits for it until the round's
    deadline, and each leaves the majority's base at once: a, the last member, goes on alone to the run's
    end (a silent member would hold it `leave_after_s`, 600 s: 1 of a base of 2 is no majority)."""
    steps = 150
    peers = _Peers(tmp_path, reap_children, steps=steps, start_peers=3)
    peers.bootstrap("a")
    peers.start("b")
    peers.start("c")
    wait_for(lambda: len(peers.rows("c")) >= 3, "three rounds with c", peers)
    peers.stop(["c"])
    assert peers.procs["c"].returncode == 0 and "left the run" in peers.log("c"), peers.log("c")[-3000:]
    stopped = len(peers.rows("a"))
    wait_for(lambda: any(r["contributors"] == 2 for r in peers.rows("a")[stopped:]), "rounds of a and b", peers)
    # b is stopped as a Ctrl-C at its terminal stops it: SIGINT to its whole process group. Its p2pd daemon
    # runs in a session of its own, out of the signal's reach, so it serves b's open round and leave to the end.
    daemons = [k for k in psutil.Process(peers.procs["b"].pid).children() if k.name() == "p2pd"]
    assert len(daemons) == 1 and os.getpgid(daemons[0].pid) != peers.procs["b"].pid, daemons
    os.killpg(peers.procs["b"].pid, signal.SIGINT)
    peers.procs["b"].wait(timeout=WAIT_S)
    log_b = peers.log("b")
    assert peers.procs["b"].returncode == 0 and "left the run" in log_b, log_b[-3000:]
    assert "abandoned the round" not in log_b, log_b[-3000:]
    wait_for(lambda: peers.procs["a"].poll() is not None, "a to end the run alone", peers)
    assert peers.procs["a"].returncode == 0, peers.log("a")[-3000:]
    rows = peers.rows("a")
    assert [r["round"] for r in rows] == list(range(steps)), [r["round"] for r in rows]
    assert [r["contributors"] for r in rows[-3:]] == [1, 1, 1]
    # No round waited for a peer that had left: the window (round_timeout_s) is 3 s.
    assert max(r["round_time_s"] for r in rows[3:]) < 3.0, [round(r["round_time_s"], 2) for r in rows]
    assert "no majority" not in peers.log("a"), peers.log("a")[-3000:]
    digests = _digests_by_round([r for name in ("a", "b", "c") for r in peers.rows(name)])
    assert all(len(d) == 1 for d in digests.values()), {k: v for k, v in digests.items() if len(v) > 1}


def test_overlapped_dht_peers_agree_and_serve_a_late_joiner_the_round_parameters(
        tmp_path: Path, reap_children: Reaper) -> None:
    """DHT mode with `overlap = 1`: every round on one digest, and a joiner loads a round's parameters from
    donors that hold a lookahead meanwhile (they serve the parameters the round started from)."""
    peers = _Peers(tmp_path, reap_children, steps=1000, start_peers=2, overlap=1)
    peers.bootstrap("a")
    peers.start("b")
    peers.start("j", gated=True)
    wait_for(lambda: min(len(peers.rows("a")), len(peers.rows("b"))) >= 4, "four overlapped rounds", peers)
    peers.release("j")
    wait_for(lambda: len(peers.rows("j")) >= 3, "three rounds of the late joiner", peers)
    before_stop = len(peers.rows("a"))  # then the peers leave one after the other
    peers.stop(["a", "b", "j"])
    assert all(peers.procs[n].returncode == 0 for n in ("a", "b", "j")), peers.dump()

    assert "loaded from 2 donors" in peers.log("j"), peers.log("j")
    rows = [r for name in ("a", "b", "j") for r in peers.rows(name)]
    assert all(r["overlap"] == 1 for r in rows), rows
    digests = _digests_by_round(rows)  # no coordinator: the peers' digests after each apply are one
    assert all(len(d) == 1 for d in digests.values()), {k: v for k, v in digests.items() if len(v) > 1}
    assert all(not r.get("resynced") for r in rows), [r for r in rows if r.get("resynced")]
    assert max(r["contributors"] for r in peers.rows("a")[before_stop - 2:before_stop]) == 3, peers.rows("a")  # j in


async def _wrong_token_nodes() -> None:
    """Two nodes with the run token and one without, over loopback (run by the test in a fresh process)."""
    from dataclasses import replace

    from demonet._proto import demonet_pb2 as pb
    from demonet.dht.gatherer import DhtGatherer, DhtOptions
    from demonet.dht.streams import Reply

    def opts(token: str, initial: tuple[str, ...] = ()) -> DhtOptions:
        return DhtOptions(run="auth", token=token, initial_peers=initial, host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                          exchange_timeout_s=5.0)

    nodes: list[DhtGatherer] = []
    try:
        good = await DhtGatherer.create(opts(TOKEN), "good", {})
        nodes.append(good)
        maddr = good.visible_maddrs()[0]
        other = await DhtGatherer.create(opts(TOKEN, (maddr,)), "other", {})
        nodes.append(other)
        bad = await DhtGatherer.create(opts("wrong", (maddr,)), "bad", {})
        nodes.append(bad)
        assert await other.check_initial_peers() == 1
        with pytest.raises(PermissionError, match="wrong run token"):
            await bad.check_initial_peers()
        assert good.refused == 1
        # An initial peer whose first ping answers too late (a loaded machine): pinged again, not skipped.
        stalls = [3.0]

        async def slow_ping(head: Any, data: bytes | None) -> Any:
            await asyncio.sleep(stalls.pop() if stalls else 0.0)
            return Reply()

        good._node.streams.serve(pb.DHT_KIND_PING, slow_ping)
        late = await DhtGatherer.create(replace(opts(TOKEN, (maddr,)), exchange_timeout_s=1.0), "late", {})
        nodes.append(late)
        assert await late.check_initial_peers() == 1 and not stalls
        for node, round, digest in ((good, 3, "d" * 32), (bad, 7, "e" * 32)):  # the records an announcement carries
            await node._node.store_many(node._board.state_records(round, digest))
        assert await other.head_round() == 3  # the wrong-token record is not read
        assert await bad.head_round() == 7  # it sees only its own record, not the run's
    finally:
        for node in reversed(nodes):
            await asyncio.wait_for(node.close(), 30)


def test_wrong_token_records_and_messages_refused(reap_children: Reaper) -> None:
    """In a fresh interpreter, as the other tests of DHT nodes: nothing of the tests before it (the
    in-process coordinator tests' gRPC threads, hivemind's state) carries over."""
    run_coroutine(__name__, "_wrong_token_nodes", reap_children, WAIT_S)


def _descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stopped_peer_leaves_no_daemon_behind(tmp_path: Path, sig: int, reap_children: Reaper) -> None:
    """The peer's p2pd daemon (and the watcher that ends it) end with the peer: stopped (SIGTERM) or killed
    (SIGKILL). Its DHT node runs in the peer's own process."""
    (tmp_path / "tiny.toml").write_text(tiny_config(round_timeout_s=5.0))
    log = reap_children.open(tmp_path / "peer.log", "w")
    # Not in a session of its own: nothing but the peer itself is signalled (also by the reaper).
    proc = reap_children.add(subprocess.Popen(
        [sys.executable, "-m", "demonet", "peer", "--dht", "--run", "alone",
         "--config", str(tmp_path / "tiny.toml"), "--host-maddr", "/ip4/127.0.0.1/tcp/0",
         "--start-peers", "2", "--steps", "5", "--out", str(tmp_path / "out")],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, "DEMONET_TOKEN": TOKEN}))
    left: list[int] = []
    try:
        deadline = time.monotonic() + WAIT_S
        while "starting the run" not in (tmp_path / "peer.log").read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "peer.log").read_text()
            time.sleep(0.2)
        kids = _descendants(proc.pid)
        names = sorted(Path(f"/proc/{k}/comm").read_text().strip() for k in kids)
        assert names == ["p2pd", "sh"], names  # the daemon and its watcher; no DHT process
        folders = _socket_folders(proc)
        assert [f.name.startswith(f"demonet-p2p-{proc.pid}-") for f in folders] == [True], folders
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=WAIT_S)
        assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        deadline = time.monotonic() + 20
        while (left := [k for k in kids if Path(f"/proc/{k}").exists() and
                        Path(f"/proc/{k}/stat").read_text().split()[2] != "Z"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == [], [Path(f"/proc/{k}/cmdline").read_bytes()[:80] for k in left]
        # A stopped peer removes its sockets as it ends; a killed peer's stay until the next DHT node on the
        # machine sweeps them.
        assert folders[0].exists() == (sig == signal.SIGKILL)
        assert "Traceback" not in (tmp_path / "peer.log").read_text()  # nothing it removed was still wanted
        from demonet.dht.sockets import sweep_sockets
        deadline = time.monotonic() + 10  # a daemon that just ended may hold its listening socket a moment longer
        while sweep_sockets() == [] and folders[0].exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not folders[0].exists()
    finally:
        for pid in left:  # what the peer left behind, which the reaper does not know of
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
