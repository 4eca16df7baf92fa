"""Calls per round from `sitecustomize.py`'s counts: `python bench/dht_calls/report.py RUN_OUT CALLS_OUT`.

For each process with a DHT node (a peer): the calls made and served per round between rounds 20 and the
last (by peer 0's rows), with the mean protobuf bytes of a served call's request and answer; then each
peer's exchange bytes and DHT reads per round from its metrics rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(run: Path, calls: Path) -> None:
    folder = next(p for p in run.iterdir() if p.is_dir() and p.name.startswith("demonet-dht"))
    rows = _rows(folder / "metrics-peer-0.jsonl")
    first, last = rows[20], rows[-1]
    n = last["round"] - first["round"]
    print(f"{folder.name}: rounds {first['round']}..{last['round']}")
    for path in sorted(calls.glob("calls-*.jsonl")):
        snaps = _rows(path)
        a = max((s for s in snaps if s["t"] <= first["time"]), key=lambda s: s["t"], default={})
        b = max((s for s in snaps if s["t"] <= last["time"]), key=lambda s: s["t"])
        per = {k: (b[k][0] - a.get(k, [0])[0]) / n for k in b if k != "t"}
        sizes = {k: (round((b[k][1] - a.get(k, [0, 0, 0])[1]) / max(1, b[k][0] - a.get(k, [0])[0])),
                     round((b[k][2] - a.get(k, [0, 0, 0])[2]) / max(1, b[k][0] - a.get(k, [0])[0])))
                 for k in b if k.startswith("rpc_")}
        print(f"  {path.name}: per round {', '.join(f'{k} {v:.1f}' for k, v in sorted(per.items()))}; "
              f"served request/answer B {sizes}")
    for path in sorted(folder.glob("metrics-peer-*.jsonl")):
        peer = [r for r in _rows(path) if r["round"] >= first["round"]]
        print(f"  {path.name}: exchange up {sum(r['bytes_up'] for r in peer) / len(peer):,.0f} B, down "
              f"{sum(r['bytes_down'] for r in peer) / len(peer):,.0f} B, DHT reads "
              f"{sum(r['phases']['dht_reads'] for r in peer) / len(peer):.2f} a round")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
