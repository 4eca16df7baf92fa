"""DHT mode with per-peer keys, over a real hivemind DHT on loopback: an intruder that holds the run token.

Two honest peer processes (`demonet peer --dht --key FILE`) train while an intruder process, with the
token and keys of its own, (a) announces itself in their rounds under an honest peer's id, (b) sends a
slice part and a fetch request as that peer, and, under the allowlist, (c) announces and registers a
key that is not listed under a new id. Its records are ignored and its messages refused; the honest
rounds go on with two contributors and one digest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from demonet.wire.identity import Identity, fingerprint, public_text
from tests.integration.common import tiny_config
from tests.integration.test_dht import TOKEN, WAIT_S, _digests_by_round, _Peers, wait_for
from tests.procs import Reaper

pytest.importorskip("hivemind")
pytestmark = pytest.mark.slow


async def _intrude(maddr: str, victim: str, other: str, keys: dict[str, str], seconds: float) -> dict[str, Any]:
    """The intruder (run by the test in a fresh process): key `keys["x"]` speaks as `victim`; with
    `keys["y"]` (a key not on the allowlist) it also announces and registers as "z"."""
    import asyncio

    from demonet._proto import demonet_pb2 as pb
    from demonet.dht.deadlines import now
    from demonet.dht.gatherer import DhtGatherer, DhtOptions
    from demonet.errors import PeerUnavailable

    opts = DhtOptions(run="keys", token=TOKEN, initial_peers=(maddr,), host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                      exchange_timeout_s=3.0)
    nodes = [await DhtGatherer.create(opts, victim, {}, identity=Identity.load(Path(keys["x"])))]
    if "y" in keys:
        nodes.append(await DhtGatherer.create(opts, "z", {}, identity=Identity.load(Path(keys["y"]))))
    found: dict[str, Any] = {"stored": 0}

    async def call(node: DhtGatherer, address: str, kind: int, r: int, **fields: Any) -> str:
        try:
            await node._node.streams.call(address, kind, r, timeout_s=5.0, **fields)
        except PeerUnavailable as e:
            return str(e)
        return "accepted"

    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while loop.time() < end:
            head = await nodes[0].head_round()
            if head is None:
                await asyncio.sleep(0.2)
                continue
            for node in nodes:  # (a) and (c): announcements in the next rounds, a registration, a state
                n = node._node
                for r in range(head, head + 4):
                    await n.store(n.key("members", r), {"t": now(), "digest": "f" * 32, "address": n.address,
                                                        "client": False})
                    found["stored"] += 1
                await node.register([head + 1, head + 2])
                await n.store(n.key("state", head), {"digest": "f" * 32, "address": n.address, "client": False,
                                                     "expected": None})
            states = await nodes[0]._board.states(head)
            if other in states and "part" not in found:  # (b): as the victim, to the other honest peer
                address = states[other]["address"]
                found["part"] = await call(nodes[0], address, pb.DHT_KIND_PART, head + 1, slice=0,
                                           data=b"\0" * 64, members_digest="m", samples=1)
                found["fetch"] = await call(nodes[0], address, pb.DHT_KIND_FETCH, head, slice=0)
            if len(nodes) > 1 and "unlisted" not in found:
                # "z" reads the records itself, as every caller does before it calls a peer: a reply
                # counts only once the caller knows the replier's key.
                states = await nodes[1]._board.states(head)
                if other in states:
                    found["unlisted"] = await call(nodes[1], states[other]["address"], pb.DHT_KIND_PART,
                                                   head + 1, slice=0, data=b"\0" * 64, members_digest="m",
                                                   samples=1)
            await asyncio.sleep(0.3)
    finally:
        for node in reversed(nodes):
            await asyncio.wait_for(node.close(), 30)
    return found


@pytest.mark.parametrize("admission", ["token", "allowlist"])
def test_an_intruder_with_the_token_cannot_speak_for_a_member(tmp_path: Path, admission: str,
                                                              reap_children: Reaper) -> None:
    keys = {name: tmp_path / f"{name}.key" for name in ("a", "b", "x", "y")}
    publics = {}
    for name, path in keys.items():
        identity = Identity.generate()
        identity.save(path)
        publics[name] = identity.public
    peers = _Peers(tmp_path, reap_children, steps=1000, start_peers=2)
    peers.base[peers.base.index("--run") + 1] = "keys"
    config = tiny_config(round_timeout_s=3.0)
    if admission == "allowlist":
        # "a" names its id; "b" and the intruder's "x" are listed without one (x is a listed member that
        # misbehaves: the first key seen for "b" keeps it); "y" is not listed.
        (tmp_path / "allow").write_text(f"{public_text(publics['a'])} a\n{public_text(publics['b'])}\n"
                                        f"{public_text(publics['x'])}\n")
        config += f'admission = "allowlist"\nallowlist = "{tmp_path / "allow"}"\n'
    (tmp_path / "run.toml").write_text(config)
    peers.start("a", "--key", str(keys["a"]))
    wait_for(lambda: "dht listening on " in peers.log("a"), "a's DHT node", peers)
    peers.maddr = next(ln for ln in peers.log("a").splitlines()
                       if ln.startswith("dht listening on ")).removeprefix("dht listening on ").strip()
    peers.start("b", "--key", str(keys["b"]))
    wait_for(lambda: min(len(peers.rows("a")), len(peers.rows("b"))) >= 3, "three honest rounds", peers)
    before = len(peers.rows("a"))

    intruder_keys = {"x": str(keys["x"])} | ({"y": str(keys["y"])} if admission == "allowlist" else {})
    code = ("import asyncio, json, sys; from tests.integration.test_dht_keys import _intrude; "
            "print(json.dumps(asyncio.run(_intrude(*json.loads(sys.argv[1])))))")
    argv = json.dumps([peers.maddr, "b", "a", intruder_keys, 12.0])
    proc = reap_children.add(subprocess.Popen([sys.executable, "-c", code, argv], stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2],
                                              start_new_session=True), group=True)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err[-3000:] + peers.dump()
    found = json.loads(out.strip().splitlines()[-1])
    wait_for(lambda: len(peers.rows("a")) >= before + 6, "rounds during and after the intrusion", peers)
    # The two stop one after the other: the one that stops last may run rounds alone once the other left.
    before_stop = {name: len(peers.rows(name)) for name in ("a", "b")}
    peers.stop(["a", "b"])
    assert all(peers.procs[n].returncode == 0 for n in ("a", "b")), peers.dump()

    # (a) Announcements as "b" under another key are ignored: every round has a and b, one digest.
    assert found["stored"] > 0
    rows = {name: peers.rows(name) for name in ("a", "b")}
    digests = _digests_by_round([r for rs in rows.values() for r in rs])
    assert all(len(d) == 1 for d in digests.values()), {k: v for k, v in digests.items() if len(v) > 1}
    assert all(r["contributors"] == 2 and not r.get("resynced")
               for name, rs in rows.items() for r in rs[1:before_stop[name]]), rows
    assert f"ignored the records of key {fingerprint(publics['x'])} as b" in peers.log("a"), peers.log("a")
    # (b) A part and a fetch request signed by the intruder's key as "b": refused by "a".
    assert "bad signature" in found["part"] and "bad signature" in found["fetch"], found
    assert "bad signature: not 'b'" in peers.log("a")
    if admission == "allowlist":
        # (c) An unlisted key's records never count: "z" is never a member, and its messages are refused.
        assert f"ignored the records of key {fingerprint(publics['y'])} as z (not on the allowlist)" in peers.log("a")
        assert "unknown sender 'z'" in found["unlisted"], found
