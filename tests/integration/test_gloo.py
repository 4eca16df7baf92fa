"""DeMo.step() inside a real torch.distributed gloo group of 3 processes, against the reference semantics.

With DEMONET_BLOC97_DEMO=/path/to/bloc97/demo.py (and einops installed), the same run also checks
against the reference code itself; CI has no copy of it, so that part is skipped there.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from demonet.wire.digest import param_digest
from tests.procs import Reaper, free_port

pytestmark = pytest.mark.slow

WORLD = 3
STEPS = 5
SHAPES = [(128, 192), (64,), (96, 50), (200,)]
KW = {"lr": 0.01, "compression_topk": 8, "compression_chunk": 32}


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in SHAPES]


def _grads(params: list[torch.nn.Parameter], step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 0.01


def _worker(rank: int, port: int, out_dir: str, bloc97: str | None) -> None:
    from demonet.flex.__main__ import end_process
    from demonet.optim import DeMo
    from tests.reference_demo import ReferenceDeMo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        ours, oracle_params = _params(), _params()
        opt = DeMo(ours, **KW)
        oracle = ReferenceDeMo(oracle_params, **KW)
        real_params = _params()
        real = None
        if bloc97:
            spec = importlib.util.spec_from_file_location("bloc97_demo", bloc97)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            real = module.DeMo(real_params, **KW)
        agreement = 1.0
        for step in range(STEPS):
            before = [p.detach().clone() for p in ours]
            _grads(ours, step, rank)
            _grads(oracle_params, step, rank)
            opt.step()
            local = oracle.step_local()
            gathered: list[object] = [None] * WORLD
            dist.all_gather_object(gathered, local)
            us = oracle.apply_gathered(gathered)  # type: ignore[arg-type]
            for p, b, u in zip(ours, before, us, strict=True):
                same = (torch.sign((b - p.detach()) / KW["lr"]) == torch.sign(u)).float().mean().item()
                agreement = min(agreement, same)
            if real is not None:
                _grads(real_params, step, rank)
                real.step()
        result = {
            "digest": param_digest(enumerate(ours)),
            "max_diff_oracle": max(float((p - q).abs().max()) for p, q in zip(ours, oracle_params, strict=True)),
            "max_diff_bloc97": (max(float((p - q).abs().max()) for p, q in zip(ours, real_params, strict=True))
                                if real is not None else None),
            "agreement": agreement,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    end_process(0)  # not while gloo's threads may want the GIL: a finalizing interpreter aborts (see end_process)


def _run(tmp_path: Path, bloc97: str | None) -> list[dict[str, object]]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path), bloc97)) for r in range(WORLD)]
    with Reaper() as reaper:  # the ranks still running when one fails are killed on the way out
        for p in procs:
            p.start()
            reaper.add(p)
        for p in procs:
            p.join(timeout=120)
            assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_step_in_a_gloo_group_matches_the_reference(tmp_path: Path) -> None:
    results = _run(tmp_path, None)
    assert len({r["digest"] for r in results}) == 1, "ranks diverged"
    for r in results:
        assert r["max_diff_oracle"] < 1e-5  # type: ignore[operator]
        assert r["agreement"] > 0.9999  # type: ignore[operator]


@pytest.mark.reference
@pytest.mark.skipif(not os.environ.get("DEMONET_BLOC97_DEMO"), reason="set DEMONET_BLOC97_DEMO=/path/to/demo.py")
def test_step_matches_bloc97_itself(tmp_path: Path) -> None:
    pytest.importorskip("einops")
    results = _run(tmp_path, os.environ["DEMONET_BLOC97_DEMO"])
    for r in results:
        assert r["max_diff_bloc97"] < 1e-5  # type: ignore[operator]
