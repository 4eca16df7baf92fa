"""Faults with real processes over real sockets on loopback: a peer killed with SIGKILL and restarted,
a peer stopped with SIGTERM (it leaves: no round waits for it), a late joiner, and the coordinator killed
with SIGKILL and restarted on its port from its state. Each
runs with plain rounds and with overlapped ones (`[net] overlap = 1`): a peer killed mid-pipeline, a
joiner entering it and a coordinator restart under it must end the same way.

Every test starts a `demonet coordinator` process and `demonet peer` processes on a tiny model
(rounds take about 0.1 s), bounds every wait, and kills every process it started (by pid) at the
end, also when it fails. The assertions are about progress, digests and losses, not timings.

A peer process spends seconds importing torch, while the tiny rounds take a tenth of a second. So a
peer that must enter the run at a chosen moment (the late joiner, the restart of the killed peer) is
started early and held at a gate: it imports demonet and warms torch up, says "gate: ready" in its
log, and runs `demonet peer` (demonet.cli.main) only once the test writes a line to its stdin.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import grpc
import pytest

from demonet._proto import demonet_pb2 as pb
from demonet._proto import demonet_pb2_grpc as pbg
from demonet.loop.runfolder import final_rows
from demonet.wire.identity import Identity
from demonet.wire.signed import leave_request
from tests.integration.common import GATE, listening_line, metrics_rows, rows_by_round, tiny_config
from tests.procs import Reaper, free_port

pytestmark = pytest.mark.slow

TOKEN = "faults-test-token"
ROUND_TIMEOUT_S = 2.0
LISTEN_TIMEOUT_S = 60.0
WAIT_S = 60.0
"""Bound of every wait for progress in the run (the whole run takes seconds)."""


class _Run:
    """The processes of one test: coordinators and peers, each logging into tmp; `reaper` kills them."""

    def __init__(self, tmp: Path, steps: int, start_peers: int, reaper: Reaper, overlap: int, **net: float) -> None:
        self.tmp, self.steps, self.start_peers, self.reaper, self.overlap = tmp, steps, start_peers, reaper, overlap
        self.out = tmp / "out"
        net = {"round_timeout_s": ROUND_TIMEOUT_S, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 4.0, **net}
        (tmp / "run.toml").write_text(tiny_config(overlap=overlap, **net))
        self.env = {**os.environ, "DEMONET_TOKEN": TOKEN}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.names: dict[int, str] = {}  # pid -> log name
        self.coordinators = 0
        self.address = ""

    def _log(self, name: str) -> IO[bytes]:
        return self.reaper.open(self.tmp / f"{name}.log", "ab")

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def coordinator(self, listen: str = "127.0.0.1:0") -> subprocess.Popen[bytes]:
        """Start a coordinator (log coordinator-<n>.log) and wait for its `listening on` line."""
        self.coordinators += 1
        name = f"coordinator-{self.coordinators}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "demonet.coordinator", "--listen", listen, "--config", str(self.tmp / "run.toml"),
             "--steps", str(self.steps), "--start-peers", str(self.start_peers),
             "--state-dir", str(self.tmp / "state")],
            stdout=subprocess.PIPE, stderr=self._log(name), stdin=subprocess.DEVNULL, env=self.env)
        self.procs.append(self.reaper.add(proc))
        line = listening_line(proc, LISTEN_TIMEOUT_S)
        assert line.startswith("listening on "), self.log(name)
        self.address = line.split()[-1]
        return proc

    def peer(self, peer_id: str, *extra: str, gated: bool = False) -> subprocess.Popen[bytes]:
        """Start `demonet peer` (log <peer_id>[-<n>].log); a gated one waits for `release`."""
        argv = ["peer", "--coordinator", self.address, "--peer-id", peer_id, "--out", str(self.out),
                "--threads", "1", "--reconnect-timeout-s", "60", *extra]
        name = peer_id if not (self.tmp / f"{peer_id}.log").exists() else f"{peer_id}-{len(self.procs)}"
        cmd = [sys.executable, "-c", GATE, *argv] if gated else [sys.executable, "-m", "demonet", *argv]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if gated else subprocess.DEVNULL,
                                stdout=self._log(name), stderr=subprocess.STDOUT, env=self.env)
        self.names[proc.pid] = name
        self.procs.append(self.reaper.add(proc))
        return proc

    def peer_log(self, proc: subprocess.Popen[bytes]) -> str:
        return self.log(self.names[proc.pid])

    def release(self, proc: subprocess.Popen[bytes]) -> None:
        """Let a gated peer run `demonet peer`, once it is ready."""
        wait_for(lambda: "gate: ready" in self.peer_log(proc), WAIT_S, f"{self.names[proc.pid]} to warm up", self)
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.close()

    def stop(self, proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after timeout_s (the coordinator lingers after the last round)."""
        self.reaper.stop([proc], timeout_s)

    def logs(self) -> str:
        """Every log's tail, for failure messages."""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.tmp.glob("*.log")))

    def rows(self, peer_id: str) -> list[dict[str, Any]]:
        return metrics_rows(self.out, peer_id)

    def last_round(self, peer_id: str) -> int:
        rows = self.rows(peer_id)
        return int(rows[-1]["round"]) if rows else -1

    def wait_exit(self, procs: list[subprocess.Popen[bytes]], timeout_s: float = WAIT_S) -> list[int | None]:
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [proc.poll() for proc in procs]


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str, run: _Run) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{run.logs()}")
        time.sleep(0.05)


