"""A DHT peer slower than a round by its compute (`RoundResult.spans`): its micro-batch runs across rounds, on a copy
of the parameters taken as it starts, while the peer takes part in every round with what its momentum holds.

DHT mode has no late payloads: every frozen member sends a part to every owner in every round, and the owners wait
for it. So a spanning peer is in every round: it trains until the round's cut-off in a worker thread (one
micro-batch, started on the parameters of the round it began in, `Spanning.span_begin`), and at the cut-off it
compresses what it has: the micro-batch's gradient where it ended, else only the momentum (DeMo sends the top of
the momentum every round; what it held back goes out now). Its weight in the merge is its micro-batch's samples
times the part of it that ran in the round (`share`); the rounds one micro-batch spans weigh its samples together.
It applies every round's aggregate as any member does, so it stays on the run's parameters; its gradient is from
parameters as many rounds old as the micro-batch spanned (the metrics rows' `stale_rounds`), as a coordinator-mode
peer's late payload is (docs/dht.md#mixed-speed-peers). Imports asyncio, the replica protocol and the loop's state;
never the loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import TextIO

from demonet.train.replica import Spanning

from .state import LoopSteps, RoundOutcome, SpanJob

__all__ = ["share", "spanning_round"]


async def spanning_round(loop: LoopSteps, replica: Spanning, metrics: TextIO | None) -> bool:
    """One round of a peer whose micro-batch spans rounds; False when the peer should stop (SIGTERM).

    A micro-batch is started where none runs; the round waits for it until its cut-off (lockstep: to its end),
    then compresses, submits and settles as a plain round does."""
    if loop.unchecked is not None:  # the round before's digest (a transport whose digest follows)
        if await loop.check(loop.unchecked, metrics) != RoundOutcome.APPLIED:
            return True
    await loop.membership.begin_round(loop.round, loop.digest, replica.named_parameters)
    t0 = time.perf_counter()
    if loop.span is None:
        await asyncio.to_thread(replica.span_begin)
        task = asyncio.ensure_future(asyncio.to_thread(replica.span_micro_batch))
        loop.span = SpanJob(task, loop.round, mark=time.perf_counter())
    job = loop.span
    until = loop.cutoff()
    await asyncio.wait([job.task], timeout=None if until is None else max(0.0, until - time.perf_counter()))
    loss, micro_batches, train_s, stale = loop.last_loss, 0, 0.0, 0
    if job.task.done():
        loop.span = None
        loss, train_s = job.task.result()  # what the micro-batch raised, raised here
        await asyncio.to_thread(replica.span_take)
        micro_batches, stale = 1, loop.round - job.round
    samples = share(job, replica.span_rows(), loop.timing.micro_batch_s, ended=bool(micro_batches))
    t1 = time.perf_counter()
    payload, staged = await asyncio.to_thread(loop.compress, replica, False)
    compress_s = time.perf_counter() - t1
    flight = loop.submit(payload, staged, loss, started=t0, compute_s=train_s + compress_s, samples=samples,
                         micro_batches=micro_batches, train_s=train_s)
    flight.stale = stale
    return await loop.land(flight, metrics) != RoundOutcome.STOPPED


def share(job: SpanJob, rows: int, micro_s: float, *, ended: bool, now: float | None = None) -> int:
    """The samples a round of a micro-batch across rounds weighs: its `rows` times the part of the micro-batch
    (`micro_s` long) that ran since the last round's cut-off, at least 1; the round it ends in, what is left. So
    its rounds weigh its samples together (or one more a round, where it spans more rounds than it has rows)."""
    now = time.perf_counter() if now is None else now
    if ended:
        counted = max(1, rows - job.claimed)
    else:
        part = round(rows * (now - job.mark) / micro_s) if micro_s > 0 else 1
        counted = max(1, min(part, rows - job.claimed - 1))
    job.mark, job.claimed = now, job.claimed + counted
    return counted
