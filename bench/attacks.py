"""Benchmark: what a token holder can make a coordinator do, and whether the honest peers notice (issue 59).

One `demonet coordinator` process and 2 real `demonet peer` processes train the tiny model on loopback. Per
attack, K alternating pairs of equal windows: the honest rounds without the attack, then with it (the order
swapped every other pair, so that a drift of the machine cancels). Each attack runs from a process of its
own (bench/attackers.py):
- `streams`: raw HTTP/2 Submit streams from 8 source addresses, 8 each, every one declaring the server's
  largest message and sending all of it but one byte, opened again as they end (a memory attack);
- `aggregates`: unsigned GetAggregate calls, 8 at a time;
- `sybil`: a fresh peer id with a fresh key every round, joined and heartbeated, never a payload;
- `replays`: a member of the attacker's own sends each signed Heartbeat, GetParameters, GetAggregate and
  Leave twice (the same bytes), and the Leave of its session before after each rejoin.
Per attack it prints the median over the pairs of the honest rounds' median time with / without (each
pair's too), the coordinator's RSS (median in the windows without, peak in those with), and what the
attacker saw; then the same with the attacker on core 1 and the coordinator and peers on core 0. The round
times come from the coordinator's status document (the rounds that opened and closed inside a window).
Run from the repo root: `python bench/attacks.py`. Prints tables; not a test. `--smoke`: one pair of 2 s
windows, a check that the script runs.

`--flood` and `--aggregates` run one attacker alone and print its JSON (tests/integration/test_attacks.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attackers import aggregates, flood, replays, streams, sybil  # noqa: E402

from demonet._proto import demonet_pb2 as pb  # noqa: E402
from demonet._proto import demonet_pb2_grpc as pbg  # noqa: E402

TOKEN = "attacks-token"
ATTACKS = ("streams", "aggregates", "sybil", "replays")
MEMORY = ("streams",)
"""The memory attacks: their RSS ratio has a goal (<= 1.5x)."""
WAITED = ("member", "submitted")
"""The states of a member the open round waits for (docs/dashboard.md); "new" is not waited on."""


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _status(address: str) -> dict[str, Any]:
    async def ask() -> dict[str, Any]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub: Any = pbg.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
            reply = await stub.Status(pb.StatusRequest(detail=True), metadata=(("authorization", f"Bearer {TOKEN}"),),
                                      timeout=10)
            document: dict[str, Any] = json.loads(reply.detail_json)
            return document
    return asyncio.run(ask())


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` onto `cpus` (threads it starts later inherit its creator's)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, FileNotFoundError):
            pass  # a thread that ended meanwhile


def _largest_message(run_toml: Path) -> int:
    """The largest gRPC message the run's coordinator reads (the most one held stream can cost it)."""
    from demonet.config import load_config
    from demonet.coordinator.limits import LimitsConfig, submission_bound
    from demonet.coordinator.state import CanonicalState

    cfg = load_config(run_toml, env={})
    bound = submission_bound(CanonicalState(cfg).specs, cfg.optim.compression_topk)
    return LimitsConfig(max_submission_bytes=bound, max_inflight_bytes=bound, download_every_s=1.0).max_message_bytes


@dataclass
class Window:
    """One window's measurements: the honest rounds inside it and the coordinator's RSS samples."""

    round_s: list[float] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)
    waited_sybils: int = 0
    """Ids of the sybil attacker in a waited-on state (`WAITED`), the most seen at once."""
    new: int = 0
    """Members shown "new" (no accepted work, not waited on), the most seen at once."""

    @property
    def median_s(self) -> float:
        return statistics.median(self.round_s) if self.round_s else float("nan")


def _states(document: dict[str, Any], window: Window) -> None:
    """Count the members the document shows "new", and the sybil ids the rounds wait for."""
    listed = document["members"]
    omitted = document.get("members_omitted", {})
    new = sum(m["state"] == "new" for m in listed) + omitted.get("new", 0)
    # The honest peers have contributed, so they are listed first: an omitted waited-on member is a sybil.
    waited = sum(m["state"] in WAITED and m["id"].startswith("sybil-") for m in listed) + sum(
        omitted.get(s, 0) for s in WAITED)
    window.new, window.waited_sybils = max(window.new, new), max(window.waited_sybils, waited)


def _window(address: str, coordinator: int, seconds: float) -> Window:
    """Sample the coordinator's RSS every 50 ms for `seconds`, its document halfway and at the end; the
    rounds that opened and closed inside the window."""
    window, begin = Window(), time.time()
    half = False
    while time.time() < begin + seconds:
        window.rss_mib.append(_rss_mib(coordinator))
        if not half and time.time() >= begin + seconds / 2:
            half = True
            _states(_status(address), window)
        time.sleep(0.05)
    end = time.time()
    document = _status(address)
    _states(document, window)
    window.round_s = [r["round_s"] for r in document["rounds"] if r["round_s"] is not None
                      and r["time"] <= end and r["time"] - r["round_s"] >= begin]
    return window


