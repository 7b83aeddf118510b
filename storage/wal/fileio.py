"""Small, careful file primitives, and the one seam every change to the data directory takes.

Every write, truncation, fsync, creation, rename and removal of a file or directory under an
agent's data directory goes through ``fs``, a ``FileSystem``. The plain ``FileSystem`` is a
thin layer over ``os`` (one attribute lookup per call). Tests and fault drills swap in
``storage.wal.crashfs.RecordingFileSystem``, which records what each fsync made durable so a
simulated power loss can later put every file back to exactly that, and which can inject
``EIO`` on fsync or ``ENOSPC`` past a byte quota. Reads (``mmap``, ``read_bytes``) do not go
through the seam: they change nothing.

Durability rules the callers rely on (POSIX, and what the recording layer models):

* bytes written to a file are durable once an fsync of that file that *started* after the
  write has returned successfully; a failed fsync makes nothing durable, and on Linux the
  pages it failed to write may be dropped from the cache later ("fsyncgate"), so a caller
  never retries it as if it had worked;
* a name created, renamed or removed in a directory is durable once that directory is
  fsynced (``fsync_dir``); ``make_dirs`` fsyncs the parent of every directory it creates.
"""

from __future__ import annotations

import contextlib
import os
import shutil
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


class FileSystem:
    """The real thing: each method is the ``os`` call it names, raising ``OSError``."""

    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags, mode)

    def pwrite(self, fd: int, parts: Sequence[Any], position: int) -> int:
        return pwrite_all(fd, parts, position)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)

    def unlink(self, path: Path, *, missing_ok: bool = False) -> None:
        path.unlink(missing_ok=missing_ok)

    def free_bytes(self, path: Path) -> int:
        """Bytes an unprivileged writer can still add to the filesystem holding ``path``."""
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize

    def make_dirs(self, path: Path, *, sync_parent: bool = True) -> None:
        """``mkdir -p``, fsyncing the parent of every directory created so its name is durable.

        With ``sync_parent=False`` the last one's parent is not fsynced: the caller does it
        (once for many new directories) before it counts on ``path``'s name."""
        if path.is_dir():
            return
        parent = path.parent
        if parent != path:
            self.make_dirs(parent)
        try:
            os.mkdir(path)
        except FileExistsError:
            if not path.is_dir():
                raise
            return
        if sync_parent:
            self.fsync_dir(parent)

    def remove_tree(self, path: Path) -> None:
        """``rm -r`` (a missing path is fine), then fsync the parent: the removal is durable."""
        if not path.exists():
            return
        shutil.rmtree(path, ignore_errors=True)
        self.fsync_dir(path.parent)


#: the file system every storage module writes through (see the module docstring)
fs: FileSystem = FileSystem()


def set_file_system(new: FileSystem) -> FileSystem:
    """Install ``new`` as ``fs``; returns the one it replaces."""
    global fs
    old, fs = fs, new
    return old


def write_file_atomically(path: Path, data: bytes) -> None:
    """Write ``path`` through a temp file, fsync and rename; the caller fsyncs the directory."""
    tmp = path.with_name(path.name + ".tmp")
    fd = fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        fs.pwrite(fd, [data], 0)
        fs.fsync(fd)
    finally:
        os.close(fd)
    fs.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fs.fsync_dir(path)