@pytest.fixture(params=[0, 1], ids=["plain", "overlap"])
def run_factory(tmp_path: Path, reap_children: Reaper, request: pytest.FixtureRequest) -> Callable[..., _Run]:
    """(steps, start_peers, **[net] settings) -> a `_Run`, with plain rounds and with overlapped ones."""
    return lambda steps, start_peers, **net: _Run(tmp_path, steps, start_peers, reap_children, int(request.param),
                                                 **net)


def _by_round(run: _Run, peers: list[str], rows: Callable[[str], list[dict[str, Any]]] | None = None, *,
              killed: bool = False) -> dict[int, dict[str, dict[str, Any]]]:
    """`rows_by_round` (of `run.rows` unless `rows`), plus one parameter digest per round across the peers
    that completed it, the coordinator's (after the apply: the documented point, also when rounds overlap).
    `killed`: the coordinator was killed mid-run; a round it published and died before applying has no
    canonical digest in its rows ("": the next Submit's check stands in, docs/coordinator.md)."""
    by_round = rows_by_round(rows or run.rows, peers)
    for round_, got in sorted(by_round.items()):
        digests = {p: r["param_digest"] for p, r in got.items()}
        assert len(set(digests.values())) == 1, f"round {round_}: digests differ: {digests}"
        canonical = {r["canonical_digest"] for r in got.values()}
        assert canonical == set(digests.values()) or (killed and canonical == {""}), got
        assert {r["overlap"] for r in got.values()} == {run.overlap}, got
    return by_round


def _check_end(run: _Run, by_round: dict[int, dict[str, dict[str, Any]]], peers: list[str]) -> None:
    """Every peer ran to the run's last round, with one final digest; the loss fell."""
    last = run.steps - 1
    assert set(by_round[last]) == set(peers), f"round {last}: {sorted(by_round[last])}"
    rounds = sorted(by_round)
    mean = [sum(r["loss"] for r in by_round[n].values()) / len(by_round[n]) for n in rounds]
    assert sum(mean[-5:]) / 5 < sum(mean[:5]) / 5 - 0.3, mean


