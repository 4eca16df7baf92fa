"""A demonet run in DHT mode over a network lab: no coordinator, every peer a real `demonet peer --dht`
process in its own namespace on a tbf-shaped link.

`DhtCluster` is the DHT-mode launcher. Peer 0 (the `bootstrap` peer) starts the DHT at a fixed lab
address and port with an identity generated beforehand, so its multiaddr is known before it runs
and every other peer (restarts included) is given it as `--initial-peers`. A peer's process group
holds its p2pd daemon (and the daemon's watcher): `kill` and the teardown SIGKILL the whole group,
as a machine dies. The scenarios are in test_dht.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from demonet.lab import netlab
from tests.chaos.cluster import TOKEN, WAIT_S, CoordinatorCluster, PeerHandle
from tests.integration.common import DHT_GATE, rows_by_round

DHT_PORT = 7460
# A peer process spends seconds importing torch and hivemind; one held at this gate enters the run at once.


class DhtCluster(CoordinatorCluster):
    """One run in DHT mode over a lab; `reaper` ends every peer's process group."""

    mode = "dht"
    group_kill = True

    def start(self, config: str, *, steps: int, start_peers: int, bootstrap: str = "a",  # type: ignore[override]
              mbit: float | None = 100.0, exchange_timeout_s: float = 2.0) -> None:
        """Write the run config, make peer 0's namespace and identity: its multiaddr is known from here on."""
        from hivemind.p2p import P2P, PeerID

        (self.tmp / "run.toml").write_text(config)
        self.steps, self.start_peers, self.bootstrap = steps, start_peers, bootstrap
        self.exchange_timeout_s = exchange_timeout_s
        host = self.host(bootstrap, mbit)
        self.identity = self.tmp / f"{bootstrap}.identity"
        P2P.generate_identity(str(self.identity))
        peer_id = PeerID.from_identity(self.identity.read_bytes())
        self.maddr = f"/ip4/{host.addr}/tcp/{DHT_PORT}/p2p/{peer_id}"

    def host(self, name: str, mbit: float | None) -> netlab.Host:
        """The peer's namespace (made once per peer id, kept across restarts)."""
        if name not in self.peers:
            self.peers[name] = PeerHandle(name, self.lab.add_host(f"{self.prefix}{name}", mbit=mbit))
        return self.peers[name].host

    def peer(self, name: str, *, mbit: float | None = None, gated: bool = False,  # type: ignore[override]
             extra: Sequence[str] = (), script: str | None = None,
             script_args: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        """Start `demonet peer --dht --peer-id name` in the peer's namespace (log <name>[-n].log).

        The bootstrap peer listens at its fixed address with its identity; the others join it.
        A gated peer imports torch and hivemind, then waits for `release`; `script` replaces the
        gate (e.g. a poisoner).
        """
        host = self.host(name, mbit)
        handle = self.peers[name]
        if name == self.bootstrap:
            where = ["--identity", str(self.identity), "--host-maddr", f"/ip4/{host.addr}/tcp/{DHT_PORT}"]
        else:
            where = ["--initial-peers", self.maddr, "--host-maddr", f"/ip4/{host.addr}/tcp/0"]
        argv = ["peer", "--dht", "--run", "chaos", "--config", str(self.tmp / "run.toml"), "--steps", str(self.steps),
                "--start-peers", str(self.start_peers), "--exchange-timeout-s", str(self.exchange_timeout_s),
                "--peer-id", name, "--out", str(self.out), "--threads", "1", *where, *extra]
        log = name if not handle.procs else f"{name}-{len(handle.procs) + 1}"
        if script is not None:
            cmd = [sys.executable, "-c", script, *script_args, *argv]
        elif gated:
            cmd = [sys.executable, "-c", DHT_GATE, *argv]
        else:
            cmd = [sys.executable, "-m", "demonet", *argv]
        proc = host.popen(cmd, stdin=subprocess.PIPE if gated else subprocess.DEVNULL,
                          stdout=self._logfile(log), stderr=subprocess.STDOUT, env={**self.env, "DEMONET_TOKEN": TOKEN})
        proc.log_name = log  # type: ignore[attr-defined]
        handle.procs.append(self.reaper.add(proc, group=self.group_kill))  # the peer and its p2pd
        return proc

    def finish(self, procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = WAIT_S) -> None:
        """Wait for the peers to end the run (exit 0)."""
        codes = self.wait_exit(procs, timeout_s)
        assert codes == [0] * len(procs), f"exit codes {codes}\n{self.logs()}"

    # -- what the run did ------------------------------------------------------------------------------

    def by_round(self, peers: Sequence[str]) -> dict[int, dict[str, dict[str, Any]]]:  # type: ignore[override]
        """round -> peer -> row, checking: one row per peer and round, finite losses, no resync, and one
        digest per round across the peers that did it (no coordinator: the peers must agree)."""
        by_round = rows_by_round(self.rows, peers)
        for round_, rows in sorted(by_round.items()):
            digests = {p: r["param_digest"] for p, r in rows.items()}
            assert len(set(digests.values())) == 1, f"round {round_}: {digests}"
        return by_round

    def notable(self, peer: str, last: int = 40) -> str:
        """The peer's last warnings, errors and membership changes (catching up, loads, resyncs), across
        restarts: what a failure message needs to tell why a peer lost rounds."""
        text = "".join(self.log(p.log_name) for p in self.peers[peer].procs)  # type: ignore[attr-defined]
        keep = re.compile(r" (WARN|WARNING|ERROR) |catching up|loaded from|Resync|NotMember|registered|admitted")
        return "\n".join([line for line in text.splitlines() if keep.search(line)][-last:])

    def loaded(self, peer: str) -> list[tuple[int, str]]:
        """(round, digest prefix) of every parameter download the peer logged, across restarts."""
        text = "".join(self.log(p.log_name) for p in self.peers[peer].procs)  # type: ignore[attr-defined]
        return [(int(m[1]), m[2]) for m in re.finditer(
            r"parameters of round (\d+) loaded from \d+ donors \(.*?\) \(\d+ bytes, digest (\w+)\)", text)]


def digest_after(by_round: dict[int, dict[str, dict[str, Any]]], round_: int) -> str:
    """The (agreed) digest prefix after `round_`, as the download logs print it."""
    return next(iter(by_round[round_].values()))["param_digest"][:12]


__all__ = ["DhtCluster", "digest_after"]
