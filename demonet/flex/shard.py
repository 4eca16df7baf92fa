"""FlexDeMo inside a node: the model fully sharded with FSDP2 over the node's ranks, DeMo on each shard.

Service layer: torch.distributed (FSDP2, DTensor, checkpoint), the model, the data and the math layer;
no network transport. Every rank's shard of a parameter is a whole number of DeMo chunks (checked by
`chunk_plan`), so a node's payload is its ranks' payload rows concatenated in rank order: exactly the
payload an unsharded DeMo would compute on the whole parameters with the node's mean gradient.

Shape legend: C = chunks of one tensor, K = entries per chunk, N = h * w coefficients per chunk.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from demonet.config import Config
from demonet.optim import Compressed, DeMo, Payload, chunk_shape, matrix_shape
from demonet.optim.payload import num_chunks
from demonet.train.data import Batches, load_corpus, split
from demonet.train.data import data_seed as seed_for
from demonet.train.micro_batches import batch_rows
from demonet.train.model import GPT
from demonet.train.replica import Settled
from demonet.train.task import build_task
from demonet.train.trainer import DeMoSteps, StepOptions, autocast, settle, to_device
from demonet.wire.digest import param_digest

__all__ = ["FlexTrainer", "chunk_plan", "join_shards", "local_rows", "state_bytes"]

logger = logging.getLogger(__name__)

_STATE_KEYS = ("momentum", "exp_avg", "exp_avg_sq")


def chunk_plan(named_shapes: Iterable[tuple[str, tuple[int, ...]]], *, ranks: int, target: int,
               policy: str) -> dict[str, tuple[int, int]]:
    """Each parameter's (h, w) chunk: the unsharded rule on the whole shape, the same on every node.

    FSDP2 shards dim 0: the rows of a matrix view, the columns of a 1-D tensor (a 1 x n view).
    With `ranks` shards that dimension must split evenly into whole chunks, so no chunk straddles
    two ranks and DTensor's even sharding of the momentum matches the blocks.

    Raises:
        ValueError: a parameter cannot be cut that way (names it, with what would fit).
    """
    plan = {}
    for name, shape in named_shapes:
        rows, cols = matrix_shape(shape)
        h, w = chunk_shape(rows, cols, target, policy)
        if ranks > 1:
            if len(shape) == 0:
                raise ValueError(f"parameter {name!r} is a scalar: FSDP cannot shard it over {ranks} ranks")
            side = h if len(shape) >= 2 else w
            if shape[0] % ranks or (shape[0] // ranks) % side:
                raise ValueError(
                    f"parameter {name!r} of shape {shape}: dim 0 ({shape[0]}) should split into {ranks} "
                    f"shards of whole DeMo chunks of {side} (chunk {(h, w)}); pick a compression_chunk or a "
                    f"model width for which {shape[0]} / {ranks} is a multiple of the chunk side")
        plan[name] = (h, w)
    return plan


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP2 shards one by one before the root: the entries of the outermost `ModuleList`s (a
    transformer's blocks: the built-in GPT's `blocks`, a Hugging Face model's `layers`); none for a model
    without one, which is sharded as a whole."""
    units: list[torch.nn.Module] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and not any(name.startswith(t + ".") for t in taken):
            taken.append(name)
            units += list(module)
    return units


def rank_seed(data_seed: int, rank: int) -> int:
    """A rank's own data stream seed for a user's task (whose `batches(seed)` knows no ranks)."""
    return seed_for(data_seed, f"rank-{rank}")


def local_rows(c: Compressed, rank: int, ranks: int, local_shape: tuple[int, ...]) -> Compressed:
    """Shard `rank`'s rows of a whole parameter's `Compressed` (an aggregate), as its DeMo expects them."""
    rows = num_chunks(local_shape, c.chunk)
    if c.idx.shape[0] != rows * ranks:
        raise ValueError(f"aggregate has {c.idx.shape[0]} chunks, expected {rows} x {ranks} shards")
    scale = c.scale[rank * rows:(rank + 1) * rows] if c.scale is not None and c.scale.dim() == 2 else c.scale
    return Compressed(idx=c.idx[rank * rows:(rank + 1) * rows], val=c.val[rank * rows:(rank + 1) * rows],
                      shape=local_shape, chunk=c.chunk, scale=scale)


