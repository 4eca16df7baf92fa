"""`demonet bench`: demonet against AdamW-DDP and hivemind.Optimizer, side by side over shaped links.

A bench package: starts every system as real processes in a `demonet.lab.netlab` lab (4 peers by default, each link
shaped with tbf to its peer's speed, each peer slowed by its factor: a `Swarm`), samples the links' kernel byte
counters, and hands the step records to `report` (`sweep` runs every system on every swarm). Each system is one
launcher function in `SYSTEMS`; a new system is one more entry.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demonet.lab.netlab import Host, Lab
from demonet.loop.rows import MetricsRow
from demonet.train.model import ModelConfig

from .slowdown import ENV as SLOWDOWN_ENV
from .slowdown import TASK as SLOWDOWN_TASK
from .swarm import Swarm

__all__ = ["EVIDENCE_MODEL", "SYSTEMS", "BenchSetup", "Run", "Swarm", "System", "run_system"]

EVIDENCE_MODEL = ModelConfig(vocab_size=256, seq_len=64, d_model=256, n_layers=4, n_heads=4)
"""3.2M parameters: a 13 MB fp32 gradient costs DDP seconds per step at 10 Mbit/s, while a forward and
backward of 4 x 64 tokens stays near 0.1 s on one CPU core."""

_PORT = 29500
_WORKERS = [sys.executable, "-m", "demonet.lab.evidence.workers"]
_FINAL_PARAMS_S = 30.0
"""How long a finished run may take to write its final parameters (a peer's exit checkpoint, rank 0's file)."""


@dataclass(frozen=True, kw_only=True)
class BenchSetup:
    """What every system of one comparison shares."""

    model: ModelConfig = EVIDENCE_MODEL
    peers: int = 4
    """Training peers, each in its own namespace."""
    steps: int = 200
    """Optimizer steps (global batches) per run."""
    batch_size: int = 4
    """Sequences per peer per step; the global batch is peers x batch_size."""
    seq_len: int = 64
    seed: int = 0
    max_time_s: float = 600.0
    """A run stops after this long (the slow links); the figures then cover the steps it did."""
    adamw_lr: float = 1e-3
    demo_lr: float = 3e-3
    demo_topk: int = 32


@dataclass
class Run:
    """One system on one swarm: per-peer step records and the link counters sampled meanwhile."""

    system: str
    mbit: float
    """The swarm's fastest link (every link, in a swarm of equals)."""
    out: Path
    peers: list[list[dict[str, Any]]] = field(default_factory=list)
    """Per peer: {"step", "time", "loss"} records (time: Unix time when the step was done), some with
    "samples" and "micro_batches"; step 0 marks the start of training."""
    samples: dict[str, list[tuple[float, int, int]]] = field(default_factory=dict)
    """Per host: (Unix time, tx bytes, rx bytes) of its link."""
    peer_hosts: list[str] = field(default_factory=list)
    launched_at: float = 0.0
    ended_at: float = 0.0
    finished: bool = False
    """Every peer did every step (no time cap, no failure)."""
    final_params: Path | None = None
    peer_mbit: list[float] = field(default_factory=list)
    """The swarm's links, one per peer (empty: every peer at `mbit`); a fast-only system ran a part of it."""
    slowdown: list[float] = field(default_factory=list)
    """The swarm's slowdowns, one per peer (empty: none slowed)."""

    @property
    def swarm(self) -> Swarm:
        """The swarm this run was asked for (before a fast-only system kept its fast peers)."""
        if not self.peer_mbit:
            return Swarm.alike(self.mbit, len(self.peers) or 1)
        return Swarm(tuple(self.peer_mbit), tuple(self.slowdown or [1.0] * len(self.peer_mbit)))


@dataclass
class Launched:
    """What a launcher started: the processes to wait for, and how to read their step records."""

    peer_hosts: list[Host]
    records: Callable[[], list[list[dict[str, Any]]]]
    final_params: Path | None = None


