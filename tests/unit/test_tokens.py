"""Unit tests for demonet.train.tokens, demonet.train.tokenizer and `demonet data tokenize`: the header, bad
files, the token type, the stateless per-peer streams, the tokenizers, and the built-in GPT's Trainer on a
token file."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from demonet.cli import main
from demonet.config import Config, load_config
from demonet.train.task import pin_tokenizer
from demonet.train.tokenizer import load_tokenizer
from demonet.train.tokens import HEADER_BYTES, TokenBatches, TokenFile, choose_dtype, read_header, write_tokens
from demonet.train.trainer import Trainer

TEXT = "the quick brown fox jumps over the lazy dog.\nmore text, and more text again: données ünïcode.\n" * 50


def _hf_tokenizer(directory: Path, vocab: dict[str, int] | None = None) -> Path:
    """A tokenizer saved as directory/tokenizer.json: a word-level one over `vocab`, or a small BPE on TEXT."""
    tokenizers = pytest.importorskip("tokenizers")
    if vocab is not None:
        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=next(iter(vocab))))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    else:
        tok = tokenizers.Tokenizer(tokenizers.models.BPE())
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.train_from_iterator([TEXT], tokenizers.trainers.BpeTrainer(
            vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return directory


def _file(tmp_path: Path, ids: list[int] | np.ndarray, vocab_size: int = 1000, dtype: str | None = None) -> Path:
    path = tmp_path / "t.tok"
    write_tokens(path, [np.asarray(ids, dtype=np.int64)], vocab_size=vocab_size, tokenizer="test@0123", dtype=dtype)
    return path


# -- the header and the token type --------------------------------------------------------------------------


def test_header_and_tokens_round_trip_in_chunks(tmp_path: Path) -> None:
    path = tmp_path / "t.tok"
    chunks = [np.array([1, 2, 3]), np.array([], dtype=np.int64), np.array([999, 0], dtype=np.uint32)]
    header = write_tokens(path, chunks, vocab_size=1000, tokenizer="wiki-bpe@0123456789abcdef")
    assert header == read_header(path)
    assert (header.dtype, header.num_tokens, header.vocab_size, header.tokenizer) == (
        "uint16", 5, 1000, "wiki-bpe@0123456789abcdef")
    assert path.stat().st_size == HEADER_BYTES + 5 * 2
    assert path.read_bytes()[:8] == b"DEMOTOKS"
    opened = TokenFile.open(path)
    assert opened.header == header and opened.tokens.tolist() == [1, 2, 3, 999, 0]
    assert path.read_bytes()[HEADER_BYTES:] == np.array([1, 2, 3, 999, 0], dtype="<u2").tobytes()  # little-endian
    assert not list(tmp_path.glob("*.tmp"))


def test_tokens_written_into_a_folder_that_does_not_exist_yet_make_it(tmp_path: Path) -> None:
    """`demonet data tokenize ... --out data/corpus.tok` in a fresh clone: the folder is made."""
    path = tmp_path / "data" / "nested" / "corpus.tok"
    header = write_tokens(path, [np.array([1, 2])], vocab_size=10, tokenizer="t@0123456789abcdef")
    assert TokenFile.open(path).header == header and not list(path.parent.glob("*.tmp"))


def test_an_empty_token_file_opens(tmp_path: Path) -> None:
    opened = TokenFile.open(_file(tmp_path, []))
    assert opened.header.num_tokens == 0 and len(opened.tokens) == 0


@pytest.mark.parametrize(("vocab_size", "dtype"), [(1, "uint16"), (256, "uint16"), (65536, "uint16"),
                                                   (65537, "uint32"), (200_000, "uint32")])
def test_the_narrowest_token_type_that_holds_the_vocab(vocab_size: int, dtype: str) -> None:
    assert choose_dtype(vocab_size) == dtype
    assert choose_dtype(vocab_size, "uint32") == "uint32"


def test_uint16_is_refused_for_a_larger_vocab(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab of 65537 ids does not fit uint16"):
        choose_dtype(65537, "uint16")
    with pytest.raises(ValueError, match="dtype should be one of"):
        choose_dtype(256, "int8")
    with pytest.raises(ValueError, match="does not fit uint16"):
        _file(tmp_path, [70_000], vocab_size=70_001, dtype="uint16")
    assert not list(tmp_path.iterdir())  # nothing written


def test_uint32_files_hold_large_ids(tmp_path: Path) -> None:
    path = _file(tmp_path, [0, 70_000, 123_456], vocab_size=200_000)
    opened = TokenFile.open(path)
    assert opened.header.dtype == "uint32" and opened.tokens.dtype == np.dtype("<u4")
    assert opened.tokens.tolist() == [0, 70_000, 123_456]
    assert TokenFile.open(_file(tmp_path, [1, 2], vocab_size=256, dtype="uint32")).tokens.itemsize == 4


@pytest.mark.parametrize(("ids", "message"), [([5, 1000], "should be in \\[0, 1000\\)"),
                                              ([-1], "should be in \\[0, 1000\\)")])
def test_ids_outside_the_vocab_write_no_file(tmp_path: Path, ids: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _file(tmp_path, ids)
    assert not list(tmp_path.iterdir())


def test_a_tokenizer_name_too_long_writes_no_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer name"):
        write_tokens(tmp_path / "t.tok", [np.arange(3)], vocab_size=10, tokenizer="x" * 300)
    assert not list(tmp_path.iterdir())


# -- bad files -----------------------------------------------------------------------------------------------


def _set(offset: int, fmt: str, value: int) -> Callable[[bytes], bytes]:
    def mutate(raw: bytes) -> bytes:
        return raw[:offset] + struct.pack(fmt, value) + raw[offset + struct.calcsize(fmt):]
    return mutate


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda raw: b"NOTTOKEN" + raw[8:], "is not a demonet token file"),
    (lambda raw: b"", "is not a demonet token file"),
    (lambda raw: raw[:100], "is truncated: 100 bytes, shorter than the 256-byte header"),
    (_set(8, "<I", 2), "is token file version 2; this demonet reads version 1"),
    (_set(12, "<I", 3), "has tokens of 3 bytes"),
    (_set(24, "<Q", 0), "has a vocab size of 0"),
    (lambda raw: raw[:-1], "is truncated: 265 bytes, but the header says 5 uint16 tokens"),
    (lambda raw: raw[:-2], "is truncated: 264 bytes, but the header says 5 uint16 tokens"),
    (_set(16, "<Q", 6), "is truncated"),
    (lambda raw: raw + b"\0\0", "is longer than its header says"),
])
def test_a_bad_file_is_a_clear_error_naming_it(tmp_path: Path, mutate: Callable[[bytes], bytes], message: str) -> None:
    path = _file(tmp_path, [1, 2, 3, 4, 5])
    path.write_bytes(mutate(path.read_bytes()))
    with pytest.raises(ValueError, match=message) as caught:
        TokenFile.open(path)
    assert str(path) in str(caught.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.tok"):
        TokenFile.open(tmp_path / "nope.tok")


# -- the per-peer streams ------------------------------------------------------------------------------------

TOKENS = np.arange(10_000, dtype=np.uint16)  # distinct neighbours, so y == x shifted is checkable


def _stream(seed: int = 7, rank: int = 1, tokens: np.ndarray = TOKENS) -> TokenBatches:
    return TokenBatches(tokens, batch_size=4, seq_len=8, seed=seed, rank=rank)


def test_batches_are_next_token_pairs_of_int64() -> None:
    x_BT, y_BT = next(_stream())
    assert x_BT.shape == y_BT.shape == (4, 8) and x_BT.dtype == y_BT.dtype == torch.int64
    assert torch.equal(y_BT, x_BT + 1)


def test_draw_n_depends_only_on_seed_rank_and_n() -> None:
    stream = _stream()
    drawn = [next(stream) for _ in range(5)]
    for n, (x_BT, y_BT) in enumerate(drawn):
        assert torch.equal(_stream().batch(n)[0], x_BT) and torch.equal(_stream().batch(n)[1], y_BT)
    assert not torch.equal(drawn[0][0], drawn[1][0])
    assert not torch.equal(_stream(rank=2).batch(0)[0], drawn[0][0])
    assert not torch.equal(_stream(seed=8).batch(0)[0], drawn[0][0])
    # Pinned: BLAKE2b offsets are the same on every machine and numpy/torch version.
    assert drawn[0][0][:, 0].tolist() == [2994, 9140, 2710, 7387]
    assert drawn[3][0][:, 0].tolist() == [5120, 3449, 7752, 9647]


def test_a_restarted_stream_continues_from_its_count_alone() -> None:
    stream = _stream()
    for _ in range(3):
        next(stream)
    saved = stream.state_dict()
    assert saved == {"seed": 7, "rank": 1, "num_batches": 3}
    expected = [next(stream) for _ in range(2)]
    restarted = _stream()
    restarted.load_state_dict({"seed": 7, "rank": 1, "num_batches": 3})
    for x_BT, y_BT in expected:
        got_x, got_y = next(restarted)
        assert torch.equal(got_x, x_BT) and torch.equal(got_y, y_BT)


@pytest.mark.parametrize(("state", "message"), [
    ({"seed": 8, "rank": 1, "num_batches": 3}, "seed should be 7"),
    ({"seed": 7, "rank": 0, "num_batches": 3}, "rank should be 1"),
    ({"seed": 7, "rank": 1, "num_batches": -1}, "num_batches should be an int >= 0"),
])
def test_resuming_another_stream_is_refused_and_changes_nothing(state: dict[str, int], message: str) -> None:
    stream = _stream()
    next(stream)
    with pytest.raises(ValueError, match=message):
        stream.load_state_dict(state)
    assert stream.num_batches == 1


def test_a_stream_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="at least seq_len \\+ 1 = 9 ids, got 8"):
        _stream(tokens=TOKENS[:8])
    with pytest.raises(ValueError, match="seed should be"):
        _stream(seed=-1)
    with pytest.raises(ValueError, match="1-D integer array"):
        _stream(tokens=np.zeros((10, 10), dtype=np.uint16))
    with pytest.raises(ValueError, match="batch_size should be"):
        TokenBatches(TOKENS, batch_size=0, seq_len=8, seed=0)


def test_split_keeps_the_last_part_for_validation(tmp_path: Path) -> None:
    train_N, val_N = TokenFile.open(_file(tmp_path, np.arange(100))).split(0.1)
    assert train_N.tolist() == list(range(90)) and val_N.tolist() == list(range(90, 100))


# -- tokenizers and the command --------------------------------------------------------------------------------


def test_the_bytes_tokenizer_is_utf8(tmp_path: Path) -> None:
    text = tmp_path / "a.txt"
    text.write_text("héllo\n", encoding="utf-8")
    tok = load_tokenizer("bytes")
    assert (tok.name, tok.vocab_size) == ("bytes", 256)
    assert np.concatenate([ids for ids, _ in tok.encode_file(text)]).tolist() == list("héllo\n".encode())


def test_a_tokenizer_directory_is_named_by_its_hash(tmp_path: Path) -> None:
    tok = load_tokenizer(str(_hf_tokenizer(tmp_path / "my-bpe")))
    assert tok.name.startswith("my-bpe@") and len(tok.name) == len("my-bpe@") + 16
    assert tok.vocab_size == 300
    with pytest.raises(ValueError, match="'bytes' or a directory holding tokenizer.json"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="broken/tokenizer.json is not a tokenizer"):
        load_tokenizer(str(tmp_path / "broken"))


def test_tokenize_command_writes_what_the_tokenizer_encodes(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    directory = _hf_tokenizer(tmp_path / "bpe")
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(TEXT[:500], encoding="utf-8")
    b.write_text("second file\n", encoding="utf-8")
    out = tmp_path / "ab.tok"
    assert main(["data", "tokenize", str(a), str(b), "--out", str(out), "--tokenizer", str(directory),
                 "--no-progress"]) == 0
    hf = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    expected = hf.encode(TEXT[:500]).ids + hf.encode("second file\n").ids
    opened = TokenFile.open(out)
    assert opened.tokens.tolist() == expected
    assert opened.header.vocab_size == 300 and opened.header.tokenizer.startswith("bpe@")


def test_tokenize_command_refuses_uint16_for_a_large_vocab(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    directory = _hf_tokenizer(tmp_path / "big", vocab={f"w{i}": i for i in range(70_000)})
    text = tmp_path / "a.txt"
    text.write_text("w1 w69999 w5\n")
    out = tmp_path / "a.tok"
    args = ["data", "tokenize", str(text), "--out", str(out), "--tokenizer", str(directory), "--no-progress"]
    assert main([*args, "--dtype", "uint16"]) == 2
    assert "does not fit uint16" in capsys.readouterr().err and not out.exists()
    assert main(args) == 0
    assert TokenFile.open(out).header.dtype == "uint32" and TokenFile.open(out).tokens.tolist() == [1, 69999, 5]


def test_tokenize_command_errors_write_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.tok"
    assert main(["data", "tokenize", str(tmp_path / "missing.txt"), "--out", str(out)]) == 2
    assert "input files not found" in capsys.readouterr().err
    latin = tmp_path / "latin.txt"
    latin.write_bytes("ok\ncafé\n".encode("latin-1"))
    assert main(["data", "tokenize", str(latin), "--out", str(out), "--no-progress",
                 "--tokenizer", str(_hf_tokenizer(tmp_path / "bpe"))]) == 2
    assert "latin.txt is not UTF-8 text (byte 6)" in capsys.readouterr().err
    assert not list(tmp_path.glob("x.tok*"))


# -- the built-in GPT on a token file ------------------------------------------------------------------------


def _cfg(tokens: Path, vocab_size: int) -> Config:
    return load_config(None, {"DEMONET_TRAIN_TOKENS": str(tokens)}, {
        "model": {"vocab_size": vocab_size, "seq_len": 16, "d_model": 32, "n_layers": 1, "n_heads": 2},
        "train": {"batch_size": 2, "seq_len": 16}})


def test_trainer_for_run_trains_on_a_token_file_and_checkpoints_its_position(tmp_path: Path) -> None:
    path = _file(tmp_path, np.arange(2000) % 500, vocab_size=500)
    cfg = _cfg(path, 512)
    trainer = Trainer.for_run(cfg, data_seed=3, device=torch.device("cpu"),
                              checkpoint=tmp_path / "ckpt.pt")
    assert isinstance(trainer.batches, TokenBatches)
    loss, _ = trainer.train_step()
    assert np.isfinite(loss)
    trainer.save({"round": 1})
    again = Trainer.for_run(cfg, data_seed=3, device=torch.device("cpu"),
                            checkpoint=tmp_path / "ckpt.pt")
    again.resume(momentum=False)
    assert again.batches.state_dict() == trainer.batches.state_dict() == {"seed": 3, "rank": 0, "num_batches": 1}
    assert torch.equal(next(again.batches)[0], next(trainer.batches)[0])


def test_the_model_vocab_must_cover_the_file(tmp_path: Path) -> None:
    path = _file(tmp_path, np.arange(2000) % 500, vocab_size=500)
    with pytest.raises(ValueError, match="model.vocab_size should be >= 500, the vocab of the token file .*t.tok"):
        Trainer.for_run(_cfg(path, 256), data_seed=3, device=torch.device("cpu"))


def test_corpus_and_tokens_are_exclusive() -> None:
    with pytest.raises(ValueError, match="train.corpus and train.tokens should not both be set"):
        load_config(None, {"DEMONET_TRAIN_TOKENS": "a.tok", "DEMONET_TRAIN_CORPUS": "a.txt"})


def test_a_token_file_of_another_tokenizer_is_refused_and_the_coordinator_pins_its_own(tmp_path: Path) -> None:
    path = _file(tmp_path, np.arange(2000) % 500, vocab_size=500)  # made with "test@0123"
    cfg = _cfg(path, 512)
    pinned = pin_tokenizer(cfg)
    assert (cfg.train.tokenizer, pinned.train.tokenizer) == ("", "test@0123")
    assert pin_tokenizer(pinned) is pinned
    Trainer.for_run(pinned, data_seed=3, device=torch.device("cpu"))  # its own file passes
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, tokenizer="wiki-bpe@89ab"))
    with pytest.raises(ValueError, match=r"t.tok was made with tokenizer 'test@0123'; the run's is 'wiki-bpe@89ab'"):
        Trainer.for_run(other, data_seed=3, device=torch.device("cpu"))
