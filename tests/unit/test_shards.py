"""Unit tests for a token file's shards on local files (no sockets): the sidecar and its checks, the pin, the shard
walk and its position, a corrupted shard, the on-disk cache and its cap, and `demonet data shard`."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from demonet.cli import main
from demonet.train.remote import RetryPolicy, ShardCache, ShardReader
from demonet.train.shards import ShardMismatch, ShardTable, TokenDataError, pin_of, split_shards, write_shards
from demonet.train.sources import FileSource
from demonet.train.token_data import open_tokens
from demonet.train.tokens import HEADER_BYTES, TokenBatches, write_tokens
from demonet.train.walk import ShardBatches

IDS = np.arange(5000) % 997
NO_WAIT = RetryPolicy(attempts=2, first_wait_s=0.0, max_wait_s=0.0)


def _file(tmp_path: Path, shard_tokens: int = 256, ids: np.ndarray = IDS) -> Path:
    path = tmp_path / "t.tok"
    write_tokens(path, [ids], vocab_size=1000, tokenizer="test@0123")
    write_shards(path, shard_tokens)
    return path


def test_the_sidecar_lists_each_shards_sha256_and_the_pin_covers_header_and_sidecar(tmp_path: Path) -> None:
    path = _file(tmp_path)
    raw = path.read_bytes()
    sidecar = Path(f"{path}.shards").read_bytes()
    table = ShardTable.unpack(sidecar, "t")
    assert (table.num_shards, table.shard_tokens, table.num_tokens, table.itemsize) == (20, 256, 5000, 2)
    assert table.tokens_of(19) == 5000 - 19 * 256 and table.byte_range(19) == (256 + 19 * 512, (5000 - 19 * 256) * 2)
    for i in range(20):
        offset, length = table.byte_range(i)
        assert table.digests[i] == hashlib.sha256(raw[offset : offset + length]).digest()
    assert open_tokens(path).pin == pin_of(raw[:HEADER_BYTES], sidecar) == hashlib.sha256(raw[:256] + sidecar
                                                                                           ).hexdigest()
    write_tokens(path, [IDS[::-1]], vocab_size=1000, tokenizer="test@0123")
    assert write_shards(path, 256)[1] != pin_of(raw[:HEADER_BYTES], sidecar)  # other ids: another pin


def test_bad_sidecars_are_refused_naming_the_file(tmp_path: Path) -> None:
    path = _file(tmp_path)
    sidecar = Path(f"{path}.shards")
    good = sidecar.read_bytes()
    for raw, message in [(b"nope" + good[4:], "is not a demonet shard list"), (good[:-1], "is 671 bytes; 20 shards"),
                         (good[:8] + b"\x02" + good[9:], "is shard list version 2")]:
        sidecar.write_bytes(raw)
        with pytest.raises(ValueError, match=message):
            open_tokens(path)
    write_shards(path, 256)
    write_tokens(path, [IDS[:4000]], vocab_size=1000, tokenizer="test@0123")  # the file changed, not the sidecar
    with pytest.raises(ValueError, match="sidecar of .* is for 5000 tokens of 2 bytes, but the file holds 4000"):
        open_tokens(path)
    with pytest.raises(ValueError, match=r"shard_tokens should be an int in \[1, 2\*\*40\), got 0"):
        write_shards(path, 0)
    write_shards(path, 256)
    with pytest.raises(ValueError, match="has pin [0-9a-f]{64}, not the run's 0{64}: the file or its sidecar changed"):
        open_tokens(path, pin="0" * 64)


def test_split_shards_sets_the_last_five_percent_rounded_up_aside() -> None:
    assert split_shards(100) == (range(95), range(95, 100))
    assert split_shards(21) == (range(19), range(19, 21))
    assert split_shards(2) == (range(1), range(1, 2))
    assert split_shards(1) == (range(1), range(0))


def test_the_walk_uses_up_each_shard_in_consecutive_batches(tmp_path: Path) -> None:
    data = open_tokens(_file(tmp_path))
    stream = data.batches(batch_size=4, seq_len=31, seed=5, rank=2)
    assert isinstance(stream, ShardBatches)
    windows = [stream.windows(n) for n in range(2 * 19 * 2)]  # 8 windows a shard, 19 train shards: two epochs
    flat = [w for batch in windows for w in batch]
    first_epoch = flat[: 19 * 8]
    order = list(dict.fromkeys(s for s, _ in first_epoch))
    assert sorted(order) == list(range(19))  # every training shard once; the validation shard never
    for k, shard in enumerate(order):  # each shard's 8 windows back to back, from its start
        assert first_epoch[8 * k : 8 * k + 8] == [(shard, 32 * w) for w in range(8)]
    second = list(dict.fromkeys(s for s, _ in flat[19 * 8 :]))
    assert sorted(second) == list(range(19)) and second != order  # a new order each epoch
    x_BT, y_BT = stream.batch(3)
    expected = np.stack([IDS[s * 256 + t : s * 256 + t + 32] for s, t in windows[3]])
    assert torch.equal(x_BT, torch.from_numpy(expected[:, :-1]).long())
    assert torch.equal(y_BT, torch.from_numpy(expected[:, 1:]).long())


def test_the_walk_is_a_function_of_seed_rank_and_index_and_resumes_from_its_count(tmp_path: Path) -> None:
    data = open_tokens(_file(tmp_path))
    a, b = (data.batches(batch_size=3, seq_len=15, seed=9, rank=1) for _ in range(2))
    drawn = [next(a) for _ in range(7)]
    b.load_state_dict(a.state_dict())
    assert a.state_dict() == {"seed": 9, "rank": 1, "num_batches": 7}
    assert all(torch.equal(u, v) for u, v in zip(next(a), next(b), strict=True))
    assert torch.equal(drawn[2][0], data.batches(batch_size=3, seq_len=15, seed=9, rank=1).batch(2)[0])
    other = data.batches(batch_size=3, seq_len=15, seed=9, rank=2)
    assert not torch.equal(other.batch(0)[0], drawn[0][0])
    with pytest.raises(ValueError, match="seed should be 9 to resume this stream"):
        b.load_state_dict({"seed": 8, "rank": 1, "num_batches": 1})
    with pytest.raises(ValueError, match="no shard of seq_len \\+ 1 = 300 tokens"):
        data.batches(batch_size=1, seq_len=299, seed=0)
    with pytest.raises(ValueError, match="batch_size should be an int in \\[1, 2\\*\\*64\\)"):
        data.batches(batch_size=0, seq_len=15, seed=0)


def test_a_file_without_a_sidecar_keeps_random_windows_and_a_one_shard_file_has_no_validation(tmp_path: Path) -> None:
    path = tmp_path / "plain.tok"
    write_tokens(path, [IDS], vocab_size=1000, tokenizer="t")
    data = open_tokens(path)
    assert data.pin is None and isinstance(data.batches(batch_size=2, seq_len=8, seed=0), TokenBatches)
    with pytest.raises(ValueError, match="has no sidecar .* cannot match the run's pin"):
        open_tokens(path, pin="0" * 64)
    one = open_tokens(_file(tmp_path, shard_tokens=8192))
    next(one.batches(batch_size=2, seq_len=8, seed=0))
    with pytest.raises(ValueError, match="single shard, so no validation part"):
        one.batches(batch_size=2, seq_len=8, seed=0, part="val")


def test_a_corrupted_local_shard_is_refused_naming_it_and_no_batch_comes_out(tmp_path: Path) -> None:
    path = _file(tmp_path)
    data = open_tokens(path)
    stream = data.batches(batch_size=4, seq_len=31, seed=1)
    shard = stream.windows(0)[0][0]
    raw = bytearray(path.read_bytes())
    raw[256 + shard * 512 + 100] ^= 1
    path.write_bytes(bytes(raw))
    assert data.reader is not None
    data.reader.retry = NO_WAIT
    with pytest.raises(TokenDataError, match=f"shard {shard} of .*t.tok does not match its SHA-256") as caught:
        stream.batch(0)
    assert isinstance(caught.value.__cause__, ShardMismatch) and caught.value.__cause__.index == shard
    assert stream.num_batches == 0


def test_a_reader_logs_one_line_for_its_first_shard_with_its_time_and_its_header_and_sidecars(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _file(tmp_path)
    caplog.set_level(logging.INFO, logger="demonet.train.remote")
    data = open_tokens(path)
    stream = data.batches(batch_size=4, seq_len=63, seed=1)  # one shard a batch
    first = stream.windows(0)[0][0]
    for _ in range(6):
        next(stream)
    data.close()
    (line,) = [r.getMessage() for r in caplog.records if "first shard" in r.getMessage()]  # not one per shard
    assert re.fullmatch(rf"the first shard of {re.escape(str(path))} in: shard {first}, 512 bytes, read and "
                        r"verified in \d+\.\d{3} s; the header and sidecar took \d+\.\d{3} s", line), line

    caplog.clear()
    assert data.reader is not None
    table, pin = data.reader.table, data.reader.pin
    for _ in range(2):  # a reader with a cache: the next one finds the shard there
        reader = ShardReader(FileSource(path), table, pin, cache=ShardCache(tmp_path / "cache", pin))
        reader.shard(3)
        reader.shard(4)
        reader.close()
    lines = [r.getMessage() for r in caplog.records if "first shard" in r.getMessage()]
    assert [re.sub(r"\d+\.\d{3} s", "T", x) for x in lines] == [
        f"the first shard of {path} in: shard 3, 512 bytes, {how} and verified in T" for how in ("fetched",
                                                                                                 "from the cache")]


def test_the_cache_keeps_verified_shards_within_its_cap_least_recently_used_out(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", "pin-a", cap_bytes=3000)
    for i in range(3):
        cache.put(i, bytes([i]) * 1000)
    assert cache.get(0) == bytes(1000)  # 0 is now the most recently used
    cache.put(3, b"\x03" * 1000)
    assert cache.get(1) is None and cache.get(0) is not None and cache.get(3) is not None
    again = ShardCache(tmp_path / "cache", "pin-b", cap_bytes=3000)  # a restart: the files on disk count
    again.put(0, b"\x09" * 1500)
    assert sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*.shard")) <= 3000
    assert again.get(0) == b"\x09" * 1500 and cache.get(0) is None  # pin-a's oldest went first
    cache.put_meta(b"h" * 256, b"s")
    assert cache.get_meta() == (b"h" * 256, b"s")
    assert ShardCache(tmp_path / "cache", "pin-c").get_meta() is None


def test_data_shard_command_writes_the_sidecar_and_tokenize_writes_one_too(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plain.tok"
    write_tokens(path, [IDS], vocab_size=1000, tokenizer="t")
    assert main(["data", "shard", str(path), "--shard-tokens", "1000"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["shards"], printed["shard_tokens"], printed["pin"]) == (5, 1000, open_tokens(path).pin)
    assert main(["data", "shard", str(tmp_path / "missing.tok")]) == 2
    assert "not found" in capsys.readouterr().err
    text = tmp_path / "a.txt"
    text.write_bytes(bytes(range(256)) * 10)
    out = tmp_path / "a.tok"
    assert main(["data", "tokenize", str(text), "--out", str(out), "--shard-tokens", "512", "--no-progress"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["shards"], printed["pin"]) == (5, open_tokens(out).pin)
    assert main(["data", "tokenize", str(text), "--out", str(tmp_path / "b.tok"), "--shard-tokens", "0"]) == 2
    assert "--shard-tokens should be >= 1" in capsys.readouterr().err and not (tmp_path / "b.tok").exists()


def test_train_refuses_a_one_shard_file_it_cannot_validate_on_before_any_peer_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bytes.tok"
    write_tokens(path, [IDS % 256], vocab_size=256, tokenizer="bytes")
    write_shards(path, 8192)
    assert main(["train", "--tokens", str(path), "--steps", "1", "--peers", "1", "--out", str(tmp_path / "run"),
                 "--no-progress"]) == 2
    assert "has a single shard, so no validation part" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
