"""The Node client of examples/node, written from docs/protocol.md, against a real coordinator process with a
real Python peer training beside it: it joins with its own key, heartbeats, checks the parameters' digest,
decodes an aggregate to the same indices and values as demonet's own decoder, and leaves. Its byte-level code
also passes the committed test vectors. Skips where node or the npm modules (npm ci in examples/node) are missing."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from demonet import wire
from demonet._proto import demonet_pb2 as pb
from demonet._proto import demonet_pb2_grpc as pbg
from demonet.wire.params import PROTOCOL
from tests.integration.common import tiny_config
from tests.integration.test_coordinator import TOKEN, Coordinator
from tests.procs import Reaper

pytestmark = pytest.mark.slow

NODE_DIR = Path(__file__).parents[2] / "examples" / "node"
NODE = shutil.which("node")
if NODE is None:
    pytest.skip("node is not installed", allow_module_level=True)
if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
    pytest.skip("the Node client's modules are not installed (npm ci in examples/node)", allow_module_level=True)


def _node(*argv: str, timeout_s: float) -> dict[str, object]:
    done = subprocess.run([str(NODE), *argv], cwd=NODE_DIR, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _summary(data: bytes) -> str:
    """The client's summary of a payload (SHA-256 over each tensor's indices as u32 and values as float32), from
    demonet's own decoder."""
    h = hashlib.sha256()
    for c in wire.decode(data)[1].tensors.values():
        h.update(c.idx.numpy().astype("<u4").tobytes())
        h.update(c.val.numpy().astype("<f4").tobytes())
    return h.hexdigest()


async def _status(address: str) -> pb.StatusReply:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pbg.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        return await stub.Status(pb.StatusRequest(detail=True), metadata=(("authorization", f"Bearer {TOKEN}"),),
                                 timeout=10)


def test_node_client_passes_the_vectors() -> None:
    """Every vector of tests/vectors/, checked by the Node client's own code."""
    counts = {name: len(json.loads((NODE_DIR.parents[1] / "tests" / "vectors" / f"{file}.json").read_text())["vectors"])
              for name, file in (("statements", "statements"), ("digests", "parameters"), ("payloads", "payloads"))}
    assert counts["statements"] >= 9  # every kind, the aggregate's included
    assert _node("check_vectors.js", timeout_s=60) == counts


def test_node_client_joins_a_real_run(tmp_path: Path, reap_children: Reaper) -> None:
    coordinator = Coordinator(tmp_path, reap_children)
    (tmp_path / "run.toml").write_text(tiny_config(round_timeout_s=2.0, steps=1_000_000, heartbeat_timeout_s=30.0))
    address = coordinator.start()
    peer = reap_children.add(subprocess.Popen(
        [sys.executable, "-m", "demonet", "peer", "--coordinator", address, "--peer-id", "py", "--out",
         str(tmp_path / "py"), "--threads", "1"], stdout=subprocess.DEVNULL,
        stderr=reap_children.open(tmp_path / "py.log", "a"), env={**os.environ, "DEMONET_TOKEN": TOKEN}))
    deadline = time.monotonic() + 60
    while asyncio.run(_status(address)).rounds_closed < 2:  # the Python peer trains
        assert peer.poll() is None and time.monotonic() < deadline, (tmp_path / "py.log").read_text()[-3000:]
        time.sleep(0.2)
    saved = tmp_path / "aggregate.bin"
    got = _node("client.js", "--address", address, "--token", TOKEN, "--peer-id", "node-1", "--save-aggregate",
                str(saved), timeout_s=120)
    params, agg = got["parameters"], got["aggregate"]
    assert isinstance(params, dict) and isinstance(agg, dict)
    assert got["protocol"] == PROTOCOL and got["joined_round"] >= 2 and got["heartbeats"] >= 2 and got["member"] is True
    assert params["digest_ok"] is True and params["round"] == got["joined_round"]
    assert agg["round"] == got["joined_round"] - 1 and agg["contributors"] == ["py"] and not agg["aborted"]
    assert agg["step"] == agg["round"] and agg["entries"] > 0 and agg["tensors"] > 0
    assert agg["summary_sha256"] == _summary(saved.read_bytes())  # Node's decode is demonet's, bit for bit
    assert got["trailer_is_parameters_digest"] is True and got["left"] is True
    status = asyncio.run(_status(address))
    keys = {m["id"]: m.get("key") for m in json.loads(status.detail_json)["members"]}
    public = bytes.fromhex(str(got["public_key"]))
    assert keys.get("node-1") == hashlib.sha256(public).hexdigest()[:16]  # its own key, as the coordinator saw it
    assert "node-1" not in status.members and "py" in status.members and peer.poll() is None
    assert np.isfinite(status.last_loss)
