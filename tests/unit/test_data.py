"""Unit tests for demonet.train.data: the built-in corpus, the split, and seeded batch streams."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from demonet.train.data import Batches, default_corpus, load_corpus, split

DATA = torch.arange(1000, dtype=torch.int64) % 251  # distinct neighbours, so y == x shifted is checkable


def test_default_corpus_is_deterministic_text() -> None:
    corpus = default_corpus()
    assert corpus == default_corpus()
    assert len(corpus) > 100_000
    corpus.decode("utf-8")  # valid text


def test_load_corpus_default_and_file(tmp_path: Path) -> None:
    data = load_corpus()
    assert data.dtype == torch.uint8 and data.ndim == 1
    assert bytes(data[:64].tolist()) == default_corpus()[:64]
    file = tmp_path / "corpus.txt"
    file.write_bytes(b"hello world")
    assert bytes(load_corpus(str(file)).tolist()) == b"hello world"


def test_load_corpus_errors_name_the_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_corpus(missing)
    short = tmp_path / "short.txt"
    short.write_bytes(b"abc")
    with pytest.raises(ValueError, match="short.txt"):
        load_corpus(str(short), min_bytes=10)


def test_split_takes_the_tail_for_validation() -> None:
    train, val = split(DATA, val_fraction=0.1)
    assert len(train) == 900 and len(val) == 100
    assert torch.equal(torch.cat([train, val]), DATA)
    assert len(split(DATA, 0.0)[1]) == 0
    with pytest.raises(ValueError, match="val_fraction"):
        split(DATA, 1.0)


def test_batches_shapes_and_shift() -> None:
    x_BT, y_BT = next(Batches(DATA, batch_size=4, seq_len=16, seed=0))
    assert x_BT.shape == y_BT.shape == (4, 16)
    assert x_BT.dtype == y_BT.dtype == torch.int64
    assert torch.equal(x_BT[:, 1:], y_BT[:, :-1])
    assert torch.equal(y_BT[:, -1], (x_BT[:, -1] + 1) % 251)


def _take(batches: Batches, n: int) -> list[torch.Tensor]:
    return [next(batches)[0] for _ in range(n)]


def test_same_seed_and_rank_same_stream_other_rank_differs() -> None:
    a = _take(Batches(DATA, batch_size=4, seq_len=8, seed=7, rank=1, world=2), 5)
    b = _take(Batches(DATA, batch_size=4, seq_len=8, seed=7, rank=1, world=2), 5)
    c = _take(Batches(DATA, batch_size=4, seq_len=8, seed=7, rank=0, world=2), 5)
    d = _take(Batches(DATA, batch_size=4, seq_len=8, seed=8, rank=1, world=2), 5)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not any(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    assert not any(torch.equal(x, y) for x, y in zip(a, d, strict=True))


def test_ranks_draw_from_their_own_shard() -> None:
    data = torch.arange(400)
    for rank in range(4):
        for x_BT in _take(Batches(data, batch_size=8, seq_len=10, seed=0, rank=rank, world=4), 5):
            starts = x_BT[:, 0]
            assert bool(((starts >= rank * 100) & (starts <= rank * 100 + 89)).all())


def test_state_dict_resume_continues_the_stream() -> None:
    full = _take(Batches(DATA, batch_size=2, seq_len=8, seed=3), 6)
    first = Batches(DATA, batch_size=2, seq_len=8, seed=3)
    _take(first, 3)
    state = first.state_dict()
    resumed = Batches(DATA, batch_size=2, seq_len=8, seed=3)
    resumed.load_state_dict(state)
    assert resumed.num_batches == 3
    assert all(torch.equal(x, y) for x, y in zip(_take(resumed, 3), full[3:], strict=True))
    with pytest.raises(ValueError, match="seed"):
        Batches(DATA, batch_size=2, seq_len=8, seed=4).load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"seq_len": 0}, "seq_len"),
        ({"seed": -1}, "seed"),
        ({"rank": 2, "world": 2}, "rank"),
        ({"world": 0}, "world"),
        ({"seq_len": 600, "world": 2}, "data"),
    ],
)
def test_batches_bad_arguments(kwargs: dict[str, int], field: str) -> None:
    args = {"batch_size": 2, "seq_len": 8, "seed": 0} | kwargs
    with pytest.raises(ValueError, match=f"^{field} should"):
        Batches(DATA, **args)


def test_batches_rejects_float_data() -> None:
    with pytest.raises(ValueError, match="^data should"):
        Batches(torch.zeros(100), batch_size=1, seq_len=8, seed=0)
