"""DHT mode, the exchange's verifier: one merge per (slice, senders), shared by the verifier's own check
and the members' check requests. A request whose caller goes away (a killed peer drops its stream, and
the stream's handler is cancelled) must not cancel the merge the others wait for: it did, and the
verifier itself then died of the CancelledError (seen in the kill test). No sockets; the parts are
held back by a stand-in for `_merged` so that the cancel lands mid-merge.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from demonet.dht.exchange import SliceExchange, _Round
from demonet.dht.streams import DhtOptions


def _exchange() -> SliceExchange:
    streams = SimpleNamespace(serve=lambda *_: None)
    node = SimpleNamespace(opts=DhtOptions(run="r", token="t"), peer_id="a", streams=streams)
    return SliceExchange(node)  # type: ignore[arg-type]


@pytest.mark.timeout(10)
async def test_a_cancelled_check_request_leaves_the_shared_merge_to_the_others(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    ex, st = _exchange(), _Round()
    started, release = asyncio.Event(), asyncio.Event()
    calls = []

    async def held_merge(r: int, st_: _Round, s: int, senders: tuple[str, ...]) -> None:
        calls.append((r, s, senders))
        started.set()
        await release.wait()
        return None  # a part is missing: the digest is None

    monkeypatch.setattr(ex, "_merged", held_merge)
    senders = ("a", "b")
    request = asyncio.ensure_future(ex._digest_over(3, st, 0, senders))  # a member's check request
    own = asyncio.ensure_future(ex._digest_over(3, st, 0, senders))  # this peer's own check
    await started.wait()
    request.cancel()  # its caller went away
    await asyncio.sleep(0)
    release.set()
    assert await own is None  # the merge ran to its end for the own check
    with pytest.raises(asyncio.CancelledError):
        await request
    assert await ex._digest_over(3, st, 0, senders) is None  # kept: asked again, not merged again
    assert calls == [(3, 0, senders)]
