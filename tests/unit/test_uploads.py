"""`Uploads`: a DHT peer's uplink timed by its parts' receipts."""

from __future__ import annotations

import pytest

from demonet.dht.uploads import MIN_S, Uploads


def test_a_peer_slow_to_read_its_parts_says_nothing_of_the_uplink() -> None:
    up = Uploads()
    up.receipt(3, "b", 1000, 0.2)
    up.receipt(3, "b", 1000, 0.5)  # a verifier's part on the same link: the peer's time is its slowest part
    up.receipt(3, "c", 2000, 1.0)
    up.receipt(3, "slow", 4000, 40.0)
    assert up.of(3) == (8000, pytest.approx(8000 / (4000 / 1.0)))  # 4000 bytes read by 1.0 s


def test_an_uplink_that_serves_its_links_one_after_another_is_timed_by_all_of_them() -> None:
    up = Uploads()
    for peer, seconds in (("a", 0.4), ("b", 0.8), ("c", 1.2)):  # 1000 bytes each, served in turn
        up.receipt(5, peer, 1000, seconds)
    assert up.of(5) == (3000, pytest.approx(1.2))


def test_an_uplink_that_serves_its_links_together_is_timed_by_the_last() -> None:
    up = Uploads()
    for peer, seconds in (("a", 1.8), ("b", 1.9), ("c", 2.0)):
        up.receipt(0, peer, 2000, seconds)
    assert up.of(0) == (6000, pytest.approx(2.0))


def test_a_part_read_at_once_counts_its_bytes_but_no_rate() -> None:
    up = Uploads()
    up.receipt(1, "a", 20_000, MIN_S / 10)  # into a shaper's burst
    up.receipt(1, "b", 30_000, 0.4)
    up.receipt(1, "c", 30_000, 0.8)
    # 50 kB read by 0.4 s (the burst's bytes with b's), 80 kB by 0.8 s; no rate at the burst's time
    assert up.of(1) == (80_000, pytest.approx(80_000 / (50_000 / 0.4)))


def test_where_most_peers_read_their_parts_at_once_nothing_is_measured() -> None:
    up = Uploads()
    up.receipt(1, "a", 30_000, MIN_S / 10)  # a fast uplink, or a burst: the two cannot be told apart
    up.receipt(1, "b", 30_000, 0.9)  # a peer slow to read
    assert up.of(1) == (60_000, 0.0)
    up.receipt(2, "a", 30_000, MIN_S / 10)
    up.receipt(2, "b", 30_000, MIN_S / 5)
    up.receipt(2, "c", 30_000, 2.0)
    assert up.of(2) == (90_000, 0.0)


def test_one_other_peer_counts_alone_and_nothing_received_is_none() -> None:
    up = Uploads()
    assert up.of(0) is None
    up.receipt(0, "b", 100, 0.7)
    assert up.of(0) == (100, pytest.approx(0.7))
    up.receipt(1, "b", 0, 0.1)  # an empty part, or a negative time, times nothing
    up.receipt(1, "b", 10, -1.0)
    assert up.of(1) is None


@pytest.mark.parametrize("keep", [1, 4])
def test_only_the_latest_rounds_are_kept(keep: int) -> None:
    up = Uploads(keep=keep)
    for r in range(10):
        up.receipt(r, "b", 100, 0.1)
    assert [r for r in range(10) if up.of(r) is not None] == list(range(10 - keep, 10))
