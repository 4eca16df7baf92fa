"""The baselines' training processes for `demonet bench`: AdamW with torch DDP, and hivemind.Optimizer.

A bench module: imports torch.distributed and (lazily) hivemind; nothing in the package imports it.
Each process appends one JSON line per optimizer step to ``steps-<rank>.jsonl``: {"step", "time", "loss",
"batches"} (time: Unix time when the step was done, as in a demonet peer's metrics rows; batches: the local
batches it took). A line with step 0 marks the start of training. Rank 0 saves the final parameters to
``final.pt`` when it does every step. `--slowdown` makes a process's forward and backward that many times as
long (`demonet.lab.evidence.slowdown`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch

from demonet.train.data import Batches, load_corpus, split
from demonet.train.model import GPT, ModelConfig

from .slowdown import slow_down

__all__ = ["main"]


def _setup(args: argparse.Namespace) -> tuple[GPT, Batches, IO[str]]:
    torch.set_num_threads(1)  # four peers share the machine's cores
    cfg = ModelConfig(**json.loads(args.model))
    torch.manual_seed(args.seed)  # every system starts from the same weights
    model = GPT(cfg)
    slow_down(model, args.slowdown)
    train_data, _ = split(load_corpus())
    batches = Batches(train_data, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                      rank=args.rank, world=args.world)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return model, batches, open(out / f"steps-{args.rank}.jsonl", "w")


def _save_final(model: torch.nn.Module, out: Path) -> None:
    """``final.pt``, whole or not at all (a temp file renamed): the bench reads it once the steps are done,
    and may tear the lab down while a rank is still writing."""
    tmp = out / "final.pt.tmp"
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, out / "final.pt")


def _record(log: IO[str], step: int, loss: float, batches: int = 1) -> None:
    log.write(json.dumps({"step": step, "time": time.time(), "loss": loss, "batches": batches}) + "\n")
    log.flush()


def _barrier(out: Path, rank: int, timeout_s: float) -> None:
    """Say this peer is ready, then wait for the launcher's go: every peer starts training together
    (hivemind peers otherwise start their epochs alone, before the others have joined)."""
    (out / f"ready-{rank}").touch()
    deadline = time.monotonic() + timeout_s
    while not (out / "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go from the launcher within {timeout_s:.0f} s")
        time.sleep(0.05)


def _ddp(args: argparse.Namespace) -> int:
    """AdamW on the gloo all-reduce of full fp32 gradients (DistributedDataParallel's mean)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model, batches, log = _setup(args)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.0)
        _record(log, 0, float("nan"))
        for step in range(1, args.steps + 1):
            x_BT, y_BT = next(batches)
            _, loss = ddp(x_BT, y_BT)
            loss.backward()  # DDP all-reduces the gradients bucket by bucket here
            opt.step()
            opt.zero_grad(set_to_none=True)
            _record(log, step, float(loss.detach()))
        if args.rank == 0:
            _save_final(model, Path(args.out))
    finally:
        dist.destroy_process_group()
        log.close()
    return 0


def _hivemind(args: argparse.Namespace) -> int:
    """hivemind.Optimizer: peers accumulate toward target_batch_size, then all-reduce gradients over a DHT."""
    from functools import partial

    import hivemind

    from demonet.dht.sockets import use_own_sockets

    model, batches, log = _setup(args)
    use_own_sockets()  # hivemind's sockets in a folder of this process's own, gone with it (demonet.dht.sockets)
    dht = hivemind.DHT(initial_peers=args.initial_peers or None, host_maddrs=[f"/ip4/{args.host}/tcp/0"],
                       start=True)
    if args.rank == 0:
        maddrs = [str(a) for a in dht.get_visible_maddrs()]
        tmp = Path(args.out) / "maddrs.json.tmp"
        tmp.write_text(json.dumps(maddrs))
        os.replace(tmp, Path(args.out) / "maddrs.json")
    opt = hivemind.Optimizer(
        dht=dht, run_id="bench", params=model.parameters(), optimizer=partial(torch.optim.AdamW, lr=args.lr),
        batch_size_per_step=args.batch_size, target_batch_size=args.world * args.batch_size,
        use_local_updates=False, matchmaking_time=args.matchmaking_s, averaging_timeout=args.timeout_s,
        verbose=False)
    try:
        _barrier(Path(args.out), args.rank, args.timeout_s)
        _record(log, 0, float("nan"))
        epoch, losses = opt.local_epoch, []
        while opt.local_epoch < args.steps:
            x_BT, y_BT = next(batches)
            _, loss = model(x_BT, y_BT)
            loss.backward()
            losses.append(float(loss.detach()))
            opt.step()  # a global step once the collaboration has accumulated target_batch_size
            opt.zero_grad()
            if opt.local_epoch != epoch:
                epoch = opt.local_epoch
                # Peers can overshoot target_batch_size: they learn the others' progress through the DHT.
                _record(log, epoch, sum(losses) / len(losses), len(losses))
                losses = []
        if args.rank == 0:
            _save_final(model, Path(args.out))
    finally:
        log.close()
        opt.shutdown()
        dht.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m demonet.lab.evidence.workers {ddp,hivemind} ...``: one baseline peer."""
    parser = argparse.ArgumentParser(prog="python -m demonet.lab.evidence.workers")
    parser.add_argument("system", choices=("ddp", "hivemind"))
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--model", required=True, help="ModelConfig fields as JSON")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="gloo / averaging timeout")
    parser.add_argument("--slowdown", type=float, default=1.0, help="forward and backward take this many times as long")
    parser.add_argument("--master", help="ddp: HOST:PORT of rank 0")
    parser.add_argument("--host", default="0.0.0.0", help="hivemind: address to listen on")
    parser.add_argument("--initial-peers", nargs="*", default=[], help="hivemind: multiaddrs of a DHT peer")
    parser.add_argument("--matchmaking-s", type=float, default=5.0, help="hivemind: matchmaking_time")
    args = parser.parse_args(argv)
    run: dict[str, Any] = {"ddp": _ddp, "hivemind": _hivemind}
    return int(run[args.system](args))


if __name__ == "__main__":
    from demonet.flex.__main__ import end_process

    end_process(main())  # a ddp rank: not while gloo's threads may want the GIL (see end_process)
