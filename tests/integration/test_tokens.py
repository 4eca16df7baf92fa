"""Bring your own tokenizer: train a small BPE on the embedded corpus, `demonet data tokenize` a text file with
it, then `demonet train` 2 peers on the token file (DEMONET_TRAIN_TOKENS) with a model whose vocab covers it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from demonet.train.data import default_corpus
from demonet.train.tokens import TokenFile, write_tokens
from tests.integration.common import listening_line
from tests.procs import Reaper

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 512


def _demonet(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "demonet", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, check=False)


def test_a_bpe_token_file_trains_the_builtin_gpt(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    text = tmp_path / "corpus.txt"
    text.write_bytes(default_corpus())
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train([str(text)], tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    (tmp_path / "bpe").mkdir()
    bpe.save(str(tmp_path / "bpe" / "tokenizer.json"))

    tokenized = _demonet(["data", "tokenize", str(text), "--out", "corpus.tok", "--tokenizer", "bpe"], tmp_path)
    assert tokenized.returncode == 0, tokenized.stderr
    header = TokenFile.open(tmp_path / "corpus.tok").header
    assert json.loads(tokenized.stdout)["num_tokens"] == header.num_tokens
    assert header.vocab_size == VOCAB and header.dtype == "uint16" and header.tokenizer.startswith("bpe@")
    assert header.num_tokens < len(default_corpus()) / 1.5  # BPE merges: far fewer tokens than bytes

    (tmp_path / "run.toml").write_text(
        f"[model]\nvocab_size = {VOCAB}\nseq_len = 64\nd_model = 64\nn_layers = 2\nn_heads = 2\n"
        "[train]\nbatch_size = 4\nseq_len = 64\neval_every = 5\n")
    trained = _demonet(["train", "--config", "run.toml", "--steps", "5", "--peers", "2", "--out", "run",
                        "--no-progress", "--threads", "1"], tmp_path, DEMONET_TRAIN_TOKENS="corpus.tok")
    assert trained.returncode == 0, trained.stderr
    summary = json.loads(trained.stdout)
    assert summary["peers"] == 2 and summary["steps"] == 5
    for loss in (summary["first_loss"], summary["last_loss"], summary["val_loss"]["5"]):
        assert math.isfinite(loss)
    assert summary["first_loss"] > 0.8 * math.log(VOCAB)  # an untrained model guesses over the BPE vocab
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["train"]["tokens"] == "corpus.tok" and config["model"]["vocab_size"] == VOCAB

    # The default byte-level model (vocab 256) does not cover the file: refused before any peer starts.
    refused = _demonet(["train", "--steps", "1", "--peers", "1", "--out", "refused", "--no-progress"], tmp_path,
                       DEMONET_TRAIN_TOKENS="corpus.tok")
    assert refused.returncode == 2
    assert f"model.vocab_size should be >= {VOCAB}, the vocab of the token file corpus.tok" in refused.stderr
    assert not (tmp_path / "refused").exists()


def test_a_peer_whose_token_file_has_another_tokenizer_is_refused_before_it_joins(tmp_path: Path,
                                                                                   reap_children: Reaper) -> None:
    """A real coordinator on `corpus.tok` (bytes) pins the run's tokenizer; a peer whose `corpus.tok` (same path,
    its own folder) was made with another tokenizer exits 2 naming both, and is never a member."""
    config = ("[model]\nd_model = 32\nn_layers = 1\nn_heads = 2\nseq_len = 32\n"
              "[train]\nseq_len = 32\nbatch_size = 2\ntokens = \"corpus.tok\"\n[net]\nround_timeout_s = 5.0\n")
    ids = [np.frombuffer(default_corpus()[:20000], dtype=np.uint8).astype(np.int64)]
    (tmp_path / "coord").mkdir()
    (tmp_path / "peer").mkdir()
    (tmp_path / "coord" / "run.toml").write_text(config)
    write_tokens(tmp_path / "coord" / "corpus.tok", ids, vocab_size=256, tokenizer="bytes")
    write_tokens(tmp_path / "peer" / "corpus.tok", ids, vocab_size=256, tokenizer="bpe@0123456789abcdef")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DEMONET_TOKEN": "tokens-test"}
    coordinator = reap_children.add(subprocess.Popen(
        [sys.executable, "-m", "demonet", "coordinator", "--listen", "127.0.0.1:0", "--config", "run.toml"],
        cwd=tmp_path / "coord", stdout=subprocess.PIPE, stderr=reap_children.open(tmp_path / "coord.log", "w"),
        stdin=subprocess.DEVNULL, env=env))
    line = listening_line(coordinator, 60.0)
    assert line.startswith("listening on "), (tmp_path / "coord.log").read_text()
    peer = subprocess.run([sys.executable, "-m", "demonet", "peer", "--coordinator", line.split()[-1], "--peer-id",
                           "p0", "--out", "out", "--threads", "1"], cwd=tmp_path / "peer", capture_output=True,
                          text=True, timeout=120, env=env, check=False)
    reap_children.stop([coordinator], 10.0)
    assert peer.returncode == 2, peer.stdout + peer.stderr
    assert "was made with tokenizer 'bpe@0123456789abcdef'; the run's is 'bytes'" in peer.stdout + peer.stderr
    assert "joined" not in (tmp_path / "coord.log").read_text()
