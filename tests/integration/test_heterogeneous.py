"""Peers on different CPU kernels must still end every round on the same parameters.

Three `demonet peer` processes on loopback, each told by its environment to use other instruction
sets and thread counts, as machines of a real run would:

- two peers: the machine's own kernels, 2 threads;
- one peer: ATen's scalar (default) kernels, MKL up to SSE4.2, oneDNN up to SSE4.1, 1 thread;
- in coordinator mode, the coordinator: ATen's AVX2 kernels, MKL up to AVX2.

A peer whose parameters after applying a round differ from the others' resyncs: it downloads the
whole parameters, the dense transfer the compressed rounds exist to avoid. In coordinator mode the
coordinator's digest is the reference; in DHT mode (no coordinator) the majority's digest at the
next round's start. So the tests assert that no peer ever resyncs and that all peers report one
digest per round, in both modes, for each base optimizer the mode supports.

Every process runs in its own session, and `close` kills each session's process group (the peer,
and in DHT mode its p2pd) at the end, also when the test fails.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import IO, Any

import pytest
import torch

from tests.integration.common import listening_line, metrics_rows, rows_by_round, tiny_config

pytestmark = pytest.mark.slow

TOKEN = "heterogeneous-test-token"
STEPS = 24
MIN_ROWS = 20
ROUND_TIMEOUT_S = 10.0
"""Long enough that no round closes without a peer on a loaded 2-core machine; a round whose three
members are in closes at once."""
RUN_TIMEOUT_S = 120.0
"""Bound of the whole run, starting the processes included (it takes about 20 s)."""
DHT_RUN_TIMEOUT_S = 150.0
"""The same in DHT mode, where each peer also starts a p2pd daemon."""

_KERNEL_VARS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS",
                "MKL_NUM_THREADS")
_SCALAR = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"}
PEERS = {"native-0": (2, {}), "native-1": (2, {}), "scalar": (1, _SCALAR)}
"""peer id -> (torch threads, kernel environment)."""


def _coordinator_kernels() -> dict[str, str]:
    """AVX2 kernels for the coordinator, if this CPU has them (ATen refuses a capability above the CPU's)."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    warnings.warn(f"this CPU's kernels are {torch.backends.cpu.get_cpu_capability()}, without AVX2: the "
                  "coordinator runs on the machine's own kernels instead of AVX2", stacklevel=2)
    return {}


class _Run:
    """The processes of one run, each with its own environment, session and log in tmp; `close` kills them."""

    def __init__(self, tmp: Path, optim: dict[str, float | str]) -> None:
        self.tmp, self.out = tmp, tmp / "out"
        (tmp / "run.toml").write_text(tiny_config(round_timeout_s=ROUND_TIMEOUT_S, optim=optim))
        self.base_env = {k: v for k, v in os.environ.items() if k not in _KERNEL_VARS}
        self.base_env["DEMONET_TOKEN"] = TOKEN
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.files: list[IO[bytes]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "wb")
        self.files.append(log)
        proc = subprocess.Popen([sys.executable, "-m", "demonet", *argv], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE if name == "coordinator" else log, stderr=log,
                                env={**self.base_env, **env}, start_new_session=True)
        self.procs[name] = proc
        return proc

    def start_peer(self, peer_id: str, argv: list[str]) -> subprocess.Popen[bytes]:
        """Start peer `peer_id` of `PEERS` with its kernels and threads."""
        threads, env = PEERS[peer_id]
        return self.start(peer_id, ["peer", *argv, "--peer-id", peer_id, "--out", str(self.out), "--threads",
                                    str(threads), "--checkpoint-every", "0"], {**env, "OMP_NUM_THREADS": str(threads)})

    def wait(self, names: list[str], timeout_s: float) -> list[int | None]:
        """The exit codes of processes `names` (None: still running after `timeout_s` in all)."""
        deadline = time.monotonic() + timeout_s
        for name in names:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[name].wait(timeout=max(0.1, deadline - time.monotonic()))
        return [self.procs[name].poll() for name in names]

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        """Every log's tail, for failure messages."""
        return "\n".join(f"--- {name}\n{self.log(name)[-3000:]}" for name in self.procs)

    def close(self) -> None:
        for proc in self.procs.values():  # each session: the process and its children (p2pd)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for f in self.files:
            f.close()

    def kernels(self, names: list[str]) -> dict[str, tuple[str, int]]:
        """name -> (CPU kernels, threads) each process logged; checks that the peers' settings took effect."""
        found = {name: re.search(r"CPU kernels (\w+), (\d+) threads", self.log(name)) for name in names}
        assert all(found.values()), self.logs()
        seen = {name: (m.group(1), int(m.group(2))) for name, m in found.items() if m is not None}
        assert seen["scalar"] == ("DEFAULT", 1) and seen["native-0"][1] == seen["native-1"][1] == 2, seen
        return seen


def _peer_rows(out: Path) -> dict[str, list[dict[str, Any]]]:
    rows = {p: metrics_rows(out, p) for p in PEERS}
    assert all(len(r) >= MIN_ROWS for r in rows.values()), {p: len(r) for p, r in rows.items()}
    return rows