Launcher = Callable[[Lab, BenchSetup, Swarm, Path], Launched]
"""Starts a system's processes in the lab: `setup.peers` peers, peer i on a link of `swarm.mbit[i]`, slowed by
`swarm.slowdown[i]`."""


@dataclass(frozen=True)
class System:
    name: str
    label: str
    launch: Launcher
    fast_only: bool = False
    """Run the swarm's fast peers alone (`Swarm.fast`)."""


def _rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines written to `path` so far: none if it is missing, and not a last line still being written."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


def _wait_for(path: Path, timeout_s: float) -> None:
    """Until `path` exists (every system writes its final parameters whole, by a rename), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def _read_steps(out: Path, peers: int) -> list[list[dict[str, Any]]]:
    return [_rows(out / f"steps-{rank}.jsonl") for rank in range(peers)]


def _worker_args(setup: BenchSetup, swarm: Swarm, rank: int, lr: float, out: Path, timeout_s: float) -> list[str]:
    return ["--rank", str(rank), "--world", str(setup.peers), "--model", json.dumps(dataclasses.asdict(setup.model)),
            "--steps", str(setup.steps), "--batch-size", str(setup.batch_size), "--seq-len", str(setup.seq_len),
            "--lr", str(lr), "--seed", str(setup.seed), "--out", str(out), "--timeout-s", str(timeout_s),
            "--slowdown", str(swarm.slowdown[rank])]


def _log_file(out: Path, name: str) -> Any:
    (out / "logs").mkdir(parents=True, exist_ok=True)
    return open(out / "logs" / f"{name}.log", "w")


def _param_bytes(setup: BenchSetup) -> int:
    """Bytes of the model's fp32 parameters (or of one fp32 gradient)."""
    from demonet.train.model import GPT

    return 4 * sum(p.numel() for p in GPT(setup.model).parameters())


def _allreduce_s(setup: BenchSetup, mbit: float) -> float:
    """Seconds one ring all-reduce of the fp32 gradient takes on the link (2 (n-1)/n of it each way)."""
    return 2 * (setup.peers - 1) / setup.peers * _param_bytes(setup) * 8 / (mbit * 1e6)


def launch_ddp(lab: Lab, setup: BenchSetup, swarm: Swarm, out: Path) -> Launched:
    """AdamW + DistributedDataParallel over gloo (tcp:// rendezvous at rank 0's lab address)."""
    hosts = [lab.add_host(f"ddp{r}", mbit=swarm.mbit[r]) for r in range(setup.peers)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"}
    for rank, host in enumerate(hosts):
        argv = [*_WORKERS, "ddp", *_worker_args(setup, swarm, rank, setup.adamw_lr, out, setup.max_time_s + 60),
                "--master", f"{hosts[0].addr}:{_PORT}"]
        log = _log_file(out, f"ddp{rank}")
        host.popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env)
    return Launched(hosts, lambda: _read_steps(out, setup.peers), out / "final.pt")


def launch_hivemind(lab: Lab, setup: BenchSetup, swarm: Swarm, out: Path) -> Launched:
    """hivemind.Optimizer with its usual settings: target_batch_size = peers x batch, global steps."""
    hosts = [lab.add_host(f"hm{r}", mbit=swarm.mbit[r]) for r in range(setup.peers)]
    # Matchmaking long enough to gather every peer; averaging long enough for a slow all-reduce.
    timeout_s = 60 + 4 * _allreduce_s(setup, min(swarm.mbit))
    initial: list[str] = []
    for rank, host in enumerate(hosts):
        argv = [*_WORKERS, "hivemind", *_worker_args(setup, swarm, rank, setup.adamw_lr, out, timeout_s),
                "--host", host.addr, "--matchmaking-s", "3", "--initial-peers", *initial]
        log = _log_file(out, f"hm{rank}")
        proc = host.popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        if rank == 0:
            deadline = time.monotonic() + 120
            while not (out / "maddrs.json").exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"hivemind rank 0 did not start its DHT; see {out / 'logs'}")
                time.sleep(0.2)
            initial = [a for a in json.loads((out / "maddrs.json").read_text()) if host.addr in a]
    deadline = time.monotonic() + 180
    while not all((out / f"ready-{rank}").exists() for rank in range(setup.peers)):
        if time.monotonic() > deadline or any(p.poll() is not None for h in hosts for p in h.procs):
            raise RuntimeError(f"the hivemind peers did not all get ready; see {out / 'logs'}")
        time.sleep(0.2)
    (out / "go").touch()
    return Launched(hosts, lambda: _read_steps(out, setup.peers), out / "final.pt")


