"""The Hugging Face task over real processes and sockets, on a tiny Llama config and a BPE token file made here.

`demonet up --task demonet.tasks.hf:causal_lm` runs 2 peers to the same digest with a finite loss;
`demonet export` of that run's coordinator state is a folder that `from_pretrained` loads bit for bit;
examples/hf_trainer.py (the HF Trainer with `run.optimizer(model)`) runs as 2 peers of a
`demonet coordinator` of the task, both ending on the coordinator's digest.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the Hugging Face task needs transformers (pip install 'demonet[hf]')")
pytest.importorskip("tokenizers", reason="the BPE token file needs tokenizers (pip install 'demonet[hf]')")

from demonet.train.data import default_corpus  # noqa: E402
from demonet.train.tokens import write_tokens  # noqa: E402
from tests.integration.common import listening_line, metrics_rows, rows_by_round  # noqa: E402
from tests.procs import Reaper  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TASK = "demonet.tasks.hf:causal_lm"
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
TOKEN = "hf-test-token"
VOCAB = 512
ENV = {**os.environ, "DEMONET_TOKEN": TOKEN,
       "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BPE tokenizer trained on the embedded corpus, the corpus as its token file, a tiny Llama config (2 layers,
    32 wide, 2 heads, tied embeddings; written by the example) and a run config of the task."""
    import tokenizers
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("hf")
    text = root / "corpus.txt"
    text.write_bytes(default_corpus())
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train([str(text)], tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    ids = bpe.encode(text.read_text(encoding="utf-8"), add_special_tokens=False).ids
    write_tokens(root / "corpus.tok", [ids], vocab_size=bpe.get_vocab_size(), tokenizer="bpe")
    wrote = subprocess.run([sys.executable, str(EXAMPLE), "--write-model", str(root / "tiny"), "--vocab-size",
                            str(VOCAB)], capture_output=True, text=True, timeout=120, env=ENV, check=False)
    assert wrote.returncode == 0, wrote.stderr
    config = AutoConfig.from_pretrained(str(root / "tiny"), local_files_only=True)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.vocab_size) == ("llama", 32, 2,
                                                                                                    VOCAB)
    (root / "run.toml").write_text(
        f'[train]\ntask = "{TASK}"\n'
        f'[task]\nmodel = "{root / "tiny"}"\ntokens = "{root / "corpus.tok"}"\nbatch_size = 4\nseq_len = 32\n'
        "[net]\nround_timeout_s = 30.0\nstart_peers = 2\n")
    return root


def _demonet(*argv: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "demonet", *argv], capture_output=True, text=True, timeout=timeout,
                          env=ENV, cwd=ROOT, check=False)


@pytest.fixture(scope="module")
def up_run(workdir: Path) -> Path:
    """`demonet up` of the task: 2 peers, 6 rounds; its run folder."""
    out = workdir / "up"
    proc = _demonet("up", "--task", TASK, "--config", str(workdir / "run.toml"), "--peers", "2", "--steps", "6",
                    "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:] + "".join(
        p.read_text()[-2000:] for p in (out / "logs").glob("*.log"))
    (out / "stdout.json").write_text(proc.stdout)
    return out


def test_demonet_up_trains_the_hf_task(up_run: Path) -> None:
    summary = json.loads((up_run / "stdout.json").read_text())
    assert summary["digests_agree"] and summary["peers"] == 2 and summary["rounds"] == 6, summary
    assert math.isfinite(summary["first_loss"]) and math.isfinite(summary["last_loss"]), summary
    assert summary["first_loss"] > 0.8 * math.log(VOCAB)  # an untrained model guesses over the BPE vocab
    rows = [json.loads(line) for line in (up_run / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) and r["contributors"] == 2 for r in rows), rows


def test_export_of_the_run_loads_with_from_pretrained_bit_for_bit(up_run: Path, workdir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from demonet.coordinator.weights import read_state

    out = workdir / "exported"
    proc = _demonet("export", "--state-dir", str(up_run / "coordinator"), "--out", str(out))  # the run's model
    assert proc.returncode == 0, proc.stderr
    saved = read_state(up_run / "coordinator")
    assert saved.round == 6 and saved.digest in proc.stdout
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    named = dict(model.named_parameters())
    assert list(named) == list(saved.params) and "lm_head.weight" not in named  # tied: stored once
    for name, p in saved.params.items():
        assert named[name].dtype == p.dtype and torch.equal(named[name].view(torch.int32), p.view(torch.int32)), name
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_two_hf_trainers_end_on_the_coordinators_parameters(workdir: Path, tmp_path: Path,
                                                            reap_children: Reaper) -> None:
    steps, out = 4, tmp_path / "out"
    coordinator = reap_children.add(subprocess.Popen(
        [sys.executable, "-m", "demonet", "coordinator", "--listen", "127.0.0.1:0", "--task", TASK, "--config",
         str(workdir / "run.toml"), "--steps", str(steps), "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.PIPE, stderr=reap_children.open(tmp_path / "coordinator.log", "wb"), env=ENV, cwd=ROOT))
    line = listening_line(coordinator, 120)
    assert line.startswith("listening on "), (tmp_path / "coordinator.log").read_text()[-3000:]
    procs = {name: reap_children.add(subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--coordinator", line.split()[-1], "--peer-id", name, "--out", str(out),
         "--threads", "1"], stdout=subprocess.PIPE, stderr=reap_children.open(tmp_path / f"{name}.log", "wb"),
        env=ENV, cwd=tmp_path, start_new_session=True), group=True) for name in ("alice", "bob")}
    summaries = {}
    for name, proc in procs.items():
        stdout, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, (tmp_path / f"{name}.log").read_text()[-4000:]
        summaries[name] = json.loads(stdout.decode().strip().splitlines()[-1])
    reap_children.stop([coordinator], 15.0)
    by_round = rows_by_round(lambda p: metrics_rows(out, p), ["alice", "bob"])
    assert sorted(by_round) == list(range(steps))
    for round_, rows in by_round.items():
        assert set(rows) == {"alice", "bob"}, round_
        assert len({r["param_digest"] for r in rows.values()} | {r["canonical_digest"] for r in rows.values()}) == 1
        assert all(r["contributors"] == 2 and math.isfinite(r["loss"]) for r in rows.values()), rows
    final = by_round[steps - 1]["alice"]["canonical_digest"]
    assert {s["digest"] for s in summaries.values()} == {final}
    assert all(s["round"] == steps and s["reason"] == "the run is over" for s in summaries.values()), summaries
