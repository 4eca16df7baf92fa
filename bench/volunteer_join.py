"""Benchmark: a volunteer's time from nothing to its first round, on the Hugging Face task with its data remote.

Install: `python -m venv` and `pip install "torch==2.13.0" "demonet[hf]"` (from this tree) into a fresh venv,
timed; the volunteer then runs from that venv (where the install fails, the script says so and goes on with the
current environment). Then a Llama with its BPE tokenizer trained here on `default_corpus()` (config.json and
tokenizer.json only: the coordinator builds the parameters from the run seed), its token file in shards with the
sidecar, served by tests/range_server.py on loopback, a `demonet coordinator` of `demonet.tasks.hf:causal_lm`
reading that URL, and `demonet peer --coordinator HOST:PORT` in an empty folder with an empty HOME. From the
peer's log lines and its metrics file it prints, in seconds from the peer's start: the join (probe, join, the
task files fetched and checked), the model built and the parameters downloaded, the first data read (the header,
the sidecar and the first shard) and the first round (its metrics row). Then the bytes the data server sent the
peer per round against the bytes of the windows it trained on, and the bytes of the task files shipped.

Run from the repo root: `python bench/volunteer_join.py`; `--no-install`: skip the install; `--smoke`: the
tiny model, 3 rounds, no install. Prints tables; not a test. Times are a single run's, and noisy on shared cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from demonet.train.data import default_corpus  # noqa: E402
from demonet.train.shards import write_shards  # noqa: E402
from demonet.train.tokens import HEADER_BYTES, write_tokens  # noqa: E402

TOKEN = "bench"
TASK = "demonet.tasks.hf:causal_lm"
PEER = "volunteer"
INSTALL = ["torch==2.13.0", "{src}[hf]"]
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_FILES = re.compile(r"the run's task files \((.*): (\d+) bytes, fetched and checked in ([\d.]+) s\)")
_JOINED = re.compile(r"joined \S+ as key ")
_SHARD = re.compile(r"the first shard of \S+ in: shard \d+, (\d+) bytes, .* in ([\d.]+) s; the header and sidecar "
                    r"took ([\d.]+) s")


@dataclass(frozen=True, kw_only=True)
class Size:
    """The model, the batches and the run."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    batch_size: int
    seq_len: int
    shard_tokens: int
    rounds: int


FULL = Size(vocab=2048, hidden=128, layers=4, heads=4, batch_size=8, seq_len=128, shard_tokens=4096, rounds=20)
SMOKE = Size(vocab=384, hidden=32, layers=2, heads=2, batch_size=4, seq_len=32, shard_tokens=1024, rounds=3)


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """What the peer's log and metrics file say; every `*_at_s` in seconds from the peer's start."""

    files_at_s: float
    """The task files fetched and checked: the end of the join."""
    files_bytes: int
    files_s: float
    """GetTaskFiles and the check, as the peer timed them."""
    joined_at_s: float
    """The model built, the token data opened, the parameters downloaded: the loop starts."""
    shard_at_s: float
    """The first shard read and verified."""
    shard_bytes: int
    shard_s: float
    meta_s: float
    """The header and sidecar, read when the token data was opened."""
    row_at_s: float
    """The first metrics row written: the end of the first round."""
    row_round: int


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=FULL.rounds, help="rounds the run lasts (20)")
    parser.add_argument("--no-install", action="store_true", help="skip the venv and pip install")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, 3 rounds, no install")
    return parser.parse_args(argv)


def _install(tmp: Path) -> tuple[float | None, Path | None, str]:
    """A fresh venv with torch and this tree's demonet[hf]: the seconds, its python, and what happened."""
    src = tmp / "src"  # a copy: pip builds in the source folder, which is not the place to leave a build in
    shutil.copytree(ROOT / "demonet", src / "demonet", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    venv = tmp / "venv"
    python = venv / "bin" / "python"
    start = time.perf_counter()
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=600)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *(s.format(src=src) for s in INSTALL)],
                       check=True, capture_output=True, text=True, timeout=3600)
    except subprocess.CalledProcessError as e:
        last = (e.stderr or "").strip().splitlines()[-1:] or [f"exit {e.returncode}"]
        return None, None, f"failed ({last[0]}); going on with the current environment"
    except (subprocess.TimeoutExpired, OSError) as e:
        return None, None, f"failed ({e}); going on with the current environment"
    return time.perf_counter() - start, python, "venv + pip install " + " ".join(INSTALL).format(src="demonet")


