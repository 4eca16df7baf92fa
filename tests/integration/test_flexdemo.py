"""FlexDeMo: 2 nodes x 2 ranks on CPU with gloo, FSDP2 inside a node and DeMo between nodes.

One spawned 2x2 world checks that sharded DeMo equals unsharded DeMo on the same data and that a
checkpoint saved mid-run resumes identically; a second test runs two torchrun "nodes" against a real
coordinator process on loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from demonet.config import Config, load_config
from demonet.wire.digest import param_digest
from tests.procs import Reaper, free_port

pytestmark = pytest.mark.slow

NODES, RANKS = 2, 2
STEPS, SAVE_AT = 5, 2
# d_model 32 with chunk 16: every dim 0 splits into 2 shards of whole chunks.
CONFIG = {"model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32},
          "optim": {"compression_chunk": 16, "compression_topk": 8, "lr": 0.01, "warmup_rounds": 3},
          "train": {"seq_len": 32, "batch_size": 2, "max_grad_norm": 0.1}}  # clips: the gradient's norm is ~1


def _cfg() -> Config:
    return load_config(None, {}, CONFIG)


def _reference(cfg: Config, chunks: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Unsharded DeMo: one whole model per node, its gradient the mean over the node's ranks' batches."""
    from demonet.optim import DeMo, LrSchedule, aggregate
    from demonet.train.data import Batches, load_corpus, split
    from demonet.train.model import GPT

    o = cfg.optim
    train_data, _ = split(load_corpus(None))
    models, opts = [], []
    for _ in range(NODES):
        torch.manual_seed(cfg.train.seed)
        model = GPT(cfg.model)
        models.append(model)
        opts.append(DeMo(model.named_parameters(), lr=o.lr, compression_decay=o.compression_decay,
                         compression_topk=o.compression_topk, compression_chunk=o.compression_chunk,
                         base=o.base, chunk_policy=o.chunk_policy, chunks=chunks))
    batches = [Batches(train_data, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len,
                       seed=cfg.train.seed, rank=r, world=NODES * RANKS) for r in range(NODES * RANKS)]
    schedule = LrSchedule.from_settings(o, cfg.train.steps)  # a warmup: the first steps have their own lr
    for step in range(STEPS):
        payloads = []
        for node, (model, opt) in enumerate(zip(models, opts, strict=True)):
            for r in range(node * RANKS, (node + 1) * RANKS):
                x, y = next(batches[r])
                _, loss = model(x, y)
                (loss / RANKS).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)  # the node's mean gradient
            payloads.append(opt.compress())
            opt.zero_grad(set_to_none=True)
        agg = aggregate(payloads)
        for opt in opts:
            opt.apply(agg, lr=schedule(step))
    return {n: p.detach().clone() for n, p in models[0].named_parameters()}


def _worker(rank: int, port: int, out_dir: str) -> None:
    from demonet.flex.__main__ import end_process
    from demonet.flex.replicate import hybrid_mesh, replicated_step
    from demonet.flex.shard import FlexTrainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=NODES * RANKS)
    try:
        cfg, out = _cfg(), Path(out_dir)
        mesh = hybrid_mesh("cpu", RANKS)
        replicate = mesh["replicate"].get_group()
        node = rank // RANKS

        def trainer() -> FlexTrainer:
            return FlexTrainer(cfg, mesh["shard"], data_seed=cfg.train.seed, data_rank=rank,
                               data_world=NODES * RANKS, device=torch.device("cpu"))

        first = trainer()
        for step in range(STEPS):
            replicated_step(first, replicate)
            if step + 1 == SAVE_AT:
                first.save_folder(out / f"ckpt-node{node}")
        full = first.full_params()
        resumed = trainer()
        resumed.load_folder(out / f"ckpt-node{node}")
        loaded_at = resumed.step
        while resumed.step < STEPS:
            replicated_step(resumed, replicate)
        result: dict[str, Any] = {"digest": param_digest(full.items()), "loaded_at": loaded_at,
                                  "resumed": param_digest(resumed.full_params().items())}
        if rank == 0:
            from demonet.train.model import GPT

            ref = _reference(cfg, first.chunks)
            torch.manual_seed(cfg.train.seed)
            init = {n: p.detach() for n, p in GPT(cfg.model).named_parameters()}
            result["max_diff"] = max(float((full[n] - ref[n]).abs().max()) for n in ref)
            result["max_step"] = max(float((ref[n] - init[n]).abs().max()) for n in ref)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    end_process(0)  # as a rank of python -m demonet.flex ends: not while gloo's threads may want the GIL


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("flex")
    ctx = mp.spawn(_worker, args=(free_port(), str(out)), nprocs=NODES * RANKS, join=False)
    deadline = time.monotonic() + 150
    with Reaper() as reaper:  # a module fixture: the function-scoped reap_children is not at hand
        for p in ctx.processes:
            reaper.add(p)
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError("the 2x2 FlexDeMo run did not finish in 150 s")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(NODES * RANKS)]