def test_a_peer_killed_mid_run_is_waited_for_until_the_deadline_then_rejoins(run_factory: Any) -> None:
    run = run_factory(50, 3)
    coordinator = run.coordinator()
    a, b, c = (run.peer(p, *(["--checkpoint-every", "2"] if p == "c" else [])) for p in ("a", "b", "c"))
    c_again = run.peer("c", gated=True)  # the restart: same --peer-id and --out, held until c is dead
    wait_for(lambda: len(run.rows("c")) >= 5, WAIT_S, "c's first 5 rounds", run)
    os.kill(c.pid, signal.SIGKILL)
    c.wait(timeout=10)
    killed = run.last_round("c") + 1  # the round c was in when it died
    assert 0 < killed < run.steps - 10, killed
    wait_for(lambda: min(run.last_round("a"), run.last_round("b")) >= killed + 2, WAIT_S,
             "a and b to carry on without c", run)
    assert run.last_round("c") == killed - 1  # nothing more from c while it is dead
    run.release(c_again)
    codes = run.wait_exit([a, b, c_again])
    assert codes == [0, 0, 0], f"exit codes {codes}\n{run.logs()}"
    run.stop(coordinator)

    by_round = _by_round(run, ["a", "b", "c"])
    assert [r["round"] for r in run.rows("a")] == list(range(run.steps))
    assert [r["round"] for r in run.rows("b")] == list(range(run.steps))
    c_rounds = [r["round"] for r in run.rows("c")]
    back = next(n for n in c_rounds if n >= killed)  # c's first round after the restart
    assert c_rounds == [*range(killed), *range(back, run.steps)], c_rounds
    assert back < run.steps - 5, back
    # The rounds c missed went on without its payload; while c was still a member, a round closed
    # at its deadline (it closes early only when every member is in).
    for n in range(killed + 1, back):
        assert by_round[n]["a"]["contributors"] <= 2, by_round[n]["a"]
    closed_without = [(int(m[1]), m[2].split(", ")) for m in
                      re.finditer(r"round=(\d+)\] closed without ([\w., -]+)", run.log("coordinator-1"))]
    assert any(killed <= n < back and "c" in who for n, who in closed_without), closed_without
    # Back in the run: c contributes to every round from its first one on, with the others' digest.
    for n in range(back, run.steps):
        assert by_round[n]["a"]["contributors"] == 3, by_round[n]["a"]
    log = run.peer_log(c_again)
    assert "joined" in log and "starting with zero momentum" in log, log  # its checkpoint is from before
    _check_end(run, by_round, ["a", "b", "c"])


def _forged_leave(address: str, peer_id: str) -> tuple[grpc.StatusCode, tuple[str, ...]]:
    """A Leave for `peer_id` signed by another key; returns its status code and the members after it."""
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(address) as channel:
        stub: Any = pbg.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        try:
            stub.Leave(leave_request(Identity.generate(), b"a session", peer_id, 0, 1), metadata=metadata, timeout=10)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
        return code, tuple(stub.Status(pb.StatusRequest(), metadata=metadata, timeout=10).members)


def test_a_peer_stopped_by_sigterm_leaves_and_no_round_waits_for_it(run_factory: Any) -> None:
    # A silent member is waited for until it is dropped: 30 s here, and a round's deadline is 60 s. A peer
    # that stops gracefully says so (Leave), and the next rounds close as soon as the others are in.
    run = run_factory(40, 3, round_timeout_s=60.0, heartbeat_timeout_s=30.0)
    coordinator = run.coordinator()
    a, b, c = (run.peer(p) for p in ("a", "b", "c"))
    wait_for(lambda: min(run.last_round(p) for p in ("a", "b", "c")) >= 5, WAIT_S, "the first rounds", run)
    code, members = _forged_leave(run.address, "c")  # not signed by c's key: refused, c stays
    assert code == grpc.StatusCode.PERMISSION_DENIED and "c" in members, (code, members)
    os.kill(c.pid, signal.SIGTERM)
    assert run.wait_exit([c]) == [0], run.logs()
    stopped = run.last_round("c")
    assert stopped < run.steps - 10, stopped
    codes = run.wait_exit([a, b])
    assert codes == [0, 0], f"exit codes {codes}\n{run.logs()}"
    run.stop(coordinator)

    log = run.log("coordinator-1")
    assert re.search(r"\] c left \(stopped at its round \d+\)", log) and "dropped c" not in log, run.logs()
    assert "left the run" in run.peer_log(c), run.peer_log(c)
    by_round = _by_round(run, ["a", "b", "c"])
    for p in ("a", "b"):
        rows = run.rows(p)
        assert [r["round"] for r in rows] == list(range(run.steps))
        assert max(r["round_time_s"] for r in rows) < 10.0, [r["round_time_s"] for r in rows]  # none waited 30 s
    for n in range(stopped + 2, run.steps):  # (an overlapped c sent its next payload before it stopped)
        assert set(by_round[n]) == {"a", "b"} and by_round[n]["a"]["contributors"] == 2, by_round[n]


