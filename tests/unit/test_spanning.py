"""The weight of a DHT peer's rounds while its micro-batch spans them (`demonet.loop.spanning.share`): each round
weighs the part of the micro-batch that ran in it, and the rounds of one micro-batch weigh its samples together."""

from __future__ import annotations

import asyncio

from demonet.loop.spanning import share
from demonet.loop.state import SpanJob


def _job(mark: float) -> SpanJob:
    loop = asyncio.new_event_loop()
    try:
        return SpanJob(loop.create_future(), round=3, mark=mark)
    finally:
        loop.close()


def test_a_micro_batch_over_four_rounds_weighs_its_samples_in_all() -> None:
    """32 samples, 1.0 s a micro-batch, rounds ending at 0.3, 0.55 and 0.8 s, and it ends in the fourth at 1.05 s."""
    job = _job(mark=0.0)
    weights = [share(job, 32, 1.0, ended=False, now=t) for t in (0.3, 0.55, 0.8)]
    weights.append(share(job, 32, 1.0, ended=True, now=1.05))
    assert weights == [10, 8, 8, 6] and sum(weights) == 32 and job.claimed == 32


def test_a_micro_batch_over_more_rounds_than_samples_weighs_one_a_round() -> None:
    """4 samples over 6 rounds: at least 1 a round, and never all of them before it ends."""
    job = _job(mark=0.0)
    weights = [share(job, 4, 1.0, ended=False, now=t) for t in (0.5, 0.6, 0.7, 0.8, 0.9)]
    weights.append(share(job, 4, 1.0, ended=True, now=1.0))
    assert weights == [2, 1, 1, 1, 1, 1]


def test_an_unmeasured_micro_batch_weighs_one_until_it_ends() -> None:
    job = _job(mark=0.0)
    assert [share(job, 16, 0.0, ended=False, now=t) for t in (0.2, 0.4)] == [1, 1]
    assert share(job, 16, 0.0, ended=True, now=0.6) == 14