def _assert_one_digest_per_round(rows: dict[str, list[dict[str, Any]]], steps: int) -> None:
    """Every round has a row of every peer, none resynced, and all with one digest."""
    by_round = rows_by_round(lambda p: rows[p], list(PEERS))  # also: no row marked resynced
    for round_, by_peer in sorted(by_round.items()):
        assert all(row["resyncs"] == 0 for row in by_peer.values()), by_peer
        digests = {p: row["param_digest"] for p, row in by_peer.items()}
        assert set(by_peer) == set(PEERS) and len(set(digests.values())) == 1, f"round {round_}: {digests}"
    assert sorted(by_round) == list(range(steps))


@pytest.mark.parametrize("optim", [{"base": "sign"}, {"base": "sgd", "lr": 0.05}], ids=["sign", "sgd"])
def test_peers_on_other_cpu_kernels_never_resync(tmp_path: Path, optim: dict[str, float | str]) -> None:
    run = _Run(tmp_path, optim)
    try:
        coordinator = run.start("coordinator", ["coordinator", "--listen", "127.0.0.1:0", "--config",
                                                str(tmp_path / "run.toml"), "--steps", str(STEPS),
                                                "--start-peers", str(len(PEERS))], _coordinator_kernels())
        line = listening_line(coordinator, 60.0)
        assert line.startswith("listening on "), run.log("coordinator")
        address = line.split()[-1]
        for peer_id in PEERS:
            run.start_peer(peer_id, ["--coordinator", address])
        codes = run.wait(list(PEERS), RUN_TIMEOUT_S)
        assert codes == [0] * len(PEERS), f"exit codes {codes}\n{run.logs()}"
    finally:
        run.close()

    seen = run.kernels(list(run.procs))
    rows = _peer_rows(run.out)
    marked = {p: sum(bool(row.get("resynced")) for row in r) for p, r in rows.items()}
    resyncs = {p: r[-1]["resyncs"] for p, r in rows.items()}  # also those told at a Submit (no marked row)
    warned = len(re.findall(r"WARNING .* resyncs at round", run.log("coordinator")))
    assert all(resyncs[p] >= marked[p] for p in PEERS) and warned == sum(resyncs.values()), (resyncs, marked, warned)
    assert sum(resyncs.values()) == 0, (
        f"{optim}: peers resynced (kernels {seen}; resyncs per peer {resyncs} in {STEPS} rounds, "
        f"rows marked resynced {marked}, coordinator warnings {warned})")
    _assert_one_digest_per_round(rows, STEPS)


@pytest.mark.parametrize("optim", [{"base": "sign"}, {"base": "sgd", "lr": 0.05}], ids=["sign", "sgd"])
def test_dht_peers_on_other_cpu_kernels_never_resync(tmp_path: Path, optim: dict[str, float | str]) -> None:
    """DHT mode: the same three peers, no coordinator; the majority's digest decides who resyncs."""
    pytest.importorskip("hivemind")
    from hivemind.p2p import P2P, PeerID

    run = _Run(tmp_path, optim)
    # native-0 starts the DHT at a multiaddr known in advance (its identity and a free port); the others
    # start once it listens, as `demonet up --dht` starts them (a start retried while the first peer's
    # DHT comes up can hang for the whole bootstrap bound on a loaded machine).
    identity = tmp_path / "native-0.identity"
    P2P.generate_identity(str(identity))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    maddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{PeerID.from_identity(identity.read_bytes())}"
    dht = ["--dht", "--run", "heterogeneous", "--config", str(tmp_path / "run.toml"), "--steps", str(STEPS),
           "--start-peers", str(len(PEERS))]
    try:
        first = run.start_peer("native-0", [*dht, "--identity", str(identity), "--host-maddr",
                                            f"/ip4/127.0.0.1/tcp/{port}"])
        deadline = time.monotonic() + 120
        while "dht listening on" not in run.log("native-0") and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        for peer_id in ("native-1", "scalar"):
            run.start_peer(peer_id, [*dht, "--initial-peers", maddr, "--host-maddr", "/ip4/127.0.0.1/tcp/0"])
        codes = run.wait(list(PEERS), DHT_RUN_TIMEOUT_S)
    finally:
        run.close()

    seen = run.kernels(list(PEERS))
    rows = {p: metrics_rows(run.out, p) for p in PEERS}
    # A DHT peer that is not on the majority's digest at a round's start counts a resync and loads
    # the parameters again (no row for that round).
    resyncs = {p: max((row["resyncs"] for row in r), default=0) for p, r in rows.items()}
    digests: dict[int, set[str]] = {}
    for row in (row for r in rows.values() for row in r):
        digests.setdefault(row["round"], set()).add(row["param_digest"])
    disagree = sorted(r for r, d in digests.items() if len(d) > 1)
    summary = (f"{optim}: kernels {seen}; rows per peer { {p: len(r) for p, r in rows.items()} }, resyncs per peer "
               f"{resyncs}, rounds with more than one digest {disagree} of {len(digests)}, exit codes {codes}")
    assert sum(resyncs.values()) == 0 and not disagree, summary
    assert codes == [0] * len(PEERS), f"{summary}\n{run.logs()}"
    assert all(len(r) >= MIN_ROWS for r in rows.values()), summary
    _assert_one_digest_per_round(rows, STEPS)