def test_a_late_joiner_downloads_the_parameters_and_agrees_from_its_first_round(run_factory: Any) -> None:
    run = run_factory(60, 2)
    coordinator = run.coordinator()
    late = run.peer("c", gated=True)
    a, b = run.peer("a"), run.peer("b")
    wait_for(lambda: min(run.last_round("a"), run.last_round("b")) >= 5, WAIT_S, "a and b's first rounds", run)
    assert not (run.out / "peer-c.pt").exists()  # no checkpoint to take a momentum from: it starts at zero
    run.release(late)
    codes = run.wait_exit([a, b, late])
    assert codes == [0, 0, 0], f"exit codes {codes}\n{run.logs()}"
    run.stop(coordinator)

    by_round = _by_round(run, ["a", "b", "c"])
    for p in ("a", "b"):
        assert [r["round"] for r in run.rows(p)] == list(range(run.steps))
    c_rounds = [r["round"] for r in run.rows("c")]
    first = c_rounds[0]
    assert 5 < first < run.steps - 10, c_rounds
    assert c_rounds == list(range(first, run.steps)), c_rounds  # in every round from its first on
    log = run.peer_log(late)
    loaded = [int(n) for n in re.findall(r"parameters of round (\d+) loaded", log)]
    assert loaded and loaded[0] <= first, log  # its first payload may count in a later round than its parameters'
    if loaded[-1] < first:  # a late first payload: it applied the rounds between, each on the canonical digest
        assert f"counted in round {first}" in log, log
    assert "resumed the momentum" not in log, log
    for n in range(first, run.steps):
        assert set(by_round[n]) == {"a", "b", "c"} and by_round[n]["a"]["contributors"] == 3, by_round[n]
    _check_end(run, by_round, ["a", "b", "c"])


def test_the_coordinator_killed_mid_run_restarts_on_its_port_and_training_resumes(run_factory: Any) -> None:
    run = run_factory(40, 2)
    listen = f"127.0.0.1:{free_port()}"
    coordinator = run.coordinator(listen)
    a, b = run.peer("a"), run.peer("b")
    wait_for(lambda: min(run.last_round("a"), run.last_round("b")) >= 5, WAIT_S, "the first rounds", run)
    os.kill(coordinator.pid, signal.SIGKILL)  # nothing is flushed on the way out
    coordinator.wait(timeout=10)
    killed = max(run.last_round("a"), run.last_round("b")) + 1
    assert killed < run.steps - 10, killed
    coordinator = run.coordinator(listen)  # same port, same --state-dir
    codes = run.wait_exit([a, b])
    assert codes == [0, 0], f"exit codes {codes}\n{run.logs()}"
    run.stop(coordinator)

    assert "resumed from" in run.log("coordinator-2")
    # The state is written after a round is published: a kill before the write completes makes the
    # peers do the rounds since again (tests/integration/test_persist.py); their last rows stand.
    by_round = _by_round(run, ["a", "b"], lambda p: final_rows(run.rows(p)), killed=True)  # one digest a round
    for p in ("a", "b"):
        assert [r["round"] for r in final_rows(run.rows(p))] == list(range(run.steps)), p  # past the kill, no gap
        log = run.log(p)
        assert "retrying" in log and "answers again" in log, log  # it lived through the outage
    aborted = [n for n, rows in by_round.items() if rows["a"]["aborted"]]
    assert all(killed - 1 <= n <= killed + 1 for n in aborted), aborted  # at most the round of the kill is lost
    _check_end(run, by_round, ["a", "b"])
