"""FlexDeMo against hybrid-sharded AdamW (HSDP, full gradient sync) on CPU: 2 nodes x 2 gloo ranks.

Both train the small transformer (demonet.train.model.TINY_MODEL) for the same steps on the same data
streams. Figures: validation loss, bytes between nodes per step (FlexDeMo: the payload bytes that
cross the replicate dimension, as sent, and as demonet's wire format would carry the node's payload
to a coordinator; AdamW: the all-reduced gradient bytes), and per-rank parameter + optimizer-state
bytes against unsharded DeMo. Each learning rate given is run, and the best of each optimizer kept.

    PYTHONPATH=. python bench/flexdemo.py --steps 200 --demo-lr 1e-3 3e-3 --adamw-lr 1e-3 3e-3

`--smoke`: 3 steps at one lr each, a check that the script runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from demonet.flex.__main__ import end_process

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.procs

from tests.procs import free_port  # noqa: E402

NODES, RANKS = 2, 2
VAL_BATCHES = 8


def _config(args: argparse.Namespace, lr: float) -> Any:
    from demonet.config import load_config

    return load_config(None, {}, {
        "optim": {"lr": lr, "compression_topk": args.topk, "compression_chunk": 64, "base": args.demo_base},
        "train": {"batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps}})


def _val_loss(model: torch.nn.Module, cfg: Any, rank: int) -> float:
    """Mean loss on the same validation batches on every rank (FSDP's forward is collective)."""
    from demonet.train.data import Batches, load_corpus, split

    _, val = split(load_corpus(None))
    batches = Batches(val, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=12345)
    total = 0.0
    with torch.no_grad():
        for _ in range(VAL_BATCHES):
            x, y = next(batches)
            total += float(model(x, y)[1])
    return total / VAL_BATCHES


def _wire_bytes(trainer: Any, payload: Any, group: dist.ProcessGroup) -> int:
    """demonet wire bytes of the node's joined payload (what a node submits to a coordinator)."""
    from demonet import wire
    from demonet.flex.shard import join_shards

    got: list[Any] = [None] * RANKS
    dist.all_gather_object(got, payload, group=group)
    return wire.payload_bytes(join_shards(got, trainer.full_shapes))


def _worker(rank: int, mode: str, lr: float, args: argparse.Namespace, port: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from demonet.flex.replicate import hybrid_mesh
    from demonet.flex.shard import FlexTrainer, state_bytes
    from demonet.optim import aggregate, gather_payloads
    from demonet.train.data import Batches, load_corpus, split
    from demonet.train.model import GPT

    torch.set_num_threads(1)
    world = NODES * RANKS
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cfg = _config(args, lr)
    mesh = hybrid_mesh("cpu", RANKS)
    losses, sent, wire_sent = [], 0, 0
    t0 = time.perf_counter()
    if mode == "flexdemo":
        trainer = FlexTrainer(cfg, mesh["shard"], data_seed=cfg.train.seed, data_rank=rank, data_world=world,
                              device=torch.device("cpu"))
        replicate = mesh["replicate"].get_group()
        model, opt = trainer.model, trainer.opt
        for step in range(args.steps):
            loss, payload = trainer.train_step()
            payloads, sent = gather_payloads(payload, replicate)
            if step == 0:
                wire_sent = _wire_bytes(trainer, payload, mesh["shard"].get_group())
            opt.apply(aggregate(payloads))
            losses.append(loss)
    else:  # HSDP AdamW: shard inside the node, all-reduce the gradient shards across nodes
        torch.manual_seed(cfg.train.seed)
        model = GPT(cfg.model)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        train, _ = split(load_corpus(None))
        batches = Batches(train, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=cfg.train.seed,
                          rank=rank, world=world)
        # The gradient shard each rank all-reduces over the replicate dimension: its local grad bytes.
        sent = sum(p.to_local().numel() * 4 for p in model.parameters())
        for _ in range(args.steps):
            x, y = next(batches)
            loss_t = model(x, y)[1]
            loss_t.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss_t.detach()))
    train_s = time.perf_counter() - t0
    mem = state_bytes(model, opt)  # before the evaluation: FSDP leaves the root unsharded after a forward
    val = _val_loss(model, cfg, rank)
    stats = torch.tensor([val, float(sent), float(wire_sent), sum(losses[-10:]) / 10], dtype=torch.float64)
    dist.all_reduce(stats)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "mode": mode, "lr": lr, "val_loss": float(stats[0]) / world, "train_loss_last10": float(stats[3]) / world,
            # per node: the sum over its ranks (the all_reduce summed all ranks of both nodes)
            "inter_node_bytes_per_step": float(stats[1]) / NODES,
            "wire_bytes_per_step": float(stats[2]) / NODES / RANKS if mode == "flexdemo" else None,
            "rank0_param_bytes": mem["param_bytes"], "rank0_state_bytes": mem["state_bytes"],
            "train_s": train_s, "losses": losses}))
    dist.destroy_process_group()
    end_process(0)  # not while gloo's threads may want the GIL: a finalizing interpreter aborts (see end_process)


