"""The files a run's task ships at join (`demonet.wire.task_files`, docs/protocol.md#task-files): the list and its
caps, the TaskFiles message and every check of received bytes against the list, a peer's folder of them, and the
Hugging Face task's side (which files ship, the config a peer builds from its copy)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload
from demonet.tasks.hf import TASK, shipped_paths, with_shipped_files
from demonet.wire import task_files as tf
from demonet.wire.params import PROTOCOL

FILES = {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b'{"model": {"type": "BPE"}}' * 50}


def test_the_list_names_each_file_with_its_size_and_sha256_in_name_order() -> None:
    listing = tf.list_files(FILES)
    assert [f.name for f in listing] == ["config.json", "tokenizer.json"]
    assert all(f.size == len(FILES[f.name]) and f.sha256 == hashlib.sha256(FILES[f.name]).hexdigest()
               for f in listing)
    assert tf.listing_from_pb(tf.listing_to_pb(listing)) == listing  # as a JoinReply carries it


@pytest.mark.parametrize("name", ["../config.json", "a/b", ".hidden", "", "x" * 129, "tok\u00e9n.json"])
def test_a_name_that_is_not_a_bare_file_name_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="should be a bare file name"):
        tf.list_files({name: b"{}"})
    with pytest.raises(InvalidPayload, match="bare file name"):  # from a coordinator: never a path to write to
        tf.listing_from_pb([pb.TaskFile(name=name, size=2, sha256=bytes(32))])


def test_a_file_or_the_whole_over_its_cap_is_refused() -> None:
    with pytest.raises(ValueError, match=r"tokenizer.json is 16,777,217 bytes; a task file is at most 16,777,216"):
        tf.list_files({"tokenizer.json": bytes(tf.MAX_FILE_BYTES + 1)})
    big = bytes(tf.MAX_FILE_BYTES)
    with pytest.raises(ValueError, match="together, more than the 33,554,432"):
        tf.list_files({"a.json": big, "b.json": big, "c.json": b"x"})
    assert len(tf.list_files({"a.json": big, "b.json": big})) == 2  # exactly at the caps
    with pytest.raises(InvalidPayload, match="at most 16,777,216"):
        tf.listing_from_pb([pb.TaskFile(name="a.json", size=tf.MAX_FILE_BYTES + 1, sha256=bytes(32))])
    with pytest.raises(InvalidPayload, match="sha256 should be 32 bytes"):
        tf.listing_from_pb([pb.TaskFile(name="a.json", size=1, sha256=bytes(31))])


def test_a_coordinator_reads_no_file_over_the_cap(tmp_path: Path) -> None:
    huge = tmp_path / "tokenizer.json"
    with huge.open("wb") as f:
        f.truncate(tf.MAX_FILE_BYTES + 1)  # sparse: refused from its size, never read
    (tmp_path / "config.json").write_bytes(FILES["config.json"])
    with pytest.raises(ValueError, match="tokenizer.json is 16,777,217 bytes"):
        tf.read_task_files({"config.json": tmp_path / "config.json", "tokenizer.json": huge})
    with pytest.raises(ValueError, match="No such file"):
        tf.read_task_files({"vocab.json": tmp_path / "vocab.json"})
    assert tf.read_task_files({"config.json": tmp_path / "config.json"}) == {"config.json": FILES["config.json"]}


def test_the_files_travel_and_come_back_whole() -> None:
    assert tf.decode_task_files(tf.encode_task_files(FILES), tf.list_files(FILES)) == FILES


def test_bytes_that_are_not_the_listed_file_are_refused_naming_it() -> None:
    listing = tf.list_files(FILES)
    flipped = {**FILES, "tokenizer.json": b"X" + FILES["tokenizer.json"][1:]}  # the same size, another hash
    with pytest.raises(InvalidPayload, match=r"the bytes of tokenizer.json .* are not the file the run lists"):
        tf.decode_task_files(tf.encode_task_files(flipped), listing)
    shorter = {**FILES, "config.json": FILES["config.json"][:-1]}
    with pytest.raises(InvalidPayload, match="the bytes of config.json"):
        tf.decode_task_files(tf.encode_task_files(shorter), listing)


def test_a_missing_an_unlisted_or_an_unreadable_file_is_refused() -> None:
    listing = tf.list_files(FILES)
    with pytest.raises(InvalidPayload, match="tokenizer.json missing from the files the coordinator sent"):
        tf.decode_task_files(tf.encode_task_files({"config.json": FILES["config.json"]}), listing)
    with pytest.raises(InvalidPayload, match="'vocab.json' is not in the Join's list"):
        tf.decode_task_files(tf.encode_task_files({**FILES, "vocab.json": b"{}"}), listing)
    with pytest.raises(InvalidPayload, match="not a TaskFiles message"):
        tf.decode_task_files(b"\xff\xff\xff", listing)
    other_version = pb.TaskFiles(version=1).SerializeToString()
    with pytest.raises(InvalidPayload, match=f"TaskFiles version 1, this peer speaks {PROTOCOL}"):
        tf.decode_task_files(other_version, listing)


def test_a_peer_keeps_the_checked_files_in_a_folder_of_that_list(tmp_path: Path) -> None:
    listing = tf.list_files(FILES)
    folder = tmp_path / tf.folder_name(listing)
    assert folder.name.startswith("task-") and tf.folder_name(reversed(listing)) == folder.name
    assert tf.folder_name(tf.list_files({**FILES, "config.json": b"{}"})) != folder.name
    assert not tf.stored(folder, listing)
    tf.store(folder, FILES)
    assert tf.stored(folder, listing) and sorted(p.name for p in folder.iterdir()) == sorted(FILES)
    (folder / "config.json").write_bytes(b'{"model_type": "llamb"}')  # the same size, other bytes: fetched again
    assert not tf.stored(folder, listing)
    (folder / "config.json").unlink()
    assert not tf.stored(folder, listing)


def test_the_hf_task_ships_its_config_and_tokenizer_never_weights(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors", "notes.txt"):
        (model / name).write_bytes(b"{}")
    run = {"train": {"task": TASK}, "task": {"model": str(model), "tokens": "t.tok"}}
    assert shipped_paths(run) == {"config.json": model / "config.json", "tokenizer.json": model / "tokenizer.json"}
    assert shipped_paths({"train": {"task": "mytasks:cnn"}, "task": {"model": str(model)}}) == {}
    (model / "config.json").unlink()
    with pytest.raises(ValueError, match="holds no config.json"):
        shipped_paths(run)


def test_a_peer_builds_from_its_copy_and_needs_the_token_file_it_names(tmp_path: Path) -> None:
    tokens = tmp_path / "corpus.tok"
    tokens.write_bytes(b"")
    run = {"train": {"task": TASK}, "task": {"model": "models/tiny", "tokens": str(tokens), "seq_len": 32}}
    got = with_shipped_files(run, Path("runs/peer/task-0123"))
    assert got["task"] == {"model": str(Path("runs/peer/task-0123").resolve()), "tokens": str(tokens), "seq_len": 32}
    assert run["task"]["model"] == "models/tiny"  # the run's own config is not changed
    url = {**run, "task": {**run["task"], "tokens": "https://data.example/corpus.tok"}}
    assert with_shipped_files(url, tmp_path)["task"]["tokens"] == "https://data.example/corpus.tok"  # as given
    missing = {**run, "task": {**run["task"], "tokens": "data/corpus.tok"}}
    with pytest.raises(ValueError, match=r"'data/corpus.tok' .* not on this machine: serve the token file over "
                                         r"http\(s\) or s3 and set \[task\] tokens to its URL"):
        with_shipped_files(missing, tmp_path)


class _Coordinator:
    """What `demonet.peer` fetches task files through: it records the joins and calls, and serves `files`."""

    peer_id = "p"

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files, self.calls = files, []

    async def join(self) -> None:
        self.calls.append("join")

    async def get_task_files(self, listing: tuple[tuple[str, int, str], ...]) -> dict[str, bytes]:
        self.calls.append("GetTaskFiles")
        return tf.decode_task_files(tf.encode_task_files(self.files), [tf.TaskFile(*f) for f in listing])


def test_a_peer_fetches_the_files_once_and_builds_from_its_copy(tmp_path: Path) -> None:
    import asyncio

    from demonet.peer import _task_files
    from demonet.transport import JoinInfo

    tokens = tmp_path / "corpus.tok"
    tokens.write_bytes(b"")
    run = {"train": {"task": TASK}, "task": {"model": "models/tiny", "tokens": str(tokens)}}
    info = JoinInfo(peer_id="p", round=0, run_config=run, data_seed=1, round_timeout_s=30.0,
                    heartbeat_interval_s=5.0, total_rounds=0, task_files=tf.list_files(FILES))
    coordinator = _Coordinator(FILES)

    def fetch() -> tuple[dict[str, object], bool]:
        return asyncio.run(_task_files(coordinator, coordinator, info, run, tmp_path / "out"))  # type: ignore[arg-type]

    config, joined = fetch()
    folder = Path(config["task"]["model"])  # type: ignore[index]
    assert joined and coordinator.calls == ["join", "GetTaskFiles"] and tf.stored(folder, info.task_files)
    assert folder.parent == (tmp_path / "out").resolve() and folder.name == tf.folder_name(tf.list_files(FILES))
    assert fetch() == (config, False) and coordinator.calls == ["join", "GetTaskFiles"]  # a restart: no call
    (folder / "tokenizer.json").write_bytes(b"{}")
    coordinator.files = {**FILES, "tokenizer.json": b"X" + FILES["tokenizer.json"][1:]}  # a corrupted copy on the way
    with pytest.raises(InvalidPayload, match="the bytes of tokenizer.json"):
        fetch()
    assert not tf.stored(folder, info.task_files)  # nothing of it written
    other = {**run, "train": {"task": "mytasks:cnn"}}  # a user's task: never files, never a call
    assert asyncio.run(_task_files(coordinator, coordinator, info, other, tmp_path)) == (other, False)  # type: ignore[arg-type]