def _run_toml(out: Path, setup: BenchSetup, swarm: Swarm, encoding: str, net: list[str]) -> None:
    """``<out>/run.toml``, the run config of a demonet system: the evidence model and data (as the slowdown task,
    `demonet.lab.evidence.slowdown`, where the swarm slows a peer), the optimizer, and the [net] lines `net`."""
    m = dataclasses.asdict(setup.model)
    slowed = any(s != 1 for s in swarm.slowdown)
    task = ["[task]", *(f"{k} = {json.dumps(v)}" for k, v in m.items()), f"batch_size = {setup.batch_size}",
            f"batch_seq_len = {setup.seq_len}"] if slowed else []
    (out / "run.toml").write_text("\n".join([
        "[model]", *(f"{k} = {json.dumps(v)}" for k, v in m.items()),
        "[optim]", f"lr = {setup.demo_lr}", f'encoding = "{encoding}"', f"compression_topk = {setup.demo_topk}",
        "[train]", f"batch_size = {setup.batch_size}", f"seq_len = {setup.seq_len}", f"seed = {setup.seed}",
        "eval_every = 0", *([f'task = "{SLOWDOWN_TASK}"'] if slowed else []), *task,
        "[net]", f"round_timeout_s = {60 + setup.max_time_s / 10}", f"start_peers = {setup.peers}", *net,
    ]) + "\n")


def _peer_env(env: dict[str, str], swarm: Swarm, rank: int) -> dict[str, str]:
    return {**env, SLOWDOWN_ENV: str(swarm.slowdown[rank])}


def _demonet(encoding: str, overlap: int = 0, lookahead: bool = True, lockstep: bool = False) -> Launcher:
    def launch(lab: Lab, setup: BenchSetup, swarm: Swarm, out: Path) -> Launched:
        """demonet coordinator mode: a coordinator host (on the fastest link) and one host per peer."""
        coord = lab.add_host("coord", mbit=swarm.fastest)
        hosts = [lab.add_host(f"dn{r}", mbit=swarm.mbit[r]) for r in range(setup.peers)]
        # The peers download the parameters at once through the coordinator's link (4 x 13 MB: 42 s at
        # 10 Mbit/s); their heartbeats run meanwhile, so the default heartbeat timeout holds.
        _run_toml(out, setup, swarm, encoding, [f"overlap = {overlap}", f"lookahead = {str(lookahead).lower()}",
                                                *(["lockstep = true"] if lockstep else [])])
        env = {**os.environ, "DEMONET_TOKEN": secrets.token_urlsafe(16)}
        address = f"{coord.addr}:7450"
        cli = [sys.executable, "-m", "demonet"]
        log = _log_file(out, "coord")
        coord.popen([*cli, "coordinator", "--listen", address, "--config", str(out / "run.toml"),
                     "--steps", str(setup.steps)], stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env)
        for rank, host in enumerate(hosts):
            log = _log_file(out, f"peer-{rank}")
            host.popen([*cli, "peer", "--coordinator", address, "--peer-id", f"peer-{rank}", "--out", str(out),
                        "--threads", "1", "--checkpoint-every", "0"],
                       stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=_peer_env(env, swarm, rank))
        return Launched(hosts, lambda: _demonet_steps(out, setup.peers), out / "peer-peer-0.pt")

    return launch


