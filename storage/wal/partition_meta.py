"""``partition.metadata``: which incarnation of a topic a local partition directory holds.

A topic name can be deleted and created again; the new incarnation has a new topic id
(``TopicSpec.topic_id``, Kafka's KIP-516) and must never reopen the old one's log. An agent
that was down while a topic was deleted still has ``<data.dir>/<topic>-<p>/`` of the old
incarnation when it comes back, so the directory says whose it is, in Kafka's format::

    version: 0
    topic_id: 3f2a...

The file is written when a partition's log is opened for the first time (through a temporary
file, fsync, rename and an fsync of the directory, so a crash leaves the old file or the new
one), and read at every later open: a directory whose file names another id is the old
incarnation's, and is removed rather than reopened. A directory without the file predates
topic ids; it is adopted by the incarnation that opens it.
"""

from __future__ import annotations

from pathlib import Path

from storage.errors import CorruptSegmentError
from storage.wal.fileio import fsync_dir, storage_errors, write_file_atomically

FILE_NAME = "partition.metadata"
VERSION = 0


def read_topic_id(directory: Path) -> str | None:
    """The topic id ``directory`` was opened for (None: no directory, or no file yet)."""
    path = directory / FILE_NAME
    with storage_errors(f"cannot read {path}"):
        try:
            text = path.read_text("utf-8")
        except FileNotFoundError:
            return None
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    if fields.get("version") != str(VERSION) or not fields.get("topic_id"):
        raise CorruptSegmentError(f"unreadable partition metadata {text[:80]!r}", path=str(path))
    return fields["topic_id"]


def write_topic_id(directory: Path, topic_id: str, *, sync_dir: bool = True) -> None:
    """Record durably that ``directory`` holds the incarnation ``topic_id``.

    With ``sync_dir=False`` the file's name is durable only after the caller's next fsync of
    ``directory`` (a new log's first flush, which covers its first segment's name too)."""
    path = directory / FILE_NAME
    with storage_errors(f"cannot write {path}"):
        write_file_atomically(path, f"version: {VERSION}\ntopic_id: {topic_id}\n".encode())
        if sync_dir:
            fsync_dir(directory)