def _run(mode: str, lr: float, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{mode}-{lr}.json"
    mp.spawn(_worker, args=(mode, lr, args, free_port(), str(out)), nprocs=NODES * RANKS)
    result: dict[str, Any] = json.loads(out.read_text())
    print(f"  {mode:8s} lr={lr:g}: val loss {result['val_loss']:.4f}, train loss (last 10) "
          f"{result['train_loss_last10']:.4f}, {result['train_s']:.0f} s", flush=True)
    return result


def _unsharded_demo_bytes(args: argparse.Namespace) -> dict[str, int]:
    from demonet.flex.shard import state_bytes
    from demonet.optim import DeMo
    from demonet.train.model import GPT

    cfg = _config(args, 1e-3)
    model = GPT(cfg.model)
    o = cfg.optim
    opt = DeMo(model.named_parameters(), lr=o.lr, compression_topk=o.compression_topk,
               compression_chunk=o.compression_chunk, chunk_policy=o.chunk_policy, base=o.base)
    return state_bytes(model, opt)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--topk", type=int, default=32, help="DeMo coefficients kept per 64x64 chunk")
    parser.add_argument("--demo-base", default="sign", help="DeMo's base optimizer: sign, sgd or adamw (sign)")
    parser.add_argument("--demo-lr", type=float, nargs="+", default=[1e-3, 3e-3])
    parser.add_argument("--adamw-lr", type=float, nargs="+", default=[1e-3, 3e-3])
    parser.add_argument("--json", help="also write all results here")
    parser.add_argument("--smoke", action="store_true", help="3 steps at one lr each: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.demo_lr, args.adamw_lr = 3, [1e-3], [1e-3]
    print(f"2 nodes x 2 ranks (gloo, CPU), TINY_MODEL, {args.steps} steps, batch {args.batch_size} x "
          f"{args.seq_len} per rank, DeMo {args.demo_base} base topk {args.topk} chunk 64", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [_run("flexdemo", lr, args, Path(tmp)) for lr in args.demo_lr]
        runs += [_run("adamw", lr, args, Path(tmp)) for lr in args.adamw_lr]
    demo = min((r for r in runs if r["mode"] == "flexdemo"), key=lambda r: r["val_loss"])
    adamw = min((r for r in runs if r["mode"] == "adamw"), key=lambda r: r["val_loss"])
    unsharded = _unsharded_demo_bytes(args)
    loss_ratio = demo["val_loss"] / adamw["val_loss"]
    bytes_ratio = adamw["inter_node_bytes_per_step"] / demo["inter_node_bytes_per_step"]
    wire_ratio = adamw["inter_node_bytes_per_step"] / demo["wire_bytes_per_step"]
    flex_mem = demo["rank0_param_bytes"] + demo["rank0_state_bytes"]
    full_mem = unsharded["param_bytes"] + unsharded["state_bytes"]
    adamw_mem = adamw["rank0_param_bytes"] + adamw["rank0_state_bytes"]
    print(f"best FlexDeMo lr {demo['lr']:g}: val loss {demo['val_loss']:.4f}; best HSDP AdamW lr {adamw['lr']:g}: "
          f"val loss {adamw['val_loss']:.4f}; ratio {loss_ratio:.4f} (goal <= 1.03: "
          f"{'met' if loss_ratio <= 1.03 else 'NOT met'})")
    print(f"bytes between nodes per step, per node: FlexDeMo {demo['inter_node_bytes_per_step']:.0f} B as sent over "
          f"torch.distributed (int16 index + fp32 value), {demo['wire_bytes_per_step']:.0f} B in demonet's wire "
          f"format; HSDP AdamW {adamw['inter_node_bytes_per_step']:.0f} B; ratio {bytes_ratio:.1f}x "
          f"(wire {wire_ratio:.1f}x) (goal >= 30x: {'met' if bytes_ratio >= 30 else 'NOT met'})")
    print(f"parameter + optimizer state bytes per rank: FlexDeMo {flex_mem} B, unsharded DeMo {full_mem} B "
          f"(ratio {flex_mem / full_mem:.3f}, goal about 1/{RANKS}), HSDP AdamW {adamw_mem} B")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "unsharded_demo": unsharded}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