def _demonet_dht(encoding: str, verify: float | None = None) -> Launcher:
    def launch(lab: Lab, setup: BenchSetup, swarm: Swarm, out: Path) -> Launched:
        """demonet DHT mode: one host per peer and no coordinator; peer 0 starts the DHT, the others join it."""
        from hivemind.p2p import P2P, PeerID

        hosts = [lab.add_host(f"dn{r}", mbit=swarm.mbit[r]) for r in range(setup.peers)]
        _run_toml(out, setup, swarm, encoding, [] if verify is None else [f"verify_slices = {verify}"])
        env = {**os.environ, "DEMONET_TOKEN": secrets.token_urlsafe(16)}
        identity = out / "peer-0.identity"
        if not identity.exists():
            P2P.generate_identity(str(identity))
        port = 7460
        first = f"/ip4/{hosts[0].addr}/tcp/{port}/p2p/{PeerID.from_identity(identity.read_bytes())}"
        cli = [sys.executable, "-m", "demonet", "peer", "--dht", "--run", "bench",
               "--config", str(out / "run.toml"), "--steps", str(setup.steps), "--start-peers", str(setup.peers),
               "--out", str(out), "--threads", "1", "--checkpoint-every", "0"]
        for rank, host in enumerate(hosts):
            where = ["--identity", str(identity), "--host-maddr", f"/ip4/{host.addr}/tcp/{port}"] if rank == 0 else \
                ["--initial-peers", first, "--host-maddr", f"/ip4/{host.addr}/tcp/0"]
            log = _log_file(out, f"peer-{rank}")
            host.popen([*cli, "--peer-id", f"peer-{rank}", *where], stdout=log, stderr=log,
                       stdin=subprocess.DEVNULL, env=_peer_env(env, swarm, rank))
        return Launched(hosts, lambda: _demonet_steps(out, setup.peers), out / "peer-peer-0.pt")

    return launch


def _demonet_steps(out: Path, peers: int) -> list[list[dict[str, Any]]]:
    """A demonet peer's metrics rows as step records. The row of round n ends step n + 1, at the row's
    "time"; step 0, the start of training, is when the first row's round began (its time less its
    round_time_s): the parameters were in place then. Each record also carries the round's blocking torch
    work (compute_s), the time the peer's training waited for the network (wait_s), the samples and
    micro-batches it trained, and whether the round was aborted."""
    steps = []
    for rank in range(peers):
        path = out / f"metrics-peer-{rank}.jsonl"
        rows = MetricsRow.read(path) if path.exists() else []
        records = [{"step": 0, "time": rows[0].time - rows[0].round_time_s, "loss": math.nan}] if rows else []
        records += [{"step": r.round + 1, "time": r.time, "loss": r.loss, "compute_s": r.compute_s,
                     "wait_s": r.wait_s, "samples": r.samples, "micro_batches": r.micro_batches,
                     "aborted": r.aborted} for r in rows]
        steps.append(records)
    return steps