def join_shards(shards: list[Payload], full_shapes: Mapping[str, tuple[int, ...]]) -> Payload:
    """The node's payload: each tensor's rows from every rank, in rank order, with its whole shape.

    Raises:
        ValueError: an encoding with one scale per tensor (fp16): the ranks' scales differ.
    """
    encoding = shards[0].encoding
    if encoding == "fp16":
        raise ValueError("FlexDeMo nodes send fp32, bf16, int8 or sign values: fp16 has one scale per "
                         "tensor, and a node's shards have one each")
    tensors = {}
    for name, shape in full_shapes.items():
        parts = [s.tensors[name] for s in shards]
        scales = [p.scale for p in parts if p.scale is not None]
        scale = torch.cat(scales) if scales else None
        tensors[name] = Compressed(idx=torch.cat([p.idx for p in parts]), val=torch.cat([p.val for p in parts]),
                                   shape=shape, chunk=parts[0].chunk, scale=scale)
    return Payload(tensors=tensors, encoding=encoding)


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's parameter and optimizer-state bytes (local shards only)."""
    reshard = getattr(model, "reshard", None)
    if reshard is not None:  # an FSDP module: count the shards, not whole tensors it swapped in
        reshard()
    params = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    state = 0
    for entries in opt.state.values():
        for value in entries.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state += _local(value).numel() * value.element_size()
    return {"param_bytes": params, "state_bytes": state}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class FlexTrainer(DeMoSteps):
    """One rank's share of a node: its shard of the FSDP2 model, its DeMo and its data stream.

    Args:
        cfg: the run (model, optimizer, batch size).
        mesh: the node's ranks, a 1-D mesh: parameters and momentum are sharded over it.
        data_seed, data_rank, data_world: this rank's data stream (`demonet.train.data.Batches`).
        device: where the shard lives.
    """

    def __init__(self, cfg: Config, mesh: DeviceMesh, *, data_seed: int, data_rank: int, data_world: int,
                 device: torch.device, checkpoint: Path | None = None) -> None:
        o = cfg.optim
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.group = mesh.get_group()
        self.rank, self.ranks = mesh.get_local_rank(), mesh.size()
        self.loss: Any = None
        """A user's task's loss (`[train] task`); None: the built-in GPT's, on its strided batches."""
        if cfg.train.task:  # every rank and node builds it with the run seed: the same weights
            task = build_task(cfg)
            self.model, self.loss = task.model.to(device), task.loss
            self.batches: Iterator[Any] = task.batches(rank_seed(data_seed, data_rank))
        else:
            torch.manual_seed(cfg.train.seed)  # every rank and node starts from the same weights
            self.model = GPT(cfg.model).to(device)
            train_data, _ = split(load_corpus(cfg.train.corpus or None))
            self.batches = Batches(train_data, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len,
                                   seed=data_seed, rank=data_rank, world=data_world)
        self.full_shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        self.chunks = chunk_plan(self.full_shapes.items(), ranks=self.ranks, target=o.compression_chunk,
                                 policy=o.chunk_policy)
        for unit in shard_units(self.model):
            fully_shard(unit, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = DeMo.from_settings(self.model.named_parameters(), o, chunks=self.chunks)
        self.local_shapes = {name: shape for name, (shape, _) in self.opt.param_specs().items()}
        self.step = 0
        self.options = StepOptions.for_run(cfg)
        """The lr schedule (round r's apply uses ``options.lr_at(r)``), precision and clipping."""
        self._samples = 1
        self.checkpoint = checkpoint
        """The node's checkpoint folder (`save`, `load`), for the round loop; None: none."""

    def forward_backward(self, until: float | None = None) -> float:
        """Forward and backward on this rank's batch (FSDP reduce-scatters the mean gradient inside the
        node). Returns this rank's loss. `until` is not used: every rank of the node trains one micro-batch,
        so that their collectives match."""
        batch = to_device(next(self.batches), self.device)
        self._samples = batch_rows(batch) * self.ranks  # the node's payload is the mean of its ranks' batches
        with autocast(self.device, self.options.precision):
            loss = self.model(*batch)[1] if self.loss is None else self.loss(self.model, batch)
        assert loss is not None
        loss.backward()
        return float(loss.detach())

    def samples(self) -> int:
        """The samples of the node's last round: every rank's batch."""
        return self._samples

    def micro_batches(self) -> int:
        """One: every rank of the node trains one micro-batch a round."""
        return 1

    def canonical_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The whole parameters the open round started from (a held lookahead's, else the live ones)."""
        held = self.opt.held_parameters()
        if held is None:
            return self.named_parameters()
        return list(self._all_gather(held.items()).items())

    def local_aggregate(self, aggregate: Payload) -> Payload:
        """This rank's rows of a whole-parameter aggregate."""
        return Payload(tensors={name: local_rows(c, self.rank, self.ranks, self.local_shapes[name])
                                for name, c in aggregate.tensors.items()}, encoding=aggregate.encoding)

    def sharded_params(self) -> list[tuple[str, torch.Tensor]]:
        """(name, DTensor) pairs. FSDP swaps in whole tensors while a module is unsharded (the root
        stays so after a forward without backward, e.g. an evaluation): reshard first."""
        self.model.reshard()  # type: ignore[operator]
        return list(self.model.named_parameters())

    def full_params(self) -> dict[str, torch.Tensor]:
        """The whole parameters on every rank of the node (an all_gather of the shards, in name order)."""
        return self._all_gather((name, _local(p.detach())) for name, p in self.sharded_params())

    def _all_gather(self, shards: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        out = {}
        for name, shard in shards:
            local = shard.contiguous()
            parts = [torch.empty_like(local) for _ in range(self.ranks)]
            dist.all_gather(parts, local, group=self.group)
            out[name] = torch.cat(parts).cpu()
        return out

    def digest(self) -> str:
        """`demonet.wire.digest.param_digest` of the whole parameters, on local rank 0 ("" elsewhere).

        The shards are gathered to rank 0 one parameter at a time, so only one whole tensor is
        ever held there (every rank calls this).
        """
        dst = dist.get_global_rank(self.group, 0)

        def whole() -> Iterator[tuple[str, torch.Tensor]]:
            for name, p in self.sharded_params():
                local = _local(p.detach()).contiguous()
                parts = [torch.empty_like(local) for _ in range(self.ranks)] if self.rank == 0 else None
                dist.gather(local, parts, dst=dst, group=self.group)
                if parts is not None:
                    yield name, torch.cat(parts)

        if self.rank == 0:
            return param_digest(whole())
        for _ in whole():
            pass
        return ""

    def load_full(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Set the parameters from whole tensors every rank holds (e.g. downloaded, then broadcast)."""
        with torch.no_grad():
            for name, p in self.sharded_params():
                full = tensors[name]
                if tuple(full.shape) != self.full_shapes[name]:
                    raise ValueError(f"{name}: shape {tuple(full.shape)}, expected {self.full_shapes[name]}")
                rows = full.shape[0] // self.ranks
                _local(p).copy_(full[self.rank * rows:(self.rank + 1) * rows])

    # -- checkpoints: one folder per node, written by its ranks together (DCP over the node's group) --

    def _dcp_state(self) -> dict[str, Any]:
        """Parameters (FSDP's DTensors) and the optimizer state as DTensors sharded like them.

        DeMo keeps a parameter's state in block layout (chunks, h * w); its shard holds a contiguous
        range of the blocks, so the momentum of the whole node is a DTensor sharded on dim 0.
        """
        optim: dict[str, Any] = {}
        for name, p in self.sharded_params():
            entries = self.opt.state[p]
            for key in _STATE_KEYS:
                if key in entries:
                    optim[f"{name}.{key}"] = DTensor.from_local(entries[key], self.mesh, [Shard(0)], run_check=False)
            if "step" in entries:
                optim[f"{name}.step"] = entries["step"]
        # The data stream is per rank: each rank's position is an entry of its own (a user's batches that
        # have no `state_dict` start again from their seed on a resume, as a Trainer's do).
        state = {"model": get_model_state_dict(self.model), "optim": optim, "step": torch.tensor(self.step)}
        if hasattr(self.batches, "state_dict"):
            state[f"data{self.rank}"] = self.batches.state_dict()
        return state

    def save_folder(self, folder: Path) -> None:
        """Write this node's checkpoint (every rank of the node calls it).

        The ranks write a fresh folder next to it, which then replaces the old one: a crash midway
        leaves the previous checkpoint whole.
        """
        state = self._dcp_state()
        tmp, old = folder.with_name(folder.name + ".tmp"), folder.with_name(folder.name + ".old")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier(group=self.group)
        dcp_save(state, storage_writer=FileSystemWriter(tmp), process_group=self.group)
        if self.rank == 0:  # dcp.save returns on rank 0 once every rank's files and the metadata are written
            shutil.rmtree(old, ignore_errors=True)
            if folder.exists():
                os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        dist.barrier(group=self.group)

    def load_folder(self, folder: Path) -> None:
        """Resume from `save`'s folder: parameters, momentum (and Adam moments), data stream, step."""
        state = self._dcp_state()
        dcp_load(state, checkpoint_id=os.fspath(folder), process_group=self.group)
        set_model_state_dict(self.model, state["model"])
        with torch.no_grad():
            for name, p in self.sharded_params():
                entries = self.opt.state[p]
                for key in _STATE_KEYS:
                    if key in entries:
                        entries[key].copy_(_local(state["optim"][f"{name}.{key}"]))
                if "step" in entries:
                    entries["step"] = state["optim"][f"{name}.step"].clone()
        if hasattr(self.batches, "load_state_dict") and f"data{self.rank}" in state:
            self.batches.load_state_dict(state[f"data{self.rank}"])
        self.step = int(state["step"])

    # -- the round loop's view (`demonet.train.replica.Replica`); every rank calls each of these --------

    def expected(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (shape, torch.float32) for name, shape in self.full_shapes.items()}

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.full_params().items())

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.opt.undo_lookahead()  # a held lookahead's base-optimizer state goes back first
        self.load_full(tensors)

    def restore(self, payload: Payload) -> None:
        self.opt.restore(payload)

    def settle(self, payload: Payload | None, result: Settled, contributed: bool) -> None:
        """`demonet.train.trainer.settle` on this rank's rows of the aggregate."""
        settle(self.opt, payload, result, contributed, local=self.local_aggregate,
               lr=self.options.lr_at(result.round))

    def save(self, meta: dict[str, Any]) -> None:
        """The node's checkpoint folder, and `meta` (round, resyncs) beside it as JSON."""
        if self.checkpoint is None:
            return
        with self.opt.momentum_before_compress():  # an overlapped rank's next payload is not this round's
            self.save_folder(self.checkpoint)
        if self.rank == 0:
            (self.checkpoint / "round.json").write_text(json.dumps(meta))

    def saved(self) -> dict[str, Any] | None:
        path = self.checkpoint / "round.json" if self.checkpoint is not None else None
        return dict(json.loads(path.read_text())) if path is not None and path.exists() else None

    def resume(self, *, momentum: bool) -> None:
        """Take the whole checkpoint (momentum, data streams) only if it is of the current round."""
        if momentum and self.checkpoint is not None:
            self.load_folder(self.checkpoint)
