"""A local cluster: N peers and their coordinator in one process, each peer with its own replica, data and DeMo.

Every peer runs the same `demonet.loop.RoundLoop` as a networked one, over the in-process
coordinator (`demonet.coordinator.local`): payloads, aggregates and parameters go through the real
wire format, and the coordinator merges and applies exactly as the gRPC one does. No sockets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from demonet.config import Config
from demonet.coordinator.local import LocalCoordinator
from demonet.coordinator.state import ClosedAggregate
from demonet.train.data import Batches, load_corpus, split
from demonet.train.model import GPT
from demonet.train.token_data import open_tokens
from demonet.train.trainer import Trainer
from demonet.transport.coordinated import CoordinatorMembership

from .round_loop import RoundLoop
from .runfolder import merge_metrics, plot_loss, plot_pipeline, summarize_run

__all__ = ["run_local"]

logger = logging.getLogger(__name__)


def _val_batches(cfg: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """4 fixed validation batches from the validation part of the run's token file or corpus."""
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    if cfg.train.tokens:
        batches = open_tokens(cfg.train.tokens).batches(batch_size=8, seq_len=cfg.train.seq_len, seed=12345,
                                                        part="val")
    else:
        batches = Batches(split(load_corpus(cfg.train.corpus or None))[1], batch_size=8, seq_len=cfg.train.seq_len,
                          seed=12345)
    return [next(batches) for _ in range(4)]


@torch.no_grad()
def _val_loss(params: Mapping[str, torch.Tensor], val_batches: list[tuple[torch.Tensor, torch.Tensor]],
              cfg: Config) -> float:
    """The mean loss of the canonical parameters on the validation batches."""
    model = GPT(cfg.model)
    model.load_state_dict(dict(params), strict=False)
    losses = []
    for batch in val_batches:
        _, loss = model(*batch)
        assert loss is not None
        losses.append(float(loss))
    return sum(losses) / len(losses)


def run_local(cfg: Config, *, progress: bool = True, faults: Mapping[tuple[str, int], str] | None = None
              ) -> dict[str, Any]:
    """Train `cfg.train.peers` peers for `cfg.train.steps` rounds; write the run folder.

    Args:
        cfg: the run.
        progress: show a progress bar of the rounds.
        faults: a fault plan for the in-process coordinator (`demonet.coordinator.local.FAULTS`).

    Returns:
        the summary also written to ``<out>/summary.json``: first and last mean train loss, the
        validation loss of the canonical parameters every ``train.eval_every`` rounds (the built-in
        task only), bytes per peer per round, wall time, and the final digest.

    Raises:
        RuntimeError: the peers' parameters diverged (a determinism bug; never expected).
    """
    return asyncio.run(_run(cfg, progress=progress, faults=faults))


async def _run(cfg: Config, *, progress: bool, faults: Mapping[tuple[str, int], str] | None) -> dict[str, Any]:
    out = Path(cfg.train.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("metrics*.jsonl"):
        old.unlink()  # a fresh run; the peers append
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    # All peers join before the first round opens, the coordinator waits for them (and the deadline
    # is generous: peers train one after another on the same cores).
    cfg = dataclasses.replace(cfg, net=dataclasses.replace(
        cfg.net, start_peers=cfg.train.peers, min_peers=1, round_timeout_s=max(cfg.net.round_timeout_s, 600.0),
        heartbeat_timeout_s=max(cfg.net.heartbeat_timeout_s, 1200.0)))
    val_batches = _val_batches(cfg) if cfg.train.eval_every else []
    val_losses: dict[int, float] = {}
    bar = tqdm(total=cfg.train.steps, disable=not progress, desc="train", unit="round")

    def closed(agg: ClosedAggregate) -> None:
        done = agg.round + 1
        if cfg.train.eval_every and not cfg.train.task and (done % cfg.train.eval_every == 0
                                                            or done == cfg.train.steps):
            val_losses[done] = _val_loss(hub.state.params, val_batches, cfg)
            logger.info("[local round=%d] val loss %.4f", done, val_losses[done])
        bar.set_postfix(up_kB=f"{len(agg.data) / 1e3:.1f}")
        bar.update(1)

    hub = LocalCoordinator(cfg, total_rounds=cfg.train.steps, faults=faults, on_close=closed)
    device = torch.device(cfg.train.device)
    loops = []
    for rank in range(cfg.train.peers):
        membership = CoordinatorMembership(hub.client(f"p{rank}"), "the local coordinator")
        info = await membership.join()
        trainer = Trainer.for_run(cfg, data_seed=info.data_seed, device=device)
        loops.append((RoundLoop(trainer, membership, membership.client, info.peer_id,
                                out / f"metrics-{info.peer_id}.jsonl", checkpoint_every=0, overlap=cfg.net.overlap,
                                lookahead=cfg.net.lookahead, round_s=cfg.net.round_s), info))
    logger.info("local cluster: %d peers, %d parameters each, %d steps, run folder %s", len(loops),
                loops[0][0].replica.num_params(), cfg.train.steps, out)  # type: ignore[attr-defined]
    start = time.perf_counter()
    ticker = asyncio.create_task(hub.tick_forever())
    quiet = logging.getLogger(RoundLoop.__module__)  # the bar and the validation lines show the progress
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        codes = await asyncio.gather(*(loop.run(info) for loop, info in loops))
    finally:
        quiet.setLevel(level)
        ticker.cancel()
        bar.close()
    if any(codes):
        raise RuntimeError(f"a peer of the local cluster failed (exit codes {codes})")
    digests = {loop.peer_id: loop.digest for loop, _ in loops}
    if set(digests.values()) != {hub.state.digest}:
        raise RuntimeError(f"peers' parameters diverged from the canonical {hub.state.digest[:12]}: {digests}")
    rows = merge_metrics(out)
    run = summarize_run(rows)
    if not run["digests_agree"]:
        raise RuntimeError(f"peers' parameters diverged in rounds {run['disagreeing_rounds'][:10]}")
    summary = {
        "peers": len(loops), "steps": cfg.train.steps, "params": loops[0][0].replica.num_params(),  # type: ignore
        "first_loss": run["first_loss"], "last_loss": run["last_loss"], "val_loss": val_losses,
        "bytes_up_per_round": run["bytes_up_per_round"], "bytes_down_per_round": run["bytes_down_per_round"],
        "dense_fp32_bytes": 4 * sum(p.numel() for p in hub.state.params.values()),
        "wall_time_s": time.perf_counter() - start, "param_digest": hub.state.digest,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_loss(rows, out / "loss.png")
    plot_pipeline(rows, out / "compute_wait.png")
    return summary
