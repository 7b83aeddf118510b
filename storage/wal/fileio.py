"""Small, careful file primitives: whole writes, directory fsync, OSError translation."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from storage.errors import StorageError


def storage_error(what: str, exc: OSError) -> StorageError:
    """The project's StorageError for an OSError (disk full, I/O error, ...) while ``what``.
    Hot paths (an append, an fsync) catch OSError themselves and call this, so the message is
    built only on failure; elsewhere ``storage_errors`` wraps a block."""
    return StorageError(f"{what}: {exc.strerror or exc}")


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Translate OSError raised in the block into ``storage_error(what, exc)``."""
    try:
        yield
    except OSError as exc:
        raise storage_error(what, exc) from exc


def pwrite_all(fd: int, parts: Sequence[Any], position: int) -> int:
    """Write ``parts`` at ``position`` with as few syscalls as the kernel allows; returns bytes written."""
    views = [memoryview(p).cast("B") for p in parts]
    total = sum(v.nbytes for v in views)
    written = os.pwritev(fd, views, position)
    while written < total:  # short write: rare on regular files, but legal
        skip = written
        rest = []
        for v in views:
            if skip >= v.nbytes:
                skip -= v.nbytes
                continue
            rest.append(v[skip:])
            skip = 0
        views = rest
        n = os.pwritev(fd, views, position + written)
        if n == 0:
            raise OSError(28, "No space left on device")
        written += n
    return total


def write_file_atomically(path: Path, data: bytes) -> None:
    """Write ``path`` through a temp file, fsync and rename; the caller fsyncs the directory."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pwrite_all(fd, [data], 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
