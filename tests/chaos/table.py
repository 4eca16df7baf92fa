"""Print the chaos table of docs/testing.md from the figures the chaos tests wrote:

    DEMONET_CHAOS_REPORT=runs/chaos python -m pytest -q tests/chaos && python -m tests.chaos.table runs/chaos
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROWS = [  # figures file, scenario
    ("heterogeneous_links", "peers at 100, 20, 2 Mbit/s"),
    ("peer_sigkill_restart", "a peer SIGKILLed in 3 rounds, restarted"),
    ("coordinator_sigkill_restart", "the coordinator SIGKILLed, restarted"),
    ("partition_heal", "a peer cut off for several rounds, healed"),
    ("late_joiner_slow_link", "a late joiner over 2 Mbit/s"),
    ("bad_input", "bad input at every RPC, wrong/no token"),
    ("poisoning", "a poisoner (random x1000), clipping on / off"),
    ("dht_peer_sigkill_restart", "DHT mode: a peer SIGKILLed (with its p2pd), restarted"),
    ("dht_partition", "DHT mode: a peer cut off until the run ends"),
    ("dht_partition_heal", "DHT mode: a peer cut off for 8+ rounds, healed"),
    ("dht_split_two_two", "DHT mode: four peers split two against two, healed"),
]


def _row(name: str, f: dict[str, Any]) -> tuple[str, str, str, str, str]:
    done = f.get("rounds_completed", {})
    completed = " / ".join(f"{p} {n}" for p, n in done.items())
    lost = str(f.get("rounds_lost", "-"))
    recover, bad = "-", "-"
    if name == "heterogeneous_links":
        recover = (f"slow peer missed {f['slow_missed']} rounds, in sync via {f['slow_parameter_downloads']} "
                   f"downloads; longest round {f['max_round_time_s']} s")
    elif name == "peer_sigkill_restart":
        recover = f"back {max(e['back_in_round'] - e['killed_in_round'] for e in f['events'])} rounds after a kill " \
                  f"at most; rejoin {f['rejoin_s_max']} s after restart"
    elif name == "coordinator_sigkill_restart":
        recover = f"{f['time_to_recover_s']} s from the kill (down {f['down_s']} s)"
    elif name == "partition_heal":
        recover = f"{f['time_to_recover_s']} s after the heal; {f['rounds_during_partition']} rounds went on meanwhile"
    elif name == "dht_peer_sigkill_restart":
        recover = f"back in round {f['back_in_round']} (killed in {f['killed_in_round']}), {f['rejoin_s']} s after " \
                  f"restart; {f['rounds_without_c']} rounds went on meanwhile"
    elif name == "dht_partition":
        recover = f"{f['rounds_during_partition']}+ rounds went on without it; after the cut it applied " \
                  f"{f['c_applied_after_cut']} rounds (with the others' payloads; then no majority: it waits)"
    elif name == "dht_partition_heal":
        recover = f"in sync {f['heal_to_sync_s']} s after the heal (round {f['c_back_in_round']}); it lost " \
                  f"{f['c_rounds_lost']} rounds, {f['majority_rounds_heal_to_sync']} went on meanwhile"
    elif name == "dht_split_two_two":
        recover = f"{f['rounds_applied_while_split']} rounds applied while split; all four in round " \
                  f"{f['together_in_round']}, {f['heal_to_together_s']} s after the heal"
    elif name == "late_joiner_slow_link":
        recover = f"{f['parameter_bytes']} B downloaded, first round {f['time_to_first_round_s']} s after joining"
    elif name == "bad_input":
        bad = f"{f['bad_inputs_tried']} / {f['bad_inputs_accepted']}"
    elif name == "poisoning":
        on, off = f["clip_on"], f["clip_off"]
        completed = f"{f['rounds']} rounds, 4 peers"
        recover = f"honest loss {on['loss_first5']} -> {on['loss_last5']} clipped, {off['loss_first5']} -> " \
                  f"{off['loss_last5']} unclipped"
        bad = f"well formed, so taken; clipped in {on['mallory_clipped_rounds']} of {f['rounds']} rounds"
    return completed, lost, recover, bad, str(f.get("rounds", ""))


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/chaos")
    print("| scenario | rounds completed | rounds lost | recovery | bad inputs tried / accepted |")
    print("|---|---|---|---|---|")
    for name, label in ROWS:
        path = folder / f"{name}.json"
        if not path.exists():
            print(f"| {label} | (not run) | | | |")
            continue
        completed, lost, recover, bad, _ = _row(name, json.loads(path.read_text()))
        print(f"| {label} | {completed} | {lost} | {recover} | {bad} |")


if __name__ == "__main__":
    main()