SYSTEMS: dict[str, System] = {s.name: s for s in (
    System("adamw-ddp", "AdamW + DDP (fp32 all-reduce)", launch_ddp),
    System("demonet", "demonet coordinator (fp32 values)", _demonet("fp32")),
    System("demonet-lockstep", "demonet coordinator, lockstep rounds (fp32 values)", _demonet("fp32", lockstep=True)),
    System("demonet-fast-only", "demonet coordinator, the fast peers alone (fp32 values)", _demonet("fp32"),
           fast_only=True),
    System("demonet-bf16", "demonet coordinator (bf16 values)", _demonet("bf16")),
    System("demonet-sign", "demonet coordinator (1-bit values)", _demonet("sign")),
    System("demonet-dht", "demonet DHT mode (fp32 values)", _demonet_dht("fp32")),
    System("demonet-dht-bf16", "demonet DHT mode (bf16 values)", _demonet_dht("bf16")),
    System("demonet-dht-bf16-unverified", "demonet DHT mode (bf16 values, no verified slices)",
           _demonet_dht("bf16", verify=0.0)),
    System("demonet-overlap", "demonet coordinator, overlapped rounds (fp32 values)", _demonet("fp32", overlap=1)),
    System("demonet-overlap-bf16", "demonet coordinator, overlapped rounds (bf16 values)", _demonet("bf16", overlap=1)),
    System("demonet-delay", "demonet coordinator, one-round delay without lookahead", _demonet("fp32", 1, False)),
    System("hivemind", "hivemind.Optimizer (AdamW)", launch_hivemind),
)}
"""The systems `demonet bench` compares, by name. A new one is one more entry."""


def _sampler(lab: Lab, samples: dict[str, list[tuple[float, int, int]]], stop: threading.Event,
             every_s: float) -> None:
    while not stop.is_set():
        _sample(lab, samples)
        stop.wait(every_s)


def _sample(lab: Lab, samples: dict[str, list[tuple[float, int, int]]]) -> None:
    """Every host's link counters, now."""
    for name, host in list(lab.hosts.items()):
        try:
            tx, rx = host.counters()
        except Exception:  # noqa: BLE001 - a host being torn down; the next sample is taken after it
            continue
        samples.setdefault(name, []).append((time.time(), tx, rx))


def run_system(system: System, setup: BenchSetup, swarm: Swarm, out: Path, *,
               on_step: Callable[[int], None] | None = None) -> Run:
    """Train `system` in a fresh lab on `swarm` (its fast peers alone, for a fast-only system) until every peer
    did `setup.steps` steps or the time cap.

    Raises:
        ValueError: `swarm` has not `setup.peers` peers, or a fast-only system's swarm has no fast peer.
    """
    if swarm.peers != setup.peers:
        raise ValueError(f"the swarm has {swarm.peers} peers, the setup {setup.peers}")
    peers = swarm.fast() if system.fast_only else swarm
    setup = dataclasses.replace(setup, peers=peers.peers)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(system.name, swarm.fastest, out, launched_at=time.time(), peer_mbit=list(swarm.mbit),
              slowdown=list(swarm.slowdown))
    stop = threading.Event()
    with Lab() as lab:
        sampler = threading.Thread(target=_sampler, args=(lab, run.samples, stop, 0.5), daemon=True)
        sampler.start()
        try:
            try:
                launched = system.launch(lab, setup, peers, out)
            except RuntimeError as e:  # a system that did not start is a failed run, not a failed bench
                print(f"demonet bench: {system.name} on {swarm.label}: {e}", file=sys.stderr)
                return run
            run.peer_hosts = [h.name for h in launched.peer_hosts]
            procs = [p for h in lab.hosts.values() for p in h.procs]
            deadline = time.monotonic() + setup.max_time_s
            while time.monotonic() < deadline:
                records = launched.records()
                done = min((r[-1]["step"] if r else 0) for r in records)
                if on_step:
                    on_step(done)
                if done >= setup.steps:
                    run.finished = True
                    break
                if any(p.poll() not in (None, 0) for p in procs):
                    break  # a process failed: the logs say why
                time.sleep(1.0)
            if run.finished and launched.final_params:  # written after the last step's record
                _wait_for(launched.final_params, _FINAL_PARAMS_S)
            run.peers = launched.records()
            if run.finished and launched.final_params and launched.final_params.exists():
                run.final_params = launched.final_params
        finally:
            stop.set()
            sampler.join(timeout=10)
            _sample(lab, run.samples)  # one after the last step, however soon the run ended after it
            run.ended_at = time.time()
    return run