def _attacked(args: argparse.Namespace, name: str, address: str, coordinator: int, pinned: bool
              ) -> tuple[Window, dict[str, Any]]:
    """A window with attacker `name` running (on core 1 if `pinned`); what it printed at its end."""
    argv = [sys.executable, __file__, "--attacker", name, "--coordinator", address, "--hold-s", str(args.window_s),
            "--declared", str(args.declared), "--addresses", str(args.addresses)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, preexec_fn=(lambda: os.sched_setaffinity(0, {1}))
                            if pinned else None)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"the {name} attacker did not start")
    window = _window(address, coordinator, args.window_s)
    out, _ = proc.communicate(timeout=120)
    return window, json.loads(out or b"{}")


@dataclass
class Row:
    """One attack's pairs under one placement of the processes."""

    attack: str
    pinned: bool
    pairs: list[tuple[Window, Window]] = field(default_factory=list)  # (without, with)
    attacker: list[dict[str, Any]] = field(default_factory=list)

    def ratios(self) -> list[float]:
        """Per pair: the honest rounds' median time with / without (inf: no round inside the window with)."""
        return [with_.median_s / without.median_s if with_.round_s else float("inf") for without, with_ in self.pairs]

    def rounds(self) -> tuple[int, int]:
        """The honest rounds inside the windows without and with, in all."""
        return sum(len(w.round_s) for w, _ in self.pairs), sum(len(w.round_s) for _, w in self.pairs)

    def rss(self) -> tuple[float, float]:
        """The coordinator's RSS: the median of the windows without, the peak of those with."""
        return (statistics.median(x for without, _ in self.pairs for x in without.rss_mib),
                max(x for _, with_ in self.pairs for x in with_.rss_mib))


def _row(args: argparse.Namespace, attack: str, address: str, coordinator: int, pinned: bool) -> Row:
    row = Row(attack, pinned)
    for k in range(args.pairs):
        got: dict[bool, Window] = {}
        for attacked in ((False, True) if k % 2 == 0 else (True, False)):
            if attacked:
                got[True], out = _attacked(args, attack, address, coordinator, pinned)
                row.attacker.append(out)
            else:
                got[False] = _window(address, coordinator, args.window_s)
        row.pairs.append((got[False], got[True]))
    return row


def _print(row: Row) -> None:
    base, peak = row.rss()
    ratios = row.ratios()
    without = statistics.median(w.median_s for w, _ in row.pairs)
    rounds = "{}/{}".format(*row.rounds())
    print(f"{row.attack:<12}{'core 1' if row.pinned else 'shared':<8}{statistics.median(ratios):>7.2f}x  "
          f"{' '.join(f'{r:.2f}' for r in ratios):<18}{without * 1000:>8.1f}{rounds:>10}{base:>8.0f}{peak:>8.0f}"
          f"{peak / base:>7.2f}x  {json.dumps(_summary(row))}", flush=True)


def _summary(row: Row) -> dict[str, Any]:
    """What the attacker saw over its windows, summed."""
    total: dict[str, Any] = {}
    for out in row.attacker:
        _add(total, out)
    if row.attack == "sybil":
        total["waited_on"] = max(w.waited_sybils for _, w in row.pairs)
        total["new_at_most"] = max(w.new for _, w in row.pairs)
    return total


def _add(total: dict[str, Any], more: dict[str, Any]) -> None:
    for key, value in more.items():
        if key == "declared":
            total[key] = value
        elif isinstance(value, dict):
            _add(total.setdefault(key, {}), value)
        elif isinstance(value, int | float):
            total[key] = total.get(key, 0) + value


