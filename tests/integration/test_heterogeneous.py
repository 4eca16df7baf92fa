"""Peers on different CPU kernels must still end every round on the coordinator's parameters.

A `demonet coordinator` process and three `demonet peer` processes on loopback, each told by its
environment to use other instruction sets and thread counts, as machines of a real run would:

- the coordinator: ATen's AVX2 kernels, MKL up to AVX2;
- two peers: the machine's own kernels, 2 threads;
- one peer: ATen's scalar (default) kernels, MKL up to SSE4.2, oneDNN up to SSE4.1, 1 thread.

A peer whose digest after applying a round differs from the canonical one resyncs: it downloads the
whole parameters, the dense transfer the compressed rounds exist to avoid. So the test asserts that
no peer ever resyncs, for each base optimizer coordinator mode supports.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from tests.integration.common import listening_line, metrics_rows, rows_by_round, tiny_config
from tests.procs import Reaper

pytestmark = pytest.mark.slow

TOKEN = "heterogeneous-test-token"
STEPS = 24
MIN_ROWS = 20
ROUND_TIMEOUT_S = 10.0
"""Long enough that no round closes without a peer on a loaded 2-core machine; a round whose three
members are in closes at once."""
RUN_TIMEOUT_S = 120.0
"""Bound of the whole run, starting the processes included (it takes about 20 s)."""

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
    """The coordinator and the peers, each with its own environment and log in tmp; `reaper` kills them."""

    def __init__(self, tmp: Path, optim: dict[str, float | str], reaper: Reaper) -> None:
        self.tmp, self.out, self.reaper = tmp, tmp / "out", reaper
        (tmp / "run.toml").write_text(tiny_config(round_timeout_s=ROUND_TIMEOUT_S, optim=optim))
        self.base_env = {k: v for k, v in os.environ.items() if k not in _KERNEL_VARS}
        self.base_env["DEMONET_TOKEN"] = TOKEN
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = self.reaper.open(self.tmp / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "demonet.cli", *argv], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE if name == "coordinator" else log, stderr=log,
                                env={**self.base_env, **env})
        self.procs[name] = self.reaper.add(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        """Every log's tail, for failure messages."""
        return "\n".join(f"--- {name}\n{self.log(name)[-3000:]}" for name in self.procs)


@pytest.mark.parametrize("optim", [{"base": "sign"}, {"base": "sgd", "lr": 0.05}], ids=["sign", "sgd"])
def test_peers_on_other_cpu_kernels_never_resync(tmp_path: Path, optim: dict[str, float | str],
                                                 reap_children: Reaper) -> None:
    run = _Run(tmp_path, optim, reap_children)
    try:
        coordinator = run.start("coordinator", ["coordinator", "--listen", "127.0.0.1:0", "--config",
                                                str(tmp_path / "run.toml"), "--steps", str(STEPS),
                                                "--start-peers", str(len(PEERS))], _coordinator_kernels())
        line = listening_line(coordinator, 60.0)
        assert line.startswith("listening on "), run.log("coordinator")
        address = line.split()[-1]
        peers = [run.start(peer_id, ["peer", "--coordinator", address, "--peer-id", peer_id, "--out", str(run.out),
                                     "--threads", str(threads), "--checkpoint-every", "0"],
                           {**env, "OMP_NUM_THREADS": str(threads)})
                 for peer_id, (threads, env) in PEERS.items()]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for proc in peers:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        codes = [proc.poll() for proc in peers]
        assert codes == [0] * len(PEERS), f"exit codes {codes}\n{run.logs()}"
    finally:
        reap_children.close()  # the coordinator lingers after the last round: its log is complete from here

    kernels = {name: re.search(r"CPU kernels (\w+), (\d+) threads", run.log(name)) for name in run.procs}
    assert all(kernels.values()), run.logs()
    seen = {name: (m.group(1), int(m.group(2))) for name, m in kernels.items() if m is not None}
    assert seen["scalar"] == ("DEFAULT", 1) and seen["native-0"][1] == seen["native-1"][1] == 2, seen
    rows = {p: metrics_rows(run.out, p) for p in PEERS}
    assert all(len(r) >= MIN_ROWS for r in rows.values()), {p: len(r) for p, r in rows.items()}
    marked = {p: sum(bool(row.get("resynced")) for row in r) for p, r in rows.items()}
    resyncs = {p: r[-1]["resyncs"] for p, r in rows.items()}  # also those told at a Submit (no marked row)
    warned = len(re.findall(r"WARNING .* resyncs at round", run.log("coordinator")))
    assert all(resyncs[p] >= marked[p] for p in PEERS) and warned == sum(resyncs.values()), (resyncs, marked, warned)
    assert sum(resyncs.values()) == 0, (
        f"{optim}: peers resynced (kernels {seen}; resyncs per peer {resyncs} in {STEPS} rounds, "
        f"rows marked resynced {marked}, coordinator warnings {warned})")
    by_round = rows_by_round(lambda p: rows[p], list(PEERS))  # also: no row marked resynced
    for round_, by_peer in sorted(by_round.items()):
        assert all(row["resyncs"] == 0 for row in by_peer.values()), by_peer
        digests = {p: row["param_digest"] for p, row in by_peer.items()}
        assert set(by_peer) == set(PEERS) and len(set(digests.values())) == 1, f"round {round_}: {digests}"
    assert sorted(by_round) == list(range(STEPS))
