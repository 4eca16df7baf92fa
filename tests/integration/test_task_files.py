"""A volunteer joins with one command: a `demonet coordinator` process of the Hugging Face task, whose `[task] model`
is a relative path in its own working folder, ships the folder's config.json and tokenizer.json at join
(docs/protocol.md#task-files), and a `demonet peer --coordinator` process started in an empty folder with an empty
HOME, with no task, config or files, trains the run on them and ends on the coordinator's digest.

The folder holds weights too (a fine-tune): they never ship; the peer builds the model from config.json and
downloads the coordinator's parameters at join. GetTaskFiles is refused to a caller that has not joined, and a peer
refuses a run whose token file is a path its machine does not have, before it trains.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

pytest.importorskip("transformers", reason="the Hugging Face task needs transformers (pip install 'demonet[hf]')")
pytest.importorskip("tokenizers", reason="the BPE token file needs tokenizers (pip install 'demonet[hf]')")

from demonet.coordinator.weights import read_state  # noqa: E402
from demonet.train.data import default_corpus  # noqa: E402
from demonet.train.tokens import write_tokens  # noqa: E402
from demonet.transport.grpc import GrpcClient  # noqa: E402
from tests.integration.common import listening_line, metrics_rows, rows_by_round  # noqa: E402
from tests.procs import Reaper  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TASK = "demonet.tasks.hf:causal_lm"
TOKEN = "task-files-token"
VOCAB = 384
STEPS = 3
SHIPPED = ["config.json", "generation_config.json", "tokenizer.json"]
"""What the model folder holds beside its weights (`save_pretrained` writes the generation config)."""
ENV = {**os.environ, "DEMONET_TOKEN": TOKEN,
       "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


def _model_folder(folder: Path, corpus: Path) -> str:
    """A tiny Llama with weights (a fine-tune) and a BPE tokenizer trained here; returns the tokenizer's name as
    `demonet data tokenize` writes it (NAME@16 hex digits of its tokenizer.json's SHA-256)."""
    import tokenizers
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train([str(corpus)], tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(11)  # not the run's seed: a peer that built its own init would not be on these weights
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    bpe.save(str(folder / "tokenizer.json"))
    return f"tiny@{hashlib.sha256((folder / 'tokenizer.json').read_bytes()).hexdigest()[:16]}"


@pytest.fixture(scope="module")
def coordinator_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The coordinator's working folder: models/tiny (config.json, model.safetensors, tokenizer.json) and a run
    config naming it by a relative path; the token file is elsewhere, by an absolute path."""
    root = tmp_path_factory.mktemp("coordinator")
    data = tmp_path_factory.mktemp("data")
    (data / "corpus.txt").write_bytes(default_corpus())
    (root / "models").mkdir()
    name = _model_folder(root / "models" / "tiny", data / "corpus.txt")
    import tokenizers

    bpe = tokenizers.Tokenizer.from_file(str(root / "models" / "tiny" / "tokenizer.json"))
    ids = bpe.encode((data / "corpus.txt").read_text(encoding="utf-8"), add_special_tokens=False).ids
    write_tokens(data / "corpus.tok", [ids], vocab_size=VOCAB, tokenizer=name)
    (root / "run.toml").write_text(
        f'[train]\ntask = "{TASK}"\n'
        f'[task]\nmodel = "models/tiny"\ntokens = "{data / "corpus.tok"}"\nbatch_size = 4\nseq_len = 32\n'
        "[net]\nround_timeout_s = 30.0\nstart_peers = 1\n")
    return root


def _coordinator(folder: Path, config: str, reap: Reaper, log: Path, steps: int = STEPS
                 ) -> tuple[subprocess.Popen[bytes], str]:
    proc = reap.add(subprocess.Popen(
        [sys.executable, "-m", "demonet", "coordinator", "--listen", "127.0.0.1:0", "--config", config, "--steps",
         str(steps), "--state-dir", f"state-{Path(config).stem}"], stdout=subprocess.PIPE,
        stderr=reap.open(log, "wb"), env=ENV, cwd=folder))
    line = listening_line(proc, 120)
    assert line.startswith("listening on "), log.read_text()[-3000:]
    return proc, line.split()[-1]


def _peer(address: str, tmp_path: Path, peer_id: str = "solo") -> tuple[Path, subprocess.CompletedProcess[str]]:
    """`demonet peer --coordinator ADDRESS` in an empty folder, with an empty HOME: its folder and how it ended."""
    empty, home = tmp_path / "empty", tmp_path / "home"
    empty.mkdir(parents=True)
    home.mkdir()
    proc = subprocess.run([sys.executable, "-m", "demonet", "peer", "--coordinator", address, "--peer-id", peer_id,
                           "--threads", "1"], capture_output=True, text=True, timeout=300,
                          env={**ENV, "HOME": str(home)}, cwd=empty, check=False)
    return empty, proc


async def _run_config(address: str) -> dict[str, Any]:
    """The run config a probe gets (what every peer builds from)."""
    client = GrpcClient(address, token=TOKEN, peer_id="visitor", reconnect_timeout_s=30.0)
    try:
        return dict((await client.join(probe=True)).run_config)
    finally:
        await client.close()


async def _unjoined_call(address: str) -> tuple[list[str], grpc.StatusCode]:
    """A probe's list of task files, and what GetTaskFiles answers a caller that never joined."""
    client = GrpcClient(address, token=TOKEN, peer_id="visitor", reconnect_timeout_s=30.0)
    try:
        probe = await client.join(probe=True)
        try:
            await client.get_task_files(probe.task_files)
        except grpc.aio.AioRpcError as e:
            return [f[0] for f in probe.task_files], e.code()
        return [f[0] for f in probe.task_files], grpc.StatusCode.OK
    finally:
        await client.close()


def test_a_peer_in_an_empty_folder_trains_the_run_on_the_files_it_ships(coordinator_folder: Path, tmp_path: Path,
                                                                      reap_children: Reaper) -> None:
    coordinator, address = _coordinator(coordinator_folder, "run.toml", reap_children, tmp_path / "coordinator.log")
    listed, code = asyncio.run(_unjoined_call(address))
    assert listed == SHIPPED and code == grpc.StatusCode.FAILED_PRECONDITION
    empty, peer = _peer(address, tmp_path)
    assert peer.returncode == 0, peer.stderr[-4000:]
    reap_children.stop([coordinator], 30.0)
    (copy,) = (empty / "runs" / "peer").glob("task-*")
    shipped = coordinator_folder / "models" / "tiny"
    assert "model.safetensors" in {p.name for p in shipped.iterdir()}
    assert sorted(p.name for p in copy.iterdir()) == SHIPPED  # never the weights
    assert all((copy / n).read_bytes() == (shipped / n).read_bytes() for n in SHIPPED)
    size = sum((shipped / n).stat().st_size for n in SHIPPED)
    assert re.search(rf"the run's task files \({re.escape(', '.join(SHIPPED))}: {size} bytes, fetched and checked in "
                     r"\d+\.\d{3} s\) are in ", peer.stderr), peer.stderr[-3000:]
    by_round = rows_by_round(lambda p: metrics_rows(empty / "runs" / "peer", p), ["solo"])  # no resync either
    assert sorted(by_round) == list(range(STEPS))
    rows = [by_round[r]["solo"] for r in range(STEPS)]
    assert all(r["param_digest"] == r["canonical_digest"] and r["resyncs"] == 0 for r in rows), rows
    assert all(math.isfinite(r["loss"]) and r["loss"] < 1.5 * math.log(VOCAB) for r in rows), rows
    assert rows[-1]["canonical_digest"] == read_state(coordinator_folder / "state-run").digest


def test_a_peer_refuses_a_token_file_its_machine_does_not_have(coordinator_folder: Path, tmp_path: Path,
                                                              reap_children: Reaper) -> None:
    (coordinator_folder / "corpus.tok").write_bytes(Path(_tokens(coordinator_folder)).read_bytes())
    (coordinator_folder / "relative.toml").write_text(
        (coordinator_folder / "run.toml").read_text().replace(_tokens(coordinator_folder), "corpus.tok"))
    coordinator, address = _coordinator(coordinator_folder, "relative.toml", reap_children,
                                         tmp_path / "coordinator.log")
    empty, peer = _peer(address, tmp_path)
    reap_children.stop([coordinator], 15.0)
    assert peer.returncode == 2, peer.stderr[-3000:]
    assert ("the run's token file 'corpus.tok' ([task] tokens) is a path that is not on this machine: serve the "
            "token file over http(s) or s3 and set [task] tokens to its URL") in peer.stderr
    assert not list((empty / "runs" / "peer").glob("metrics-*")) and not list((empty / "runs" / "peer").glob("task-*"))


def _tokens(folder: Path) -> str:
    line = next(x for x in (folder / "run.toml").read_text().splitlines() if x.startswith("tokens = "))
    return line.split('"')[1]


def test_a_volunteer_with_nothing_trains_ten_rounds_reading_the_run_s_token_file_by_range(
        coordinator_folder: Path, tmp_path: Path, reap_children: Reaper) -> None:
    """The whole one-command join: the token file (in shards, with its sidecar) is served over HTTP by a range
    server; the coordinator pins it (`[task] tokens_pin`) and ships the model's files; a peer with nothing trains
    10 rounds on the coordinator's digest, reading a small part of the file, through a restart of the data
    server, and stops. Then the file on the
    server is swapped for another: a new peer is refused before it trains, naming the run's pin."""
    from demonet.train.shards import write_shards
    from tests.integration.test_token_urls import Server

    www = tmp_path / "www"
    www.mkdir()
    (www / "corpus.tok").write_bytes(Path(_tokens(coordinator_folder)).read_bytes())
    _, pin = write_shards(www / "corpus.tok", 1024)
    server = Server(www, reap_children)
    (coordinator_folder / "url.toml").write_text((coordinator_folder / "run.toml").read_text().replace(
        _tokens(coordinator_folder), server.url("corpus.tok")))
    coordinator, address = _coordinator(coordinator_folder, "url.toml", reap_children, tmp_path / "coordinator.log",
                                         steps=1000)
    assert asyncio.run(_run_config(address))["task"]["tokens_pin"] == pin  # the coordinator's file pins the run's
    folder, home = tmp_path / "empty", tmp_path / "home"
    folder.mkdir()
    home.mkdir()
    peer = reap_children.add(subprocess.Popen(
        [sys.executable, "-m", "demonet", "peer", "--coordinator", address, "--peer-id", "solo", "--threads", "1"],
        stdout=subprocess.DEVNULL, stderr=reap_children.open(tmp_path / "solo.log", "wb"),
        env={**ENV, "HOME": str(home)}, cwd=folder))
    metrics = folder / "runs" / "peer" / "metrics-solo.jsonl"
    deadline = time.monotonic() + 240

    def trained(rounds: int) -> None:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rounds):
            assert peer.poll() is None and time.monotonic() < deadline, (tmp_path / "solo.log").read_text()[-3000:]
            time.sleep(0.1)

    trained(4)
    server.kill()  # the data server goes down mid-run and comes back on its port: retries, not the run
    time.sleep(3.0)  # rounds of a few tens of ms: the peer needs its next shards meanwhile
    server.start()
    trained(10)
    reap_children.stop([peer], 60.0)  # SIGTERM: it ends its open round and leaves
    assert "trying again" in (tmp_path / "solo.log").read_text()
    rows = metrics_rows(folder / "runs" / "peer", "solo")
    assert [r["round"] for r in rows[:10]] == list(range(10))
    assert all(r["param_digest"] == r["canonical_digest"] for r in rows)
    size = (www / "corpus.tok").stat().st_size
    served = server.get("_served")["served"]
    assert served < size / 2, (served, size)  # the windows it trained on and their shards, never the whole file

    other = np.fromfile(www / "corpus.tok", dtype="<u2", offset=256)[::-1].astype(np.int64)
    swapped = tmp_path / "swapped.tok"
    write_tokens(swapped, [other], vocab_size=VOCAB, tokenizer=_tokenizer_of(coordinator_folder))
    (www / "corpus.tok").write_bytes(swapped.read_bytes())  # the same header and size, other tokens: another pin
    write_shards(www / "corpus.tok", 1024)
    second, refused = _peer(address, tmp_path / "second", "second")
    reap_children.stop([coordinator], 30.0)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert pin in refused.stderr, refused.stderr[-3000:]
    assert not list((second / "runs" / "peer").glob("metrics-*"))


def _tokenizer_of(folder: Path) -> str:
    from demonet.train.tokens import read_header

    return read_header(_tokens(folder)).tokenizer