def _run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="attacks-"))
    # newcomer_s: the sybil ids of one window are let go within two windows, so each window's attacker
    # finds room for its own ids, as a fresh attacker would (the default 600 s would refuse later windows).
    (tmp / "run.toml").write_text("[model]\nd_model = 32\nn_layers = 1\nn_heads = 2\nseq_len = 32\n[train]\n"
                                  "seq_len = 32\nbatch_size = 2\nsteps = 100000\n[net]\nround_timeout_s = 2.0\n"
                                  f"newcomer_s = {2 * args.window_s + 1}\n")
    args.declared = _largest_message(tmp / "run.toml")
    env = {**os.environ, "DEMONET_TOKEN": TOKEN, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    coordinator = subprocess.Popen([sys.executable, "-m", "demonet", "coordinator", "--listen", "127.0.0.1:0",
                                    "--config", str(tmp / "run.toml"), "--start-peers", "2"],
                                   stdout=subprocess.PIPE, stderr=open(tmp / "coordinator.log", "w"), env=env)
    assert coordinator.stdout is not None
    address = coordinator.stdout.readline().decode().split()[-1]
    peers = [subprocess.Popen([sys.executable, "-m", "demonet", "peer", "--coordinator", address, "--peer-id", p,
                               "--out", str(tmp / "out"), "--threads", "1"], stdout=subprocess.DEVNULL,
                              stderr=open(tmp / f"{p}.log", "w"), env=env) for p in ("p1", "p2")]
    rows = []
    try:
        while _status(address)["run"]["rounds_closed"] < 3:
            time.sleep(0.5)
        print(f"a coordinator and 2 peers (tiny model, 1 thread each), {os.cpu_count()} CPUs, loopback; "
              f"{args.pairs} alternating pairs of {args.window_s:g} s windows per attack; each stream declares "
              f"{args.declared:,} B (the server's largest message), {args.addresses} source addresses; rounds: the "
              "honest rounds inside the windows without / with")
        print(f"{'attack':<12}{'cores':<8}{'ratio':>8}  {'each pair':<18}{'ms w/o':>8}{'rounds':>10}{'RSS MiB':>8}"
              f"{'peak':>8}{'ratio':>8}  attacker")
        for pinned in (False, True):
            for proc in [coordinator, *peers]:
                _pin(proc.pid, {0} if pinned else set(range(os.cpu_count() or 1)))
            for attack in args.attacks:
                rows.append(_row(args, attack, address, coordinator.pid, pinned))
                _print(rows[-1])
    finally:
        for proc in [*peers, coordinator]:
            proc.terminate()
        for proc in [*peers, coordinator]:
            proc.wait(timeout=30)
    _verdicts(rows)


def _verdicts(rows: list[Row]) -> None:
    """The issue's goals, each met or not."""
    for row in rows:
        ratio = statistics.median(row.ratios())
        base, peak = row.rss()
        where = "pinned" if row.pinned else "shared"
        rss = f", RSS {peak / base:.2f}x (<= 1.5x: {'met' if peak <= 1.5 * base else 'NOT met'})" \
            if row.attack in MEMORY else ""
        print(f"{row.attack} ({where}): honest rounds {ratio:.2f}x (<= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'})"
              f"{rss}")
    for row in rows:
        if row.attack == "replays":
            total = _summary(row)
            print(f"replays accepted ({'pinned' if row.pinned else 'shared'}): " + ", ".join(
                f"{kind} {total['accepted'][kind]} of {total['replays'][kind]}" for kind in total["replays"]))
        elif row.attack == "sybil":
            total = _summary(row)
            print(f"sybil members waited on ({'pinned' if row.pinned else 'shared'}): {total['waited_on']} "
                  f"(ids joined {total.get('joined', 0)}, shown \"new\" at most {total['new_at_most']})")


async def _attack_alone(args: argparse.Namespace) -> dict[str, Any]:
    """One attacker for `args.seconds` (bench/attackers.py)."""
    if args.flood:
        return await flood(args.coordinator, args.token, streams=args.streams, declared=args.declared,
                           hold_s=args.seconds)
    if args.aggregates or args.attacker == "aggregates":
        return await aggregates(args.coordinator, args.token, seconds=args.seconds)
    if args.attacker == "streams":
        return await streams(args.coordinator, args.token, seconds=args.seconds, declared=args.declared,
                             addresses=args.addresses)
    attack = sybil if args.attacker == "sybil" else replays
    return await attack(args.coordinator, args.token, seconds=args.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="one pair of 2 s windows: a check that it runs")
    parser.add_argument("--pairs", type=int, default=3, help="alternating pairs per attack (3)")
    parser.add_argument("--window-s", type=float, default=10.0, help="each window's length (10)")
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    parser.add_argument("--attacker", choices=ATTACKS, help="one attacker alone: prints ready, then JSON")
    parser.add_argument("--streams", type=int, default=32, help="--flood: the streams on its one connection")
    parser.add_argument("--seconds", "--hold-s", dest="seconds", type=float, default=15.0)
    parser.add_argument("--flood", action="store_true", help="the streams attacker alone (prints JSON)")
    parser.add_argument("--aggregates", action="store_true", help="the GetAggregate attacker alone (prints JSON)")
    parser.add_argument("--coordinator", help="HOST:PORT of the coordinator the attacker calls")
    parser.add_argument("--token", default=os.environ.get("DEMONET_TOKEN", TOKEN))
    parser.add_argument("--addresses", type=int, default=8, help="streams: the source addresses, 8 streams each (8: "
                        "the coordinator's 64 Submit calls in all)")
    parser.add_argument("--declared", type=int, default=16 << 20, help="the size each stream's message declares")
    args = parser.parse_args()
    if args.flood or args.aggregates or args.attacker:
        if args.attacker:
            print("ready", flush=True)
        print(json.dumps(asyncio.run(_attack_alone(args))), flush=True)
        return
    if args.smoke:
        args.pairs, args.window_s = 1, 2.0
    _run(args)


if __name__ == "__main__":
    main()
