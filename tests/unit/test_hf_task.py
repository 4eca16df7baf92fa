"""The Hugging Face task (`demonet.tasks.hf:causal_lm`) and `demonet export` of its runs as a model folder, on a
tiny Llama config in-process: what it builds, every refused input, and a bit-exact export that
`from_pretrained` loads, with tied and untied embeddings."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face task needs transformers (pip install 'demonet[hf]')")
pytest.importorskip("safetensors", reason="export needs safetensors (pip install 'demonet[hf]')")

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from demonet.cli import main as demonet  # noqa: E402
from demonet.config import Config, load_config  # noqa: E402
from demonet.coordinator.state import CanonicalState  # noqa: E402
from demonet.coordinator.weights import export_pretrained, read_state  # noqa: E402
from demonet.errors import WeightsFileError  # noqa: E402
from demonet.tasks.hf import TASK, causal_lm, model_config, run_model_dir  # noqa: E402
from demonet.train.task import build_task  # noqa: E402
from demonet.train.tokens import write_tokens  # noqa: E402

VOCAB = 512


def _llama(folder: Path, *, tied: bool = True, layers: int = 2, vocab: int = VOCAB) -> Path:
    LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=tied).save_pretrained(folder)
    return folder


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    ids = np.random.default_rng(0).integers(0, VOCAB, 4000)
    write_tokens(tmp_path / "corpus.tok", [ids], vocab_size=VOCAB, tokenizer="test")
    return tmp_path / "corpus.tok"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return _llama(tmp_path / "tiny")


def _task_config(model: Path, tokens: Path) -> Config:
    return load_config(None, {}, {"train": {"task": TASK, "seed": 3},
                                  "task": {"model": str(model), "tokens": str(tokens), "batch_size": 2,
                                           "seq_len": 16}})


def test_causal_lm_pretrains_from_a_config_alone(model_dir: Path, tokens: Path) -> None:
    cfg = _task_config(model_dir, tokens)
    task, again = build_task(cfg), build_task(cfg)  # seeded with the run seed: the same init everywhere
    assert [n for n, _ in task.model.named_parameters()] == [n for n, _ in again.model.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(task.model.parameters(), again.model.parameters(), strict=True))
    assert all(p.dtype == torch.float32 for p in task.model.parameters()) and task.model.training
    x_BT, y_BT = next(task.batches(1))
    assert x_BT.shape == y_BT.shape == (2, 16) and torch.equal(x_BT[:, 1:], y_BT[:, :-1])
    assert not torch.equal(x_BT, next(task.batches(2))[0])  # each peer its own windows
    loss = task.loss(task.model, (x_BT, y_BT))
    assert loss.ndim == 0 and abs(float(loss.detach()) - math.log(VOCAB)) < 0.5  # an untrained model guesses
    loss.backward()
    assert all(p.grad is not None for p in task.model.parameters())


def test_causal_lm_fine_tunes_the_weights_in_the_folder(model_dir: Path, tokens: Path) -> None:
    torch.manual_seed(11)
    pretrained = AutoModelForCausalLM.from_config(model_config(model_dir))
    pretrained.save_pretrained(model_dir)
    torch.manual_seed(0)
    task = causal_lm(model=str(model_dir), tokens=str(tokens), batch_size=2, seq_len=16)
    mine = dict(task.model.named_parameters())
    assert all(torch.equal(mine[n], p) for n, p in pretrained.named_parameters())
    assert task.model.training


def _bad_folder(tmp_path: Path, case: str) -> Path:
    folder = tmp_path / case
    folder.mkdir()
    config: dict[str, Any] | str | None = {
        "no config.json": None, "not JSON": "{not json", "no model_type": {"hidden_size": 32},
        "unknown type": {"model_type": "no-such-model"}, "not causal": {"model_type": "t5"},
    }[case]
    if config is not None:
        (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return folder


@pytest.mark.parametrize(("case", "words"), [
    ("no config.json", "holds no config.json"),
    ("not JSON", "is not a JSON config"),
    ("no model_type", "names no model_type"),
    ("unknown type", "unknown model type 'no-such-model'"),
    ("not causal", "model type 't5' is not a causal language model"),
])
def test_a_bad_model_folder_is_named_and_refused(tmp_path: Path, tokens: Path, case: str, words: str) -> None:
    folder = _bad_folder(tmp_path, case)
    with pytest.raises(ValueError, match=words):
        causal_lm(model=str(folder), tokens=str(tokens))
    with pytest.raises(ValueError, match=f"task {TASK}.* failed: ValueError: .*{words}"):
        build_task(_task_config(folder, tokens))


def test_a_model_that_is_not_a_local_folder_is_never_fetched(tokens: Path) -> None:
    with pytest.raises(ValueError, match="'meta-llama/Llama-3.2-1B' is not a local directory .* never downloads"):
        causal_lm(model="meta-llama/Llama-3.2-1B", tokens=str(tokens))


def test_a_token_file_beyond_the_models_vocab_is_refused(tmp_path: Path, tokens: Path) -> None:
    small = _llama(tmp_path / "small", vocab=256)
    with pytest.raises(ValueError, match=f"config.json: vocab_size should be >= {VOCAB}, the vocab of the token "
                                         f"file .*corpus.tok .*got 256"):
        causal_lm(model=str(small), tokens=str(tokens))


@pytest.mark.parametrize(("table", "words"), [
    ({"seq_len": 65}, "seq_len should be at most 64, the max_position_embeddings"),
    ({"batch_size": 0, "seq_len": 16}, "batch_size should be an int"),
    ({"seq_len": 0}, "seq_len should be an int"),
])
def test_bad_sizes_are_refused_when_the_task_is_built(model_dir: Path, tokens: Path, table: dict[str, int],
                                                     words: str) -> None:
    with pytest.raises(ValueError, match=words):
        causal_lm(model=str(model_dir), tokens=str(tokens), **table)


def test_a_missing_token_file_is_named(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere.tok"):
        causal_lm(model=str(model_dir), tokens=str(tmp_path / "nowhere.tok"))


def test_without_transformers_the_task_says_how_to_install_it(model_dir: Path, tokens: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(ValueError, match=r"needs transformers: pip install 'demonet\[hf\]'"):
        causal_lm(model=str(model_dir), tokens=str(tokens))


def test_run_model_dir_reads_only_this_tasks_table() -> None:
    assert run_model_dir({"train": {"task": TASK}, "task": {"model": "m"}}) == "m"
    assert run_model_dir({"train": {"task": "examples.custom_task:task"}, "task": {"model": "m"}}) is None
    assert run_model_dir({"train": {"task": ""}, "task": {}}) is None
    assert run_model_dir({}) is None


def _saved_run(model: Path, tokens: Path, state_dir: Path) -> CanonicalState:
    """A coordinator state of the HF task, its parameters moved off the seeded init."""
    state = CanonicalState(_task_config(model, tokens))
    gen = torch.Generator().manual_seed(5)
    state.set_params({n: p.detach() + 0.01 * torch.randn(p.shape, generator=gen) for n, p in state.params.items()})
    state.save(state_dir, {"rounds": {"round": 4, "members": [], "joiners": []}, "counters": {}})
    return state


@pytest.mark.parametrize("tied", [True, False])
def test_export_writes_a_folder_that_from_pretrained_loads_bit_for_bit(tmp_path: Path, tokens: Path,
                                                                       tied: bool) -> None:
    model = _llama(tmp_path / "tiny", tied=tied)
    state = _saved_run(model, tokens, tmp_path / "state")
    assert ("lm_head.weight" in state.params) is not tied  # a tied parameter is in the state once
    out = tmp_path / "exported"
    assert demonet(["export", "--state-dir", str(tmp_path / "state"), "--out", str(out)]) == 0  # the run's model
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "config.json").read_bytes() == (model / "config.json").read_bytes()
    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    named = dict(loaded.named_parameters())
    assert list(named) == list(state.params)
    for name, p in state.params.items():
        assert torch.equal(named[name].view(torch.int32), p.detach().view(torch.int32)), name
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tied


def test_export_of_an_hf_run_to_a_safetensors_name_is_the_plain_file(tmp_path: Path, model_dir: Path,
                                                                      tokens: Path) -> None:
    _saved_run(model_dir, tokens, tmp_path / "state")
    assert demonet(["export", "--state-dir", str(tmp_path / "state"), "--out", str(tmp_path / "p.safetensors")]) == 0
    assert (tmp_path / "p.safetensors").is_file()


def test_export_refuses_another_models_folder_and_writes_nothing(tmp_path: Path, model_dir: Path, tokens: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    _saved_run(model_dir, tokens, tmp_path / "state")
    deeper = _llama(tmp_path / "deeper", layers=3)
    argv = ["export", "--state-dir", str(tmp_path / "state"), "--out", str(tmp_path / "out")]
    assert demonet([*argv, "--hf-config", str(deeper)]) == 2
    assert "the run has parameter 'model.layers.2.self_attn.q_proj.weight'" in capsys.readouterr().err
    assert demonet([*argv, "--hf-config", str(tmp_path)]) == 2
    assert "holds no config.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_export_refuses_to_overwrite_and_a_file_as_the_folder(tmp_path: Path, model_dir: Path,
                                                              tokens: Path) -> None:
    _saved_run(model_dir, tokens, tmp_path / "state")
    saved, out = read_state(tmp_path / "state"), tmp_path / "out"
    export_pretrained(saved, out, model_dir)
    with pytest.raises(WeightsFileError, match="config.json exists; --force overwrites it"):
        export_pretrained(saved, out, model_dir)
    export_pretrained(saved, out, model_dir, force=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(WeightsFileError, match="is a file; a Hugging Face model is a folder"):
        export_pretrained(saved, tmp_path / "file", model_dir)


def test_export_says_when_the_runs_model_folder_is_not_here(tmp_path: Path, model_dir: Path, tokens: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    _saved_run(model_dir, tokens, tmp_path / "state")
    model_dir.rename(tmp_path / "moved")
    assert demonet(["export", "--state-dir", str(tmp_path / "state"), "--out", str(tmp_path / "out")]) == 2
    assert "is not a folder here; give the model folder with --hf-config MODELDIR" in capsys.readouterr().err
    assert demonet(["export", "--state-dir", str(tmp_path / "state"), "--out", str(tmp_path / "out"),
                    "--hf-config", str(tmp_path / "moved")]) == 0


def test_a_token_file_of_another_tokenizer_than_the_model_folders_is_refused(model_dir: Path, tmp_path: Path) -> None:
    (model_dir / "tokenizer.json").write_bytes(b'{"model": {"type": "BPE"}}')  # only its hash is read
    ours = hashlib.sha256((model_dir / "tokenizer.json").read_bytes()).hexdigest()[:16]
    ids = np.random.default_rng(0).integers(0, VOCAB, 4000)
    write_tokens(tmp_path / "other.tok", [ids], vocab_size=VOCAB, tokenizer="bpe@0123456789abcdef")
    with pytest.raises(ValueError, match=rf"made with tokenizer bpe@0123456789abcdef, but .*tokenizer.json hashes to "
                                         rf"{ours}: tokenize the corpus with this tokenizer"):
        causal_lm(model=str(model_dir), tokens=str(tmp_path / "other.tok"), batch_size=2, seq_len=16)
    write_tokens(tmp_path / "ours.tok", [ids], vocab_size=VOCAB, tokenizer=f"bpe@{ours}")
    assert causal_lm(model=str(model_dir), tokens=str(tmp_path / "ours.tok"), batch_size=2, seq_len=16).model


def test_a_coordinator_whose_model_folder_holds_a_file_over_the_cap_refuses_to_start(
        model_dir: Path, tokens: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from demonet.coordinator import main as coordinator
    from demonet.wire.task_files import MAX_FILE_BYTES

    with (model_dir / "tokenizer.json").open("wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: refused from its size before it is read, and before any port opens
    (tmp_path / "run.toml").write_text(f'[train]\ntask = "{TASK}"\n[task]\nmodel = "{model_dir}"\ntokens = "{tokens}"\n'
                                       "batch_size = 2\nseq_len = 16\n")
    monkeypatch.setenv("DEMONET_TOKEN", "t")
    assert coordinator(["--listen", "127.0.0.1:0", "--config", str(tmp_path / "run.toml"), "--no-dashboard"]) == 2
    assert "tokenizer.json is 16,777,217 bytes; a task file is at most 16,777,216 bytes" in capsys.readouterr().err
