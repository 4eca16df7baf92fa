"""Golden regression: 20 seeded DeMo steps of the tiny model; losses and a parameter digest as JSON.

Regenerate with UPDATE_GOLDEN=1 after an intended change of the math; a refactor must keep it.
The digest is compared only on the torch build and CPU kernel level it was recorded with (other
builds may round differently); the losses are compared everywhere, to 1e-5.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from demonet.data import Batches, load_corpus
from demonet.digest import param_digest
from demonet.model import GPT, ModelConfig
from demonet.optim import DeMo, aggregate

GOLDEN = Path(__file__).parents[1] / "golden" / "demo_losses.json"


def _run() -> dict[str, object]:
    torch.manual_seed(0)
    cfg = ModelConfig(seq_len=64, d_model=64, n_layers=2, n_heads=2)
    models = [GPT(cfg) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [DeMo(m.named_parameters(), lr=3e-3, compression_topk=8, compression_chunk=32) for m in models]
    data = load_corpus()
    streams = [Batches(data, batch_size=4, seq_len=64, seed=0, rank=r, world=2) for r in range(2)]
    losses = []
    for _ in range(20):
        payloads, step_losses = [], []
        for model, opt, stream in zip(models, opts, streams, strict=True):
            x, y = next(stream)
            _, loss = model(x, y)
            assert loss is not None
            loss.backward()
            step_losses.append(round(float(loss.detach()), 6))
            payloads.append(opt.compress())
        agg = aggregate(payloads)
        for opt in opts:
            opt.apply(agg)
            opt.zero_grad()
        losses.append(step_losses)
    digests = {param_digest(m.named_parameters()) for m in models}
    assert len(digests) == 1
    return {"losses": losses, "digest": digests.pop(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def test_golden_losses() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thread count can change reduction order in the model's kernels
    try:
        got = _run()
    finally:
        torch.set_num_threads(threads)
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
        pytest.skip("golden file rewritten")
    want = json.loads(GOLDEN.read_text())
    assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(want["losses"]), atol=1e-5, rtol=0)
    if (got["torch"], got["cpu_capability"]) == (want["torch"], want["cpu_capability"]):
        assert got["digest"] == want["digest"]
