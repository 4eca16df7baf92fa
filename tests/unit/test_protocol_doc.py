"""docs/protocol.md against the code: its table of signed statements lists every kind the code signs, with the
code's field types in order; its protocol version is the code's; and the proto's comments point to the docs,
never to a Python module."""

from __future__ import annotations

import json
import re
from pathlib import Path

from demonet.wire.params import PROTOCOL

ROOT = Path(__file__).parents[2]
DOC = (ROOT / "docs" / "protocol.md").read_text()


def _statement_rows() -> dict[str, list[str]]:
    """kind -> the type tags of its fields, from the table under "Signed statements"."""
    section = DOC.split("### Signed statements", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`[a-z-]+`", cells[0]):
            rows[cells[0].strip("`")] = re.findall(r"`([bifsy])` ", cells[1])
    return rows


def test_the_statement_table_matches_the_code() -> None:
    vectors = json.loads((ROOT / "tests" / "vectors" / "statements.json").read_text())["vectors"]
    want = {v["kind"]: [f["tag"] for f in v["fields"]] for v in vectors}
    assert _statement_rows() == want


def test_the_documented_protocol_version_is_the_codes() -> None:
    assert f"| the protocol | **{PROTOCOL}** |" in DOC


def test_no_proto_comment_names_a_python_module() -> None:
    comments = [line.split("//", 1)[1] for line in (ROOT / "proto" / "demonet.proto").read_text().splitlines()
                if "//" in line]
    named = [c for c in comments
             if ".py" in c or re.search(r"demonet/(wire|dht|coordinator|optim|transport)", c)
             or re.search(r"\bdemonet\.(?!v\d|dht\.v\d|dht\.link\.v\d)[a-z_]+", c)]
    assert named == []
