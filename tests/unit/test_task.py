"""The task contract: building a run's task, its errors, and how a model is compared with the run's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import demonet
from demonet.config import load_config
from demonet.train.model import GPT
from demonet.train.task import build_task, first_difference, param_specs
from demonet.train.trainer import Trainer


def _cfg(task: str = "", **table: object) -> object:
    return load_config(None, {}, {"train": {"task": task}, "task": dict(table)})


def test_the_builtin_task_is_the_seeded_gpt() -> None:
    cfg = load_config(None, {}, {"model": {"d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 16},
                                 "train": {"seq_len": 16, "seed": 5}})
    torch.manual_seed(5)
    want = GPT(cfg.model)
    trainer = Trainer.for_run(cfg, data_seed=1, device=torch.device("cpu"))
    for (n, a), (m, b) in zip(want.named_parameters(), trainer.model.named_parameters(), strict=True):
        assert n == m and torch.equal(a, b)
    x_BT, y_BT = next(trainer.batches)
    assert x_BT.shape == (cfg.train.batch_size, 16) and torch.equal(x_BT[:, 1:], y_BT[:, :-1])


def test_a_user_task_gets_the_task_table_and_the_run_seed() -> None:
    a = build_task(_cfg("examples.custom_task:task", classes=3))
    b = build_task(_cfg("examples.custom_task:task", classes=3))
    assert isinstance(a, demonet.Task)
    assert param_specs(a.model.named_parameters())[-1] == ("7.bias", (3,), "float32")  # classes=3 reached it
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))
    images, labels = next(a.batches(7))
    again, _ = next(b.batches(7))
    assert images.shape == (32, 1, 16, 16) and torch.equal(images, again)  # a peer's stream is its seed's
    assert not torch.equal(images, next(a.batches(8))[0])


@pytest.mark.parametrize(("spec", "message"), [
    ("no_such_module_here:task", "cannot import 'no_such_module_here'"),
    ("examples.custom_task:nothing", "has no function 'nothing'"),
    ("tests.integration.tasks:broken", "failed: RuntimeError: no data here"),
    ("tests.integration.tasks:not_a_task", "returned a dict, not a demonet.Task"),
    ("tests.integration.tasks:no_parameters", "the model has no trainable parameters"),
])
def test_a_task_that_cannot_be_built_is_a_clear_error(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_task(_cfg(spec))


def test_a_task_that_fails_is_named_with_the_arguments_it_was_given() -> None:
    with pytest.raises(ValueError, match=r"tasks:broken\(size=8, tokens='data/corpus.tok'\) failed"):
        build_task(_cfg("tests.integration.tasks:broken", size=8, tokens="data/corpus.tok"))


def test_the_task_setting_is_checked_and_the_table_travels_with_the_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="task should be MODULE:FUNCTION"):
        load_config(None, {}, {"train": {"task": "examples.custom_task"}})
    path = tmp_path / "run.toml"
    path.write_text('[train]\ntask = "examples.custom_task:task"\n[task]\nclasses = 3\nsize = 8\n')
    cfg = load_config(path)
    assert cfg.task == {"classes": 3, "size": 8}
    assert load_config(None, {}, cfg.to_dict()) == cfg  # as a coordinator hands it to its peers


def test_first_difference_names_the_parameter() -> None:
    run = [("w", (4, 3), "float32"), ("b", (3,), "float32")]
    assert first_difference(run, run) is None
    assert "parameter 'w' is [4, 5] float32 here, [4, 3] float32 in the run" in str(
        first_difference([("w", (4, 5), "float32"), ("b", (3,), "float32")], run))
    assert "none of that name" in str(first_difference([("b", (3,), "float32")], run))
    assert "'extra'" in str(first_difference([*run, ("extra", (1,), "float32")], run))
    assert "dtype" not in str(first_difference([("w", (4, 3), "bfloat16"), ("b", (3,), "float32")], run)) and \
        "bfloat16" in str(first_difference([("w", (4, 3), "bfloat16"), ("b", (3,), "float32")], run))
    assert "order" in str(first_difference(list(reversed(run)), run))
