"""A local cluster: N peers in one process, each with its own model replica, data shard and DeMo.

Every round each peer trains on its own batch, compresses, and its payload goes through the real
wire format (encode, validate, decode); the aggregate comes back the same way, and every peer must
end the round with the same parameter digest. No sockets: the networked transports build on this.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from demonet import wire
from demonet.config import Config
from demonet.optim import DeMo, aggregate
from demonet.wire.digest import param_digest

from .data import Batches, load_corpus, split
from .model import GPT

__all__ = ["run_local"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Peer:
    rank: int
    model: GPT
    opt: DeMo
    batches: Batches


def _build_peers(cfg: Config, train_data: torch.Tensor) -> list[_Peer]:
    peers = []
    device = torch.device(cfg.train.device)
    for rank in range(cfg.train.peers):
        torch.manual_seed(cfg.train.seed)  # every replica starts from the same weights
        model = GPT(cfg.model).to(device)
        o = cfg.optim
        opt = DeMo.from_settings(model.named_parameters(), o)
        batches = Batches(train_data, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len,
                          seed=cfg.train.seed, rank=rank, world=cfg.train.peers)
        peers.append(_Peer(rank, model, opt, batches))
    return peers


@torch.no_grad()
def _val_loss(model: GPT, val_data: torch.Tensor, cfg: Config, device: torch.device) -> float:
    batches = Batches(val_data, batch_size=8, seq_len=cfg.train.seq_len, seed=12345)
    losses = []
    for _ in range(4):
        x_BT, y_BT = next(batches)
        _, loss = model(x_BT.to(device), y_BT.to(device))
        assert loss is not None
        losses.append(float(loss))
    return sum(losses) / len(losses)


def run_local(cfg: Config, *, progress: bool = True) -> dict[str, Any]:
    """Train `cfg.train.peers` peers for `cfg.train.steps` rounds; write the run folder.

    Returns:
        the summary also written to ``<out>/summary.json``: first and last mean train loss, the
        final validation loss, bytes per peer per round, wall time, and the final digest.

    Raises:
        RuntimeError: the peers' parameters diverged (a determinism bug; never expected).
    """
    out = Path(cfg.train.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    device = torch.device(cfg.train.device)
    train_data, val_data = split(load_corpus(cfg.train.corpus or None))
    peers = _build_peers(cfg, train_data)
    specs = peers[0].opt.param_specs()
    logger.info("local cluster: %d peers, %d parameters each, %d steps, run folder %s", len(peers),
                peers[0].model.num_params(), cfg.train.steps, out)
    history: list[float] = []
    val_losses: dict[int, float] = {}
    start = time.perf_counter()
    bytes_up = bytes_down = 0
    with open(out / "metrics.jsonl", "w") as metrics, \
            tqdm(total=cfg.train.steps, disable=not progress, desc="train", unit="round") as bar:
        for step in range(cfg.train.steps):
            t0 = time.perf_counter()
            losses, received, sizes = [], [], []
            for peer in peers:
                x_BT, y_BT = next(peer.batches)
                _, loss = peer.model(x_BT.to(device), y_BT.to(device))
                assert loss is not None
                loss.backward()
                losses.append(float(loss.detach()))
                data = wire.encode(peer.opt.compress(), step=step)
                sizes.append(len(data))
                received.append(wire.decode(data, expected=specs)[1])
            agg_data = wire.encode(aggregate(received), step=step)
            _, agg = wire.decode(agg_data, expected=specs)
            digests = []
            for peer in peers:
                peer.opt.apply(agg)
                peer.opt.zero_grad(set_to_none=True)
                digests.append(param_digest(peer.model.named_parameters()))
            if len(set(digests)) != 1:
                raise RuntimeError(f"round {step}: peers' parameters diverged: {digests}")
            round_time_s = time.perf_counter() - t0
            for peer, loss_value, size in zip(peers, losses, sizes, strict=True):
                metrics.write(json.dumps({"round": step, "peer": peer.rank, "loss": loss_value,
                                          "bytes_up": size, "bytes_down": len(agg_data),
                                          "param_digest": digests[0], "round_time_s": round_time_s}) + "\n")
            bytes_up, bytes_down = sum(sizes) // len(sizes), len(agg_data)
            history.append(sum(losses) / len(losses))
            last = cfg.train.eval_every and ((step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.steps)
            if last:
                val_losses[step + 1] = _val_loss(peers[0].model, val_data, cfg, device)
                logger.info("[local step=%d] train loss %.4f val loss %.4f", step + 1, history[-1],
                            val_losses[step + 1])
            bar.set_postfix(loss=f"{history[-1]:.3f}", up_kB=f"{bytes_up / 1e3:.1f}", down_kB=f"{bytes_down / 1e3:.1f}")
            bar.update(1)
    window = max(1, min(10, len(history) // 4))
    summary = {
        "peers": len(peers), "steps": cfg.train.steps, "params": peers[0].model.num_params(),
        "first_loss": sum(history[:window]) / window, "last_loss": sum(history[-window:]) / window,
        "val_loss": val_losses, "bytes_up_per_round": bytes_up, "bytes_down_per_round": bytes_down,
        "dense_fp32_bytes": 4 * peers[0].model.num_params(), "wall_time_s": time.perf_counter() - start,
        "param_digest": digests[0],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
