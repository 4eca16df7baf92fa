"""Tokenizers that fill token files: UTF-8 bytes, or a local Hugging Face `tokenizers` directory.

Imports numpy and the standard library; `tokenizers` (the extra "hf") only inside `load_tokenizer`. No
torch, optimizer, wire or network code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Tokenizer", "load_tokenizer"]

_BLOCK_BYTES = 1 << 20  # input read per encode call


@dataclass(frozen=True)
class Tokenizer:
    """Text to ids: UTF-8 bytes (`encode` None) or a Hugging Face `tokenizers` tokenizer."""

    name: str
    """Its identity in a token file's header."""
    vocab_size: int
    encode: Callable[[str], list[int]] | None = None

    def encode_file(self, path: str | Path) -> Iterator[tuple[npt.NDArray[Any], int]]:
        """Yields (ids, input bytes consumed) for a file, about a MiB of input at a time.

        A tokenizer sees blocks of whole lines, so its ids can differ from encoding the whole file at once only
        where a token would span a block's end (a run of newlines); byte ids never differ.

        Raises:
            ValueError: the file is not UTF-8 text (a tokenizer's input only).
        """
        with open(path, "rb") as f:
            if self.encode is None:
                while block := f.read(_BLOCK_BYTES):
                    yield np.frombuffer(block, dtype=np.uint8), len(block)
                return
            done = 0
            while block := b"".join(_lines(f, _BLOCK_BYTES)):
                try:
                    text = block.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path} is not UTF-8 text (byte {done + e.start})") from None
                yield np.asarray(self.encode(text), dtype=np.int64), len(block)
                done += len(block)


def _lines(f: Any, num_bytes: int) -> Iterator[bytes]:
    """Whole lines of `f` until at least `num_bytes` (or the end)."""
    total = 0
    while total < num_bytes and (line := f.readline()):
        total += len(line)
        yield line


def load_tokenizer(spec: str) -> Tokenizer:
    """``bytes`` (UTF-8 bytes, vocab 256) or a local Hugging Face tokenizer directory holding tokenizer.json.

    Raises:
        ValueError: no such directory or tokenizer.json, or one `tokenizers` cannot load.
        ImportError: a directory was given and `tokenizers` is not installed (``pip install 'demonet[hf]'``).
    """
    if spec == "bytes":
        return Tokenizer("bytes", 256)
    file = Path(spec) / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"tokenizer should be 'bytes' or a directory holding tokenizer.json; {file} not found")
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise ImportError("a tokenizer directory needs the `tokenizers` package: pip install 'demonet[hf]'") from None
    try:
        hf = HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(f"{file} is not a tokenizer `tokenizers` can load: {e}") from None
    # The directory's name, cut to fit the header whole characters at a time, and its tokenizer.json's hash.
    directory = Path(spec).resolve().name.encode("utf-8")[:160].decode("utf-8", errors="ignore")
    name = f"{directory}@{hashlib.sha256(file.read_bytes()).hexdigest()[:16]}"
    return Tokenizer(name, hf.get_vocab_size(with_added_tokens=True),
                     lambda text: hf.encode(text, add_special_tokens=False).ids)
