"""Task files: the small files a run's task is built from (the Hugging Face task's config.json and tokenizer),
which the coordinator ships to its peers with their SHA-256 (docs/protocol.md, Task files).

Wire layer: the caps, the list a JoinReply carries, the TaskFiles message GetTaskFiles streams, the checks of
received bytes against the list, and a peer's folder of them. Imports the generated protobuf module and the
standard library; never grpc, asyncio, a transport or the training side.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

from google.protobuf.message import DecodeError

from demonet._proto import demonet_pb2 as pb
from demonet.errors import InvalidPayload

from .params import PROTOCOL

__all__ = ["MAX_FILE_BYTES", "MAX_TOTAL_BYTES", "TaskFile", "decode_task_files", "encode_task_files", "folder_name",
           "list_files", "listing_from_pb", "listing_to_pb", "read_task_files", "stored", "store"]

MAX_FILE_BYTES = 16 * 2**20
"""The largest task file shipped (a large tokenizer.json is under 10 MiB; weights never ship)."""
MAX_TOTAL_BYTES = 32 * 2**20
"""All of a run's task files together, at most."""
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_HASH_BYTES = 32


class TaskFile(NamedTuple):
    """One shipped file as a JoinReply lists it (a plain tuple: `JoinInfo.task_files` holds these)."""

    name: str
    size: int
    sha256: str
    """64 lowercase hex digits."""


def _check_listing(files: Iterable[TaskFile]) -> None:
    """Names, sizes and the total against the caps (ValueError naming the first file over)."""
    total, seen = 0, set()
    for f in files:
        if not _NAME.fullmatch(f.name) or f.name in seen:
            raise ValueError(f"task file name {f.name!r} should be a bare file name (A-Z a-z 0-9 . _ -, not "
                             "starting with '.'), listed once")
        if f.size > MAX_FILE_BYTES:
            raise ValueError(f"task file {f.name} is {f.size:,} bytes; a task file is at most {MAX_FILE_BYTES:,} "
                             "bytes (config and tokenizer files ship; weights come as the run's parameters)")
        seen.add(f.name)
        total += f.size
    if total > MAX_TOTAL_BYTES:
        raise ValueError(f"the task files are {total:,} bytes together, more than the {MAX_TOTAL_BYTES:,} shipped "
                         "at most")


def list_files(files: Mapping[str, bytes]) -> tuple[TaskFile, ...]:
    """The list of `files` (name -> bytes), by name, each with its size and SHA-256.

    Raises:
        ValueError: a name that is not a bare file name, a file or all of them over the caps.
    """
    listing = tuple(TaskFile(name, len(data), hashlib.sha256(data).hexdigest()) for name, data in sorted(files.items()))
    _check_listing(listing)
    return listing


def read_task_files(paths: Mapping[str, Path]) -> dict[str, bytes]:
    """Read the files a coordinator ships (name -> path), their sizes checked against the caps before any is read.

    Raises:
        ValueError: a file or all of them over the caps, or a file that cannot be read (the path named).
    """
    try:
        _check_listing(TaskFile(name, path.stat().st_size, "") for name, path in paths.items())
        return {name: path.read_bytes() for name, path in paths.items()}
    except OSError as e:
        raise ValueError(f"task file {e.filename}: {e.strerror}") from None


def listing_to_pb(listing: Iterable[TaskFile]) -> list[pb.TaskFile]:
    """The `JoinReply.task_files` of a list: names, sizes and hashes, no data."""
    return [pb.TaskFile(name=f.name, size=f.size, sha256=bytes.fromhex(f.sha256)) for f in listing]


def listing_from_pb(files: Iterable[pb.TaskFile]) -> tuple[TaskFile, ...]:
    """A JoinReply's list, checked: bare names listed once, 32-byte hashes, sizes within the caps.

    Raises:
        InvalidPayload: a list this peer does not take (the coordinator's bug, or not a demonet coordinator).
    """
    listing = tuple(TaskFile(f.name, int(f.size), f.sha256.hex()) for f in files)
    if any(len(f.sha256) != 2 * _HASH_BYTES for f in listing):
        raise InvalidPayload("Join: a task file's sha256 should be 32 bytes")
    try:
        _check_listing(listing)
    except ValueError as e:
        raise InvalidPayload(f"Join: {e}") from None
    return listing


def encode_task_files(files: Mapping[str, bytes]) -> bytes:
    """The serialized TaskFiles message of `files` (name -> bytes), by name, that GetTaskFiles streams in parts."""
    return pb.TaskFiles(version=PROTOCOL, files=[
        pb.TaskFile(name=f.name, size=f.size, sha256=bytes.fromhex(f.sha256), data=files[f.name])
        for f in list_files(files)]).SerializeToString()


def decode_task_files(data: bytes, listing: Iterable[TaskFile]) -> dict[str, bytes]:
    """The files of a serialized TaskFiles message, each checked against the JoinReply's list.

    Raises:
        InvalidPayload: not a TaskFiles message of this protocol, a file the list does not name or names twice,
            a file missing, or bytes whose size or SHA-256 differ from the list's (the file named).
    """
    want = {f.name: f for f in listing}
    try:
        msg = pb.TaskFiles.FromString(data)
    except DecodeError as e:
        raise InvalidPayload(f"GetTaskFiles: not a TaskFiles message: {e}") from None
    if msg.version != PROTOCOL:
        raise InvalidPayload(f"GetTaskFiles: TaskFiles version {msg.version}, this peer speaks {PROTOCOL}")
    got: dict[str, bytes] = {}
    for f in msg.files:
        if f.name not in want or f.name in got:
            raise InvalidPayload(f"GetTaskFiles: file {f.name!r} is not in the Join's list, or came twice")
        body = f.data
        digest = hashlib.sha256(body).hexdigest()
        if len(body) != want[f.name].size or digest != want[f.name].sha256:
            raise InvalidPayload(f"GetTaskFiles: the bytes of {f.name} ({len(body):,}, SHA-256 {digest[:16]}) are "
                                 f"not the file the run lists ({want[f.name].size:,}, {want[f.name].sha256[:16]}): "
                                 "corrupted on the way, or not the coordinator's; start this peer again to fetch "
                                 "the files again, and if it recurs, ask the run's operator")
        got[f.name] = body
    missing = sorted(set(want) - set(got))
    if missing:
        raise InvalidPayload(f"GetTaskFiles: {', '.join(missing)} missing from the files the coordinator sent")
    return got


def folder_name(listing: Iterable[TaskFile]) -> str:
    """A folder name for exactly these files (``task-`` and 16 hex digits of a hash of the list): another run's,
    or the same run's after its files changed, get another folder."""
    lines = "".join(f"{f.name} {f.size} {f.sha256}\n" for f in sorted(listing))
    return "task-" + hashlib.sha256(lines.encode()).hexdigest()[:16]


def stored(folder: Path, listing: Iterable[TaskFile]) -> bool:
    """Whether `folder` holds every listed file with its size and SHA-256 (a peer then fetches nothing)."""
    for f in listing:
        path = folder / f.name
        try:
            if path.stat().st_size != f.size or hashlib.sha256(path.read_bytes()).hexdigest() != f.sha256:
                return False
        except OSError:
            return False
    return True


def store(folder: Path, files: Mapping[str, bytes]) -> None:
    """Write checked files into `folder`, each through a temporary file renamed into place, so a crash leaves no
    half file under a listed name."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        _check_listing([TaskFile(name, len(data), "")])
        part = folder / f".{name}.part"
        part.write_bytes(data)
        os.replace(part, folder / name)
