"""The overlapped pipeline (`[net] overlap = 1`): round r+1's forward and backward run while round r's payload
travels. It drives a `demonet.loop.round_loop.RoundLoop` through the loop's steps (`go`, `compress`, `submit`,
`land`, `drop`: `LoopSteps`), which the plain pipeline uses too. Imports asyncio, the replica and transport
protocols and the loop's state; never the loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import TextIO

from demonet.train.replica import Overlapping

from .state import InFlight, LoopSteps, RoundOutcome, check_beats

__all__ = ["overlapped_rounds"]


async def overlapped_rounds(loop: LoopSteps, metrics: TextIO | None, beats: asyncio.Task[None] | None) -> None:
    """Rounds with `overlap` = 1: round r+1's forward and backward run while round r's payload travels.

    Round r+1's gradient is compressed as soon as its backward ends, undoably (`DeMo.compress`), so
    that only round r's settle and digest stand between round r's outcome and round r+1's payload.
    Where the gatherer takes a digest that follows (`digest_follows`: coordinator mode), the payload
    leaves at once, while round r is still merged and downloaded, and its digest follows once round
    r is settled; elsewhere it leaves then, with its digest. Either way it is round r+1's payload from
    round r+1's canonical parameters, checked against their digest, as in a plain round. What round r's
    aggregate dropped (all of the payload, if round r was aborted) goes back into the momentum after
    that compress, so it leaves a round later than in a plain round, once all the same. The
    lookahead is applied once the payload is on its way. When the peer must load other parameters
    (a refusal, a catch-up, a resync) or stops, the compress of r+1 is undone to the bit, as if its
    gradient had been dropped before it, a payload sent ahead is called off, and the pipeline starts
    again from the loaded round with nothing in flight. Where round r's payload counted in a later round
    (a peer spanning rounds), the payload sent ahead is called off too, but r+1's gradient is kept in the
    momentum (its compress committed, its payload restored): it leaves with a later payload, as what a
    round's aggregate drops does, and a micro-batch that outlasted rounds is not thrown away.
    """
    replica: Overlapping = loop.replica  # type: ignore[assignment]  # overlap needs an `Overlapping`
    flight: InFlight | None = None
    ahead: InFlight | None = None  # the next round's payload, on its way before `flight` is settled
    pending = False  # an undoable compress of the next round waits for `flight`'s outcome
    try:
        while await loop.membership.agree(loop.go(loop.round + (flight is not None))):
            t0 = time.perf_counter()
            loss = await asyncio.to_thread(replica.forward_backward, loop.cutoff())  # `flight` travels meanwhile
            train_s = time.perf_counter() - t0
            samples, micro_batches = replica.samples(), replica.micro_batches()
            payload, staged = await asyncio.to_thread(loop.compress, replica, flight is not None)
            pending = flight is not None
            compute_s = time.perf_counter() - t0
            if flight is not None:
                if loop.gatherer.digest_follows:  # it leaves now; its digest once `flight` is settled
                    ahead = loop.submit(payload, staged, loss, started=t0, compute_s=compute_s, ahead=True,
                                        samples=samples, micro_batches=micro_batches, train_s=train_s)
                landing, flight = flight, None  # `land` gives its payload back on every error path
                landed = await loop.land(landing, metrics)
                if landed == RoundOutcome.APPLIED and not await loop.membership.agree(loop.go(loop.round)):
                    landed = RoundOutcome.STOPPED  # a stop came meanwhile
                late = landed == RoundOutcome.APPLIED and landing.round + 1 != loop.round
                if late:  # it counted in a later round: the next one's gradient is from parameters rounds old
                    landed = RoundOutcome.CAUGHT_UP
                pending = False
                if landed != RoundOutcome.APPLIED:
                    if ahead is not None:
                        dropped, ahead = ahead, None
                        await loop.drop(dropped)
                    if late:  # a spanning peer's: its gradient stays in the momentum (error feedback), not lost
                        replica.commit_compress()
                        await asyncio.to_thread(replica.restore, payload)
                    else:
                        await asyncio.to_thread(replica.undo_compress)  # its gradient is from other parameters
                    if landed == RoundOutcome.STOPPED:
                        break
                    continue
                replica.commit_compress()
            t1 = time.perf_counter()
            if loop.lookahead:  # the canonical parameters, which a DHT peer serves while the lookahead runs
                await asyncio.to_thread(replica.hold)
            await loop.membership.begin_round(loop.round, loop.digest, replica.canonical_parameters)
            compute_s += time.perf_counter() - t1
            if ahead is not None:  # its digest follows it now
                flight, ahead = ahead, None
                assert flight.round == loop.round and flight.digest is not None
                flight.compute_s = compute_s
                flight.digest.set(loop.digest)
            else:
                flight = loop.submit(payload, staged, loss, started=t0, compute_s=compute_s, samples=samples,
                                     micro_batches=micro_batches, train_s=train_s)
            if loop.lookahead:  # while the payload travels: the next round trains from here
                t2 = time.perf_counter()
                await asyncio.to_thread(replica.lookahead, payload, loop.round)
                flight.compute_s += time.perf_counter() - t2
            check_beats(beats)
        if flight is not None:  # the last round, or the one open at a stop
            landing, flight = flight, None
            await loop.land(landing, metrics)
    finally:
        if ahead is not None:  # an error while the round before was landing: the compress is undone below
            await loop.drop(ahead)
        if pending:  # an error while the outcome of the round before was awaited
            replica.undo_compress()
        if flight is not None:  # an error while training left a round in flight: its payload goes back
            await loop.drop(flight)
            await asyncio.to_thread(replica.restore, flight.payload)
