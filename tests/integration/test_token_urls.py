"""Token data read by byte range from a real server: tests/range_server.py (a small range-capable Python server;
nginx is not on these machines) in its own process on loopback, and moto's S3 server for ``s3://``.

Batches from the URL are the local file's bit for bit; the bytes served stay within 1.2x the windows trained on
plus the header and sidecar; a flipped byte or a truncated range is caught and never trained on; a server killed
and restarted mid-stream costs retries; a new reader finds its shards in the cache and fetches nothing.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from demonet.config import load_config
from demonet.train.remote import RetryPolicy
from demonet.train.shards import TokenDataError, write_shards
from demonet.train.task import build_task
from demonet.train.token_data import open_tokens
from demonet.train.tokens import write_tokens
from demonet.train.trainer import Trainer
from tests.integration.common import listening_line
from tests.procs import Reaper

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SHARD_TOKENS, SEQ_LEN, BATCH = 1024, 31, 8  # 32 windows of 32 tokens a shard, 4 batches a shard
QUICK = RetryPolicy(attempts=3, first_wait_s=0.05, max_wait_s=0.1)
PATIENT = RetryPolicy(attempts=12, first_wait_s=0.1, max_wait_s=0.5)  # ~4 s: outlasts a restart


class Server:
    """tests/range_server.py in a process of its own, restartable on its port."""

    def __init__(self, root: Path, reaper: Reaper) -> None:
        self.root, self.reaper, self.port = root, reaper, 0
        self.start()

    def start(self) -> None:
        self.proc = self.reaper.add(subprocess.Popen(
            [sys.executable, "-m", "tests.range_server", "--root", str(self.root), "--port", str(self.port)],
            cwd=ROOT, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)}))
        line = listening_line(self.proc, timeout_s=30)
        assert line.startswith("listening on "), line
        self.port = int(line.split()[-1])

    def kill(self) -> None:
        self.reaper.kill(self.proc)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def get(self, path: str) -> dict[str, int]:
        with urllib.request.urlopen(self.url(path), timeout=10) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]


@pytest.fixture
def served(tmp_path: Path, reap_children: Reaper) -> Iterator[tuple[Server, Path]]:
    (tmp_path / "www").mkdir()
    path = tmp_path / "www" / "corpus.tok"
    ids = np.random.default_rng(0).integers(0, 5000, 200_000)
    write_tokens(path, [ids], vocab_size=5000, tokenizer="test@0123")
    write_shards(path, SHARD_TOKENS)
    yield Server(tmp_path / "www", reap_children), path


def _equal(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_batches_from_the_url_are_the_local_files_and_the_bytes_served_stay_near_the_windows(
        served: tuple[Server, Path], tmp_path: Path) -> None:
    server, path = served
    local = open_tokens(path).batches(batch_size=BATCH, seq_len=SEQ_LEN, seed=11, rank=3)
    data = open_tokens(server.url("corpus.tok"), cache_dir=tmp_path / "cache")
    remote = data.batches(batch_size=BATCH, seq_len=SEQ_LEN, seed=11, rank=3)
    num_batches = 100
    for _ in range(num_batches):
        assert _equal(next(local), next(remote))
    data.close()  # waits for the last prefetch, which the count includes
    served_bytes = server.get("_served")["served"]
    window_bytes = num_batches * BATCH * (SEQ_LEN + 1) * 2
    sidecar_bytes = Path(f"{path}.shards").stat().st_size
    assert served_bytes <= 1.2 * window_bytes + 256 + sidecar_bytes, (served_bytes, window_bytes)
    assert data.reader is not None and data.reader.bytes_fetched == served_bytes - 256 - sidecar_bytes
    assert data.pin == open_tokens(path).pin


def test_a_flipped_byte_on_the_server_is_caught_naming_the_shard_and_never_trained_on(
        served: tuple[Server, Path], tmp_path: Path) -> None:
    server, path = served
    data = open_tokens(server.url("corpus.tok"), cache_dir=tmp_path / "cache", retry=QUICK)
    stream = data.batches(batch_size=BATCH, seq_len=SEQ_LEN, seed=2)
    shard = stream.windows(0)[0][0]
    raw = bytearray(path.read_bytes())
    raw[256 + shard * SHARD_TOKENS * 2 + 7] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(TokenDataError, match=rf"shard {shard} of http://.*corpus.tok: still failing after 3 tries: "
                                             rf"shard {shard} of .* does not match its SHA-256"):
        next(stream)
    assert stream.num_batches == 0
    assert data.reader is not None and not list(data.reader.cache.folder.glob("*.shard"))  # type: ignore[union-attr]


def test_a_truncated_range_is_fetched_again_and_one_that_stays_truncated_stops_the_read(
        served: tuple[Server, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server, path = served
    local = open_tokens(path).batches(batch_size=BATCH, seq_len=SEQ_LEN, seed=4)
    data = open_tokens(server.url("corpus.tok"), cache_dir=tmp_path / "cache", retry=QUICK)
    remote = data.batches(batch_size=BATCH, seq_len=SEQ_LEN, seed=4)
    server.get("_fault?truncate=1")
    with caplog.at_level(logging.WARNING, logger="demonet.train.remote"):
        assert _equal(remote.batch(0), local.batch(0))
    assert "is truncated: 1024 of its 2048 bytes" in caplog.text and "trying again" in caplog.text
    server.get("_fault?truncate=100")
    with pytest.raises(TokenDataError, match=r"still failing after 3 tries: shard \d+ of .* is truncated"):
        remote.batch(4)  # the next shard


def test_a_server_killed_and_restarted_mid_stream_costs_retries_not_the_stream(
        served: tuple[Server, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server, path = served
    local = open_tokens(path).batches(batch_size=BATCH, seq_len=SEQ_LEN, seed=7)
    remote = open_tokens(server.url("corpus.tok"), cache_dir=tmp_path / "cache", retry=PATIENT).batches(
        batch_size=BATCH, seq_len=SEQ_LEN, seed=7)
    for _ in range(10):
        assert _equal(next(local), next(remote))
    time.sleep(0.2)  # the prefetch of batch 10's shard has landed
    server.kill()
    restart = threading.Timer(1.0, server.start)
    restart.start()
    with caplog.at_level(logging.WARNING, logger="demonet.train.remote"):
        for _ in range(20):  # five more shards, fetched while the server is down, then back
            assert _equal(next(local), next(remote))
    restart.join()
    assert "try 1 failed" in caplog.text and "Connection refused" in caplog.text


def test_a_new_reader_with_the_pin_finds_everything_in_the_cache_and_fetches_nothing(
        served: tuple[Server, Path], tmp_path: Path) -> None:
    server, path = served
    first = open_tokens(server.url("corpus.tok"), cache_dir=tmp_path / "cache")
    drawn = [next(s) for s in [first.batches(batch_size=BATCH, seq_len=SEQ_LEN, seed=5)] for _ in range(12)]
    first.close()
    before = server.get("_served")["served"]
    again = open_tokens(server.url("corpus.tok"), pin=first.pin, cache_dir=tmp_path / "cache")
    stream = again.batches(batch_size=BATCH, seq_len=SEQ_LEN, seed=5)
    assert all(_equal(stream.batch(n), drawn[n]) for n in range(12))
    assert server.get("_served")["served"] == before  # no header, no sidecar, no shard
    assert again.reader is not None and again.reader.cache is not None
    cached = sorted(again.reader.cache.folder.glob("*.shard"))
    cached[0].write_bytes(b"\0" * cached[0].stat().st_size)  # a damaged copy is checked, dropped, fetched again
    third = open_tokens(server.url("corpus.tok"), pin=first.pin, cache_dir=tmp_path / "cache")
    assert third.reader is not None
    third.reader.shard(int(cached[0].stem))
    assert server.get("_served")["served"] == before + SHARD_TOKENS * 2


def test_the_builtin_task_trains_on_a_url_with_the_local_files_batches(
        served: tuple[Server, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server, path = served
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the default cache folder
    sizes = {"model": {"vocab_size": 5000, "seq_len": 31, "d_model": 32, "n_layers": 1, "n_heads": 2},
             "train": {"batch_size": 2, "seq_len": 31}}
    url_cfg = load_config(None, {"DEMONET_TRAIN_TOKENS": server.url("corpus.tok")}, sizes)
    local_cfg = load_config(None, {"DEMONET_TRAIN_TOKENS": str(path)}, sizes)
    remote, local = build_task(url_cfg).batches(3), build_task(local_cfg).batches(3)
    assert all(_equal(next(remote), next(local)) for _ in range(6))
    trainer = Trainer.for_run(url_cfg, data_seed=3, device=torch.device("cpu"))
    loss, _ = trainer.train_step()
    assert np.isfinite(loss) and trainer.batches.state_dict() == {"seed": 3, "rank": 0, "num_batches": 1}
    assert list((tmp_path / "xdg" / "demonet" / "tokens").glob("*/*.shard"))


def test_bad_urls_are_refused_with_the_reason(served: tuple[Server, Path], tmp_path: Path) -> None:
    server, path = served
    (path.parent / "bare.tok").write_bytes(path.read_bytes())
    with pytest.raises(FileNotFoundError, match=r"bare.tok has no sidecar .*bare.tok.shards: a URL is read shard"):
        open_tokens(server.url("bare.tok"), cache_dir=tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match=r"missing.tok not found \(HTTP 404\)"):
        open_tokens(server.url("missing.tok"), cache_dir=tmp_path / "cache")
    pin = open_tokens(path).pin
    write_tokens(path, [np.arange(200_000) % 5000], vocab_size=5000, tokenizer="test@0123")
    write_shards(path, SHARD_TOKENS)  # the server now serves another file, sidecar and all
    with pytest.raises(ValueError, match=rf"has pin [0-9a-f]{{64}}, not the run's {pin}"):
        open_tokens(server.url("corpus.tok"), pin=pin, cache_dir=tmp_path / "other-cache")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    with pytest.raises(TokenDataError, match=r"the header of http://127.0.0.1:\d+/x.tok: still failing after 3 tries"):
        open_tokens(f"http://127.0.0.1:{free}/x.tok", cache_dir=tmp_path / "cache", retry=QUICK)


def test_an_s3_url_reads_the_same_batches_through_fsspec(served: tuple[Server, Path], tmp_path: Path,
                                                         reap_children: Reaper,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("s3fs", reason="s3:// needs s3fs (pip install 'demonet[remote]')")
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("moto")
    _, path = served
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reap_children.add(subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    endpoint = f"http://127.0.0.1:{port}"
    for key, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    client = boto3.client("s3", endpoint_url=endpoint)
    for _ in range(100):
        try:
            client.create_bucket(Bucket="runs")
            break
        except Exception:  # the server is still starting
            time.sleep(0.1)
    for name in ("corpus.tok", "corpus.tok.shards"):
        client.upload_file(str(path.parent / name), "runs", name)
    local = open_tokens(path).batches(batch_size=BATCH, seq_len=SEQ_LEN, seed=3)
    data = open_tokens("s3://runs/corpus.tok", pin=open_tokens(path).pin, cache_dir=tmp_path / "cache")
    remote = data.batches(batch_size=BATCH, seq_len=SEQ_LEN, seed=3)
    for _ in range(10):
        assert _equal(next(local), next(remote))
