"""The `/status.json` document's fields and their types (docs/dashboard.md), checked by the unit and
integration tests of the dashboard."""

from __future__ import annotations

from typing import Any

from demonet.dashboard.record import MAX_LISTED

NUMBER = (int, float)
OPT_NUMBER = (int, float, type(None))
OPT_INT = (int, type(None))

TOP = {"schema": int, "mode": str, "source": str, "time": NUMBER, "uptime_s": NUMBER, "run": dict, "rounds": list,
       "members": list, "members_omitted": dict, "refusals": list}
RUN = {"round": int, "phase": str, "seconds_left": OPT_NUMBER, "members": int, "idle": OPT_INT, "joiners": OPT_INT,
       "submitted": OPT_INT, "rounds_closed": int, "rounds_aborted": int, "total_rounds": int,
       "last_loss": OPT_NUMBER, "param_digest": str, "bytes_up": int, "bytes_down": int, "rejected": int,
       "late": OPT_INT, "clipped": OPT_INT, "capped": OPT_INT, "resyncs": int, "unauthorized": OPT_INT,
       "round_timeout_s": NUMBER, "round_length_s": OPT_NUMBER}
ROUND = {"round": int, "time": NUMBER, "aborted": bool, "loss": OPT_NUMBER, "round_s": OPT_NUMBER,
         "close_s": OPT_NUMBER, "members": int, "contributors": int, "bytes_up": int, "bytes_down": int}
MEMBER = {"id": str, "key": (str, type(None)), "state": str, "last_seen_s": NUMBER, "contributed": int, "missed": int,
          "resyncs": int,
          "last_loss": OPT_NUMBER, "bytes_up": OPT_INT, "bytes_down": OPT_INT, "link_bps": OPT_NUMBER,
          "slices": OPT_INT, "samples": OPT_INT, "weight": OPT_NUMBER, "topk": OPT_INT, "upload_s": OPT_NUMBER,
          "need_s": OPT_NUMBER, "micro_batches": OPT_INT, "compute_s": OPT_NUMBER}
REFUSAL = {"time": NUMBER, "peer": str, "round": OPT_INT, "kind": str, "reason": str}
# In coordinator mode these are always numbers (DHT mode has no such things, and says null).
COORDINATOR_RUN_NUMBERS = ("idle", "joiners", "submitted", "late", "clipped", "capped", "unauthorized")
STATES = {"coordinator": {"member", "submitted", "idle", "spanning", "new", "joining", "left"},
          "dht": {"member", "missed", "resync", "excluded", "left"}}


def _typed(obj: dict[str, Any], fields: dict[str, Any], where: str) -> None:
    assert set(obj) == set(fields), f"{where}: fields {sorted(set(obj) ^ set(fields))} differ"
    for name, kind in fields.items():
        value = obj[name]
        assert isinstance(value, kind) and not (kind is int and isinstance(value, bool)), \
            f"{where}.{name} = {value!r} is not {kind}"


def check_document(doc: dict[str, Any], mode: str) -> None:
    """Every field of the document present, and of its type; the states are the mode's."""
    _typed(doc, TOP, "document")
    assert doc["schema"] == 1 and doc["mode"] == mode
    _typed(doc["run"], RUN, "run")
    if mode == "coordinator":
        assert all(isinstance(doc["run"][k], int) for k in COORDINATOR_RUN_NUMBERS), doc["run"]
        assert isinstance(doc["run"]["round_length_s"], NUMBER), doc["run"]
    for i, row in enumerate(doc["rounds"]):
        _typed(row, ROUND, f"rounds[{i}]")
    for i, member in enumerate(doc["members"]):
        _typed(member, MEMBER, f"members[{i}]")
        assert member["state"] in STATES[mode], member
    assert len(doc["members"]) <= MAX_LISTED, len(doc["members"])
    for state, count in doc["members_omitted"].items():
        assert state in STATES[mode] and isinstance(count, int) and count > 0, doc["members_omitted"]
    assert not doc["members_omitted"] or len(doc["members"]) == MAX_LISTED, "members omitted while room was left"
    for i, refusal in enumerate(doc["refusals"]):
        _typed(refusal, REFUSAL, f"refusals[{i}]")