def _model_folder(folder: Path, corpus: Path, size: Size) -> str:
    """config.json and a BPE tokenizer trained on `corpus`; returns the tokenizer's name as `demonet data
    tokenize` writes it (NAME@16 hex digits of its tokenizer.json's SHA-256)."""
    import hashlib

    import tokenizers
    from transformers import LlamaConfig

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train([str(corpus)], tokenizers.trainers.BpeTrainer(
        vocab_size=size.vocab, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    LlamaConfig(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=4 * size.hidden,
                num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.heads,
                max_position_embeddings=size.seq_len).save_pretrained(folder)
    bpe.save(str(folder / "tokenizer.json"))
    return f"bench@{hashlib.sha256((folder / 'tokenizer.json').read_bytes()).hexdigest()[:16]}"


def _token_file(www: Path, model: Path, size: Size) -> Path:
    """The corpus tokenized with the model's tokenizer, in shards of `size.shard_tokens` with the sidecar."""
    import tokenizers

    corpus = www.parent / "corpus.txt"
    corpus.write_bytes(default_corpus())
    name = _model_folder(model, corpus, size)
    ids = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json")).encode(
        corpus.read_text(encoding="utf-8"), add_special_tokens=False).ids
    path = www / "corpus.tok"
    write_tokens(path, [ids], vocab_size=size.vocab, tokenizer=name)
    write_shards(path, size.shard_tokens)
    return path


def _first_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The first stdout line of a starting server ("listening on ..."); "" if none within `timeout_s`."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline() if ready else ""


def _served(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/_served", timeout=10) as response:
        return int(json.loads(response.read())["served"])


def _stamp_s(line: str) -> float:
    match = _STAMP.match(line)
    assert match is not None, line
    return datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time, as logged


def _timeline(log: Path, metrics: Path, start: float) -> Timeline:
    """The peer's timeline from its log (demonet.log's timestamps) and the first row of its metrics file."""
    lines = log.read_text().splitlines()

    def find(pattern: re.Pattern[str]) -> tuple[float, re.Match[str]]:
        for line in lines:
            if match := pattern.search(line):
                return _stamp_s(line) - start, match
        raise SystemExit(f"the peer never logged /{pattern.pattern}/:\n" + "\n".join(lines[-30:]))

    (files_at, files), (joined_at, _), (shard_at, shard) = find(_FILES), find(_JOINED), find(_SHARD)
    row = json.loads(metrics.read_text().splitlines()[0])
    return Timeline(files_at_s=files_at, files_bytes=int(files[2]), files_s=float(files[3]), joined_at_s=joined_at,
                    shard_at_s=shard_at, shard_bytes=int(shard[1]), shard_s=float(shard[2]), meta_s=float(shard[3]),
                    row_at_s=row["time"] - start, row_round=row["round"])


def _run(tmp: Path, size: Size, python: Path | None) -> tuple[Timeline, int, int]:
    """Serves the token file, starts the coordinator and the volunteer, waits for the run's end. Returns the
    timeline, the bytes the data server sent the peer and the bytes of the sidecar."""
    www, model = tmp / "www", tmp / "coordinator" / "model"
    www.mkdir()
    model.mkdir(parents=True)
    path = _token_file(www, model, size)
    env = {**os.environ, "DEMONET_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "tests.range_server", "--root", str(www)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, text=True)
    coordinator = None
    try:
        port = int(_first_line(server, 60).split()[-1])
        (tmp / "coordinator" / "run.toml").write_text(
            f'[train]\ntask = "{TASK}"\n[task]\nmodel = "model"\ntokens = "http://127.0.0.1:{port}/{path.name}"\n'
            f"batch_size = {size.batch_size}\nseq_len = {size.seq_len}\n"
            "[net]\nround_timeout_s = 60.0\nstart_peers = 1\n")
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "demonet", "coordinator", "--listen", "127.0.0.1:0", "--config", "run.toml",
             "--steps", str(size.rounds), "--state-dir", "state"], cwd=tmp / "coordinator", env=env, text=True,
            stdout=subprocess.PIPE, stderr=(tmp / "coordinator.log").open("w"))
        line = _first_line(coordinator, 180)
        if not line.startswith("listening on "):
            raise SystemExit("the coordinator did not start:\n" + (tmp / "coordinator.log").read_text()[-3000:])
        before = _served(port)  # the coordinator read the header and sidecar to pin the file
        timeline = _volunteer(tmp, line.split()[-1], python, env)
        return timeline, _served(port) - before, Path(f"{path}.shards").stat().st_size
    finally:
        for proc in (coordinator, server):
            if proc is not None:
                proc.kill()
                proc.wait()


def _volunteer(tmp: Path, address: str, python: Path | None, env: dict[str, str]) -> Timeline:
    """`demonet peer --coordinator ADDRESS` in an empty folder with an empty HOME, until the run ends."""
    folder, home = tmp / "volunteer", tmp / "home"
    folder.mkdir()
    home.mkdir()
    peer_env = {**env, "HOME": str(home)}
    if python is not None:  # the venv's package, not this tree's
        peer_env.pop("PYTHONPATH")
    log = tmp / "volunteer.log"
    start = time.time()
    with log.open("w") as err:
        done = subprocess.run([str(python or sys.executable), "-m", "demonet", "peer", "--coordinator", address,
                               "--peer-id", PEER], cwd=folder, env=peer_env, stdout=subprocess.DEVNULL, stderr=err,
                              timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the volunteer exited with {done.returncode}:\n{log.read_text()[-3000:]}")
    return _timeline(log, folder / "runs" / "peer" / f"metrics-{PEER}.jsonl", start)


def _report(install: tuple[float | None, str], t: Timeline, size: Size, fetched: int, sidecar: int) -> None:
    seconds, note = install
    print("| step | seconds | at (s from the peer's start) |")
    print("|---|---|---|")
    print(f"| install: {note} | {'-' if seconds is None else f'{seconds:.1f}'} | - |")
    print(f"| join: probe, join, task files fetched and checked ({t.files_bytes:,} B in {t.files_s:.3f} s) | "
          f"{t.files_at_s:.2f} | {t.files_at_s:.2f} |")
    print(f"| model built, token data opened, parameters downloaded | {t.joined_at_s - t.files_at_s:.2f} | "
          f"{t.joined_at_s:.2f} |")
    print(f"| first data read: header + sidecar {t.meta_s:.3f} s, first shard ({t.shard_bytes:,} B) {t.shard_s:.3f} s "
          f"| {t.meta_s + t.shard_s:.3f} | {t.shard_at_s:.2f} |")
    print(f"| first round (round {t.row_round}'s metrics row) | {t.row_at_s - t.joined_at_s:.2f} | {t.row_at_s:.2f} |")
    meta = HEADER_BYTES + sidecar
    window = size.batch_size * (size.seq_len + 1) * 2
    per_round = (fetched - meta) / size.rounds
    print()
    print("| rounds | window bytes a round | fetched a round | fetched / windows | header + sidecar (once) "
          "| task files shipped |")
    print("|---|---|---|---|---|---|")
    print(f"| {size.rounds} | {window:,} | {per_round:,.0f} | {per_round / window:.3f}x | {meta:,} | "
          f"{t.files_bytes:,} |")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    size = SMOKE if args.smoke else dataclasses.replace(FULL, rounds=args.rounds)
    with tempfile.TemporaryDirectory(prefix="volunteer-") as name:
        tmp = Path(name)
        seconds, python, note = (None, None, "skipped") if args.smoke or args.no_install else _install(tmp)
        print(f"model: Llama, hidden {size.hidden}, {size.layers} layers, vocab {size.vocab} (BPE on the default "
              f"corpus); batch {size.batch_size} x {size.seq_len}; shards of {size.shard_tokens:,} tokens; "
              f"the volunteer runs from {'a fresh venv' if python else 'this environment'}", flush=True)
        timeline, fetched, sidecar = _run(tmp, size, python)
    _report((seconds, note), timeline, size, fetched, sidecar)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