def test_sharded_demo_equals_unsharded(hybrid_run: list[dict[str, Any]]) -> None:
    # Both nodes hold the same bits, and they are unsharded DeMo's up to float rounding of the
    # gradient's reduction order (FSDP's reduce-scatter vs one backward per micro-batch).
    assert len({r["digest"] for r in hybrid_run}) == 1
    assert hybrid_run[0]["max_step"] > 1e-3  # the parameters moved
    assert hybrid_run[0]["max_diff"] < 1e-5, hybrid_run[0]


def test_checkpoint_resumes_identically(hybrid_run: list[dict[str, Any]]) -> None:
    for r in hybrid_run:
        assert r["loaded_at"] == SAVE_AT
        assert r["resumed"] == r["digest"]


ROUNDS = 4
TOKEN = "flex-token"
COORDINATOR_TOML = """[model]
d_model = 32
n_layers = 1
n_heads = 2
seq_len = 32
[optim]
compression_chunk = 16
compression_topk = 8
[train]
seq_len = 32
batch_size = 2
[net]
round_timeout_s = 60.0
start_peers = 2
heartbeat_timeout_s = 60.0
"""


@pytest.mark.parametrize(("overlap", "task"), [(0, ""), (1, ""), (0, "examples.custom_task:task")],
                         ids=["plain", "overlap", "task"])
def test_two_nodes_of_two_ranks_through_a_coordinator(tmp_path: Path, reap_children: Reaper, overlap: int,
                                                      task: str) -> None:
    """A real coordinator process and two torchrun nodes of 2 gloo ranks each, on loopback; with overlap, each
    rank trains round r+1 (FSDP collectives) while rank 0 exchanges round r (the link's own group); with a
    task, the nodes shard a user's model (a convolutional network, no transformer blocks) named by the run."""
    config = COORDINATOR_TOML + f"overlap = {overlap}\n"
    if task:  # 8 classes and chunks of 4: every dim 0 splits over 2 ranks into whole chunks
        config = config.replace("[train]\n", f'[train]\ntask = "{task}"\n').replace(
            "compression_chunk = 16", "compression_chunk = 4") + "[task]\nclasses = 8\n"
    (tmp_path / "run.toml").write_text(config)
    env = {**os.environ, "DEMONET_TOKEN": TOKEN}
    coordinator = reap_children.add(subprocess.Popen(
        [sys.executable, "-m", "demonet.coordinator", "--listen", "127.0.0.1:0", "--config",
         str(tmp_path / "run.toml"), "--steps", str(ROUNDS), "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.PIPE, stderr=reap_children.open(tmp_path / "coordinator.log", "w"), text=True, env=env))
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        assert coordinator.stdout is not None
        line = coordinator.stdout.readline()
        assert line.startswith("listening on "), (tmp_path / "coordinator.log").read_text()
        address = line.split()[-1]
        for name in ("nodeA", "nodeB"):
            nodes.append(reap_children.add(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
                 "--log-dir", str(tmp_path / f"{name}-torchrun"),  # not a folder of its own in /tmp, left there
                 "-m", "demonet.flex", "--coordinator", address, "--peer-id", name, "--out",
                 str(tmp_path / name), "--threads", "1"],
                stdout=subprocess.DEVNULL, stderr=reap_children.open(tmp_path / f"{name}.log", "w"), env=env)))
        deadline = time.monotonic() + 150
        for node, name in zip(nodes, ("nodeA", "nodeB"), strict=True):
            left = max(1.0, deadline - time.monotonic())
            assert node.wait(timeout=left) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        reap_children.stop([*nodes, coordinator], 15.0)  # SIGTERM, then SIGKILL after 15 s
    lines = {name: [json.loads(x) for x in (tmp_path / name / f"metrics-{name}.jsonl").read_text().splitlines()]
             for name in ("nodeA", "nodeB")}
    for rows in lines.values():
        assert [r["round"] for r in rows] == list(range(ROUNDS))
        assert all(r["contributors"] == 2 and r["ranks"] == RANKS and not r.get("resynced") for r in rows)
        assert all(r["resyncs"] == 0 for r in rows)
        assert all(r["param_digest"] == r["canonical_digest"] and r["overlap"] == overlap for r in rows)
    final = {name: rows[-1]["param_digest"] for name, rows in lines.items()}
    assert final["nodeA"] == final["nodeB"]
    assert lines["nodeA"][0]["param_digest"] != lines["nodeA"][-1]["param_digest"]  # it trained
    state = torch.load(tmp_path / "state" / "coordinator-state.pt", weights_only=False)
    assert param_digest(state["params"].items()) == final["nodeA"]
    for name in ("nodeA", "nodeB"):  # each node wrote its sharded checkpoint at the end
        saved = json.loads((tmp_path / name / f"node-{name}" / "round.json").read_text())
        assert saved == {"peer_id": name, "round": ROUNDS, "param_digest": final[name], "resyncs": 0}
