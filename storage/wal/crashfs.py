"""A crash-consistency model of the files under a data directory: record what each fsync made
durable, then drop everything else, as a power loss would.

Why a model and not a FUSE file system
--------------------------------------
Jepsen's lazyfs does the same job as a FUSE file system that keeps unsynced writes in its own
cache. It is a C++ program built from source (libfuse3 and a toolchain), it is not on PyPI or in
Debian, and FUSE needs ``/dev/fuse`` and mount rights that a CI machine may not grant. Every
change Strata makes to its data directory already goes through one seam,
``storage.wal.fileio.fs`` (grep for ``os.open``/``ftruncate``/``fsync`` under ``storage/`` and
``broker_agents/`` finds nothing else). So the model sits there: ``RecordingFileSystem`` does
every operation on the real files and, before each one, appends to a journal what a power loss
would need to undo it. The agent runs unchanged on a real disk; only the seam's object differs.

Theory of operation
-------------------
The journal (``<journal dir>/journal``, one JSON object a line, appended with ``O_APPEND`` and
never fsynced: the model survives ``kill -9``, not a real power cut) holds:

* ``file`` / ``dir``: the baseline, written when recording starts (everything present then is
  durable): a file's inode and size, a directory's inode and entries;
* ``mark``: an fsync of a file is starting; the file's size then. ``ok`` or ``fail`` follows
  with the mark's id when the fsync returns. What was written before the mark is durable once
  the ``ok`` is written; a mark without ``ok`` (the process died, or the fsync failed) made
  nothing durable;
* ``dmark``: an fsync of a directory is starting, with its entries (name -> inode, is-dir)
  then; durable after its ``ok``. Names created, renamed or removed are durable only this way;
* ``undo``: before a write overwrites existing bytes, or a truncation cuts them, the bytes
  about to be lost. Appends past the end need no record: the mark's size cuts them.

So the content of a file at a mark is its current content with every later ``undo`` applied
newest first, cut to the mark's size. A file removed or replaced is first hard-linked into
``<journal dir>/graveyard/`` (a directory is moved there instead of removed), so its inode, its
bytes and its number stay alive for as long as the journal does.

``drop_unsynced`` (run while no process uses the directory, i.e. after ``kill -9``) rebuilds
the data directory from the root's last durable entries down: each directory gets the entries
of its last successful directory fsync (none ever: empty), each file the content of its last
successful fsync (none ever: empty). Then recording starts again from that state.

fsyncgate. After a failed fsync Linux may mark the pages it could not write clean and drop
them later, so a later fsync "succeeds" without writing them. The model says the same: the
bytes dirty at a failed fsync (from the lowest byte changed since the last good fsync to the
file's size at the failed one) keep their content as of that last good fsync, or zeros past
its end, even when a later fsync succeeds, unless they were truncated away or overwritten
between the failure and that later fsync.

Faults to inject (``<journal dir>/faults.json``, re-read when it changes)::

    {"fsync_eio": [{"match": "orders-0/", "count": 1}], "quota_bytes": 8388608}

``fsync_eio``: the next ``count`` fsyncs of a file or directory whose path contains ``match``
fail with ``EIO`` (the real fsync is not called). ``quota_bytes``: a write that would grow
the files under the data directory past this many bytes fails with ``ENOSPC`` (for machines
where a small tmpfs or loop mount is not allowed).

Turned on for a process by ``STRATA_CRASHFS=<journal dir>`` (``install_from_env``, called by
the agent's entry point); off, nothing here is imported by the write path.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import shutil
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storage.wal import fileio
from storage.wal.fileio import FileSystem, pwrite_all

ENV = "STRATA_CRASHFS"
"""Environment variable: the journal directory of a data directory being recorded."""

_ROOT = "root"
_JOURNAL = "journal"
_GRAVEYARD = "graveyard"
_FAULTS = "faults.json"

Entries = dict[str, tuple[int, bool]]  # name -> (inode, is a directory)


# ---------------------------------------------------------------- starting and stopping


def start_recording(data_dir: Path, journal_dir: Path) -> None:
    """Begin a journal for ``data_dir`` (created if missing): what is there now is durable."""
    data_dir.mkdir(parents=True, exist_ok=True)
    journal_dir.mkdir(parents=True, exist_ok=True)
    if journal_dir.resolve().is_relative_to(data_dir.resolve()):
        raise ValueError("the journal cannot live inside the data directory it records")
    if os.stat(data_dir).st_dev != os.stat(journal_dir).st_dev:
        raise ValueError("the journal must be on the data directory's file system (hard links)")
    (journal_dir / _ROOT).write_text(str(data_dir.resolve()))
    shutil.rmtree(journal_dir / _GRAVEYARD, ignore_errors=True)
    (journal_dir / _GRAVEYARD).mkdir()
    lines = [_line({"k": "root", "ino": os.stat(data_dir).st_ino})]
    for path, entries in _walk_dirs(data_dir):
        lines.append(_line({"k": "dir", "ino": os.stat(path).st_ino, "entries": entries}))
        for name, (ino, is_dir) in entries.items():
            if not is_dir:
                size = os.stat(path / name).st_size
                lines.append(_line({"k": "file", "ino": ino, "size": size}))
    (journal_dir / _JOURNAL).write_bytes(b"".join(lines))


def install_from_env() -> RecordingFileSystem | None:
    """Record through ``RecordingFileSystem`` if ``STRATA_CRASHFS`` names a journal directory."""
    journal_dir = os.environ.get(ENV)
    if not journal_dir:
        return None
    recorder = RecordingFileSystem(Path(journal_dir))
    fileio.set_file_system(recorder)
    return recorder


def set_faults(
    journal_dir: Path, *, fsync_eio: Sequence[tuple[str, int]] = (), quota_bytes: int | None = None
) -> None:
    """Write the faults a recording process injects from now on (see the module docstring)."""
    faults: dict[str, Any] = {"fsync_eio": [{"match": m, "count": n} for m, n in fsync_eio]}
    if quota_bytes is not None:
        faults["quota_bytes"] = quota_bytes
    tmp = journal_dir / (_FAULTS + ".tmp")
    tmp.write_text(json.dumps(faults))
    os.replace(tmp, journal_dir / _FAULTS)


# ---------------------------------------------------------------- recording


class RecordingFileSystem(FileSystem):
    """The real file operations, each preceded by what a power loss would need to undo it.

    Thread-safe: fsyncs run in worker threads while the event loop writes. A lock orders each
    journal record with the change it describes, so that "before the mark" means before.
    """

    def __init__(self, journal_dir: Path) -> None:
        self.journal_dir = journal_dir
        self.root = Path((journal_dir / _ROOT).read_text())
        self._root_prefix = str(self.root) + os.sep
        self._graveyard = journal_dir / _GRAVEYARD
        self._lock = threading.Lock()
        self._journal = os.open(
            journal_dir / _JOURNAL, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
        )
        self._marks = 0
        self._pid = os.getpid()
        self._tracked: set[int] = {os.stat(self.root).st_ino}
        for base in (self.root, self._graveyard):
            for dirpath, dirnames, filenames in os.walk(base):
                for n in dirnames + filenames:
                    self._tracked.add(os.lstat(os.path.join(dirpath, n)).st_ino)
        self._faults_seen: tuple[int, int, int] | None = None
        self._eio: list[list[Any]] = []  # [match, remaining]
        self._quota: int | None = None

    # ---- helpers ---------------------------------------------------------------------------
    def _under_root(self, path: Path) -> bool:
        p = os.path.realpath(path)
        return p == str(self.root) or p.startswith(self._root_prefix)

    def _record(self, rec: dict[str, Any]) -> None:
        os.write(self._journal, _line(rec))

    def _mark_id(self) -> str:
        self._marks += 1
        return f"{self._pid}.{self._marks}"

    def _read_faults(self) -> None:
        try:
            st = os.stat(self.journal_dir / _FAULTS)
        except FileNotFoundError:
            self._faults_seen, self._eio, self._quota = None, [], None
            return
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self._faults_seen:
            return
        self._faults_seen = key
        faults = json.loads((self.journal_dir / _FAULTS).read_text())
        self._eio = [[f["match"], int(f["count"])] for f in faults.get("fsync_eio", [])]
        self._quota = faults.get("quota_bytes")

    def _inject_eio(self, fd: int) -> bool:
        self._read_faults()
        if not self._eio:
            return False
        path = os.readlink(f"/proc/self/fd/{fd}")
        path += os.sep if os.path.isdir(path) else ""
        for rule in self._eio:
            if rule[0] in path and rule[1] > 0:
                rule[1] -= 1
                return True
        return False

    def free_bytes(self, path: Path) -> int:
        free = super().free_bytes(path)
        self._read_faults()
        if self._quota is None or not self._under_root(path):
            return free
        return max(0, min(free, self._quota - self._used()))

    def _used(self) -> int:
        total = 0
        for d, _, ns in os.walk(self.root):
            for n in ns:
                # a file another thread removes meanwhile (a checkpoint, a flush) counts 0
                with contextlib.suppress(FileNotFoundError):
                    total += os.lstat(os.path.join(d, n)).st_size
        return total

    def _check_quota(self, growth: int) -> None:
        self._read_faults()
        if self._quota is None or growth <= 0:
            return
        if self._used() + growth > self._quota:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def _bury(self, path: Path) -> None:
        """Keep the inode of a file about to lose its name alive in the graveyard."""
        st = os.lstat(path)
        target = self._graveyard / str(st.st_ino)
        if not target.exists():
            os.link(path, target)

    # ---- files -----------------------------------------------------------------------------
    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        if not self._under_root(path):
            return super().open(path, flags, mode)
        truncate = bool(flags & os.O_TRUNC)
        with self._lock:
            fd = os.open(path, flags & ~os.O_TRUNC, mode)
            self._tracked.add(os.fstat(fd).st_ino)
        if truncate:
            self.ftruncate(fd, 0)
        return fd

    def pwrite(self, fd: int, parts: Sequence[Any], position: int) -> int:
        st = os.fstat(fd)
        if st.st_ino not in self._tracked:
            return super().pwrite(fd, parts, position)
        total = sum(memoryview(p).nbytes for p in parts)
        self._check_quota(position + total - st.st_size)
        with self._lock:
            size = os.fstat(fd).st_size
            if position < size:
                old = os.pread(fd, min(total, size - position), position)
                self._record({"k": "undo", "ino": st.st_ino, "off": position, "data": _b64(old)})
            return pwrite_all(fd, parts, position)

    def ftruncate(self, fd: int, size: int) -> None:
        st = os.fstat(fd)
        if st.st_ino not in self._tracked:
            return super().ftruncate(fd, size)
        with self._lock:
            current = os.fstat(fd).st_size
            if size < current:
                old = os.pread(fd, current - size, size)
                self._record({"k": "undo", "ino": st.st_ino, "off": size, "data": _b64(old)})
            os.ftruncate(fd, size)
        return None

    def fsync(self, fd: int) -> None:
        st = os.fstat(fd)
        if st.st_ino not in self._tracked:
            return super().fsync(fd)
        with self._lock:
            mark = self._mark_id()
            self._record({"k": "mark", "id": mark, "ino": st.st_ino, "size": os.fstat(fd).st_size})
            inject = self._inject_eio(fd)
        try:
            if inject:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            os.fsync(fd)
        except OSError:
            with self._lock:
                self._record({"k": "fail", "id": mark})
            raise
        with self._lock:
            self._record({"k": "ok", "id": mark})
        return None

    # ---- names -----------------------------------------------------------------------------
    def fsync_dir(self, path: Path) -> None:
        if not self._under_root(path):
            return super().fsync_dir(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with self._lock:
                mark = self._mark_id()
                entries = _entries(Path(path))
                ino = os.fstat(fd).st_ino
                self._record({"k": "dmark", "id": mark, "ino": ino, "entries": entries})
                inject = self._inject_eio(fd)
            try:
                if inject:
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                os.fsync(fd)
            except OSError:
                with self._lock:
                    self._record({"k": "fail", "id": mark})
                raise
            with self._lock:
                self._record({"k": "ok", "id": mark})
        finally:
            os.close(fd)
        return None

    def replace(self, src: Path, dst: Path) -> None:
        if not self._under_root(dst):
            return super().replace(src, dst)
        with self._lock:
            if os.path.isfile(dst):
                self._bury(dst)
            os.replace(src, dst)
            self._tracked.add(os.lstat(dst).st_ino)
        return None

    def unlink(self, path: Path, *, missing_ok: bool = False) -> None:
        if not self._under_root(path):
            return super().unlink(path, missing_ok=missing_ok)
        with self._lock:
            if not os.path.lexists(path):
                if missing_ok:
                    return None
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
            self._bury(path)
            os.unlink(path)
        return None

    def make_dirs(self, path: Path, *, sync_parent: bool = True) -> None:
        if not self._under_root(path):
            return super().make_dirs(path, sync_parent=sync_parent)
        # os.mkdir, then fsync_dir of the parent (the caller's, without sync_parent): recorded
        super().make_dirs(path, sync_parent=sync_parent)
        with self._lock:
            self._tracked.add(os.stat(path).st_ino)
        return None

    def remove_tree(self, path: Path) -> None:
        if not self._under_root(path):
            return super().remove_tree(path)
        if not path.exists():
            return None
        for dirpath, dirnames, filenames in os.walk(path, topdown=False):
            for n in filenames:
                self.unlink(Path(dirpath) / n)
            for n in dirnames:
                self._bury_dir(Path(dirpath) / n)
        self._bury_dir(path)
        self.fsync_dir(path.parent)
        return None

    def _bury_dir(self, path: Path) -> None:
        """Move an emptied directory into the graveyard (its inode number must not be reused)."""
        with self._lock:
            os.rename(path, self._graveyard / f"d{os.lstat(path).st_ino}")


# ---------------------------------------------------------------- power loss


def drop_unsynced(journal_dir: Path) -> None:
    """Put the recorded data directory back to what its fsyncs made durable (a power loss).

    Run only while no process writes the directory (after ``kill -9``). Afterwards recording
    starts over from the state left behind, so a restarted agent can lose power again.
    """
    root = Path((journal_dir / _ROOT).read_text())
    model = _Model.load(journal_dir / _JOURNAL)
    where: dict[int, Path] = {}
    for base in (root, journal_dir / _GRAVEYARD):
        for dirpath, _, filenames in os.walk(base):
            for n in filenames:
                p = Path(dirpath) / n
                where[os.lstat(p).st_ino] = p
    staging = journal_dir / "staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    model.build(model.root, staging, where, set())
    for child in list(root.iterdir()):
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    for child in staging.iterdir():
        os.rename(child, root / child.name)
    staging.rmdir()
    start_recording(root, journal_dir)


@dataclass
class _FileHistory:
    """One inode's events in journal order: (position, kind, a, b)."""

    events: list[tuple[int, str, int, Any]] = field(default_factory=list)
    # kinds: "good" (size), "fail" (size), "undo" (offset, bytes)


@dataclass
class _Model:
    root: int
    files: dict[int, _FileHistory]
    dirs: dict[int, Entries]

    @classmethod
    def load(cls, path: Path) -> _Model:
        records = []
        for raw in path.read_bytes().split(b"\n"):
            try:
                records.append(json.loads(raw))
            except ValueError:
                continue  # the torn last line of a killed writer (or the empty string after it)
        outcome = {r["id"]: r["k"] for r in records if r["k"] in ("ok", "fail")}
        root = -1
        files: dict[int, _FileHistory] = {}
        dirs: dict[int, Entries] = {}
        for pos, r in enumerate(records):
            k = r["k"]
            if k == "root":
                root = r["ino"]
            elif k == "file":
                files.setdefault(r["ino"], _FileHistory()).events.append(
                    (pos, "good", r["size"], None)
                )
            elif k == "dir" or (k == "dmark" and outcome.get(r["id"]) == "ok"):
                dirs[r["ino"]] = {n: (e[0], bool(e[1])) for n, e in r["entries"].items()}
            elif k == "mark" and r["id"] in outcome:
                kind = "good" if outcome[r["id"]] == "ok" else "fail"
                files.setdefault(r["ino"], _FileHistory()).events.append(
                    (pos, kind, r["size"], None)
                )
            elif k == "undo":
                data = base64.b64decode(r["data"])
                files.setdefault(r["ino"], _FileHistory()).events.append(
                    (pos, "undo", r["off"], data)
                )
        if root < 0:
            raise ValueError(f"{path} has no baseline")
        return cls(root, files, dirs)

    def build(self, dir_ino: int, dest: Path, where: dict[int, Path], seen: set[int]) -> None:
        if dir_ino in seen:
            raise ValueError(f"directory inode {dir_ino} reached twice")
        seen.add(dir_ino)
        for name, (ino, is_dir) in self.dirs.get(dir_ino, {}).items():
            if is_dir:
                (dest / name).mkdir()
                self.build(ino, dest / name, where, seen)
            else:
                (dest / name).write_bytes(self.durable_content(ino, where))

    def durable_content(self, ino: int, where: dict[int, Path]) -> bytes:
        """What the disk holds for ``ino``: its content at its last successful fsync, with the
        bytes lost to earlier failed fsyncs (fsyncgate, see the module docstring) put back."""
        history = self.files.get(ino)
        if history is None:
            return b""  # named durably, never fsynced
        goods = [i for i, e in enumerate(history.events) if e[1] == "good"]
        if not goods:
            return b""
        path = where.get(ino)
        if path is None:
            raise ValueError(
                f"inode {ino} is durable but neither in the data dir nor the graveyard"
            )
        return _disk_at(path.read_bytes(), history.events, goods[-1], {})


def _disk_at(
    current: bytes, events: list[tuple[int, str, int, Any]], mark: int, memo: dict[int, bytes]
) -> bytes:
    """The disk's content after the good mark ``events[mark]``: the file's content then, except
    the ranges a failed fsync before it left unwritten (and nothing rewrote since)."""
    if mark in memo:
        return memo[mark]
    image = bytearray(_content_at(current, events, mark))
    for f in range(mark):
        if events[f][1] != "fail":
            continue
        before = [i for i in range(f) if events[i][1] == "good"]
        base = _disk_at(current, events, before[-1], memo) if before else b""
        since = events[(before[-1] if before else -1) + 1 : f]
        low = min([len(base)] + [u[2] for u in since if u[1] == "undo"])
        rewritten = [(u[2], u[2] + len(u[3])) for u in events[f + 1 : mark] if u[1] == "undo"]
        for lo, hi in _subtract([(low, events[f][2])], rewritten):
            for i in range(lo, min(hi, len(image))):
                image[i] = base[i] if i < len(base) else 0
    memo[mark] = bytes(image)
    return memo[mark]


def _content_at(current: bytes, events: list[tuple[int, str, int, Any]], index: int) -> bytes:
    """The file's content when the good mark ``events[index]`` was taken: the current content
    with every later ``undo`` applied, newest first, cut to the mark's size."""
    buf = bytearray(current)
    for e in reversed(events[index + 1 :]):
        if e[1] != "undo":
            continue
        off, data = e[2], e[3]
        if len(buf) < off + len(data):
            buf.extend(bytes(off + len(data) - len(buf)))
        buf[off : off + len(data)] = data
    size = events[index][2]
    if len(buf) < size:
        raise ValueError(f"the journal cannot rebuild {size} bytes from {len(buf)}")
    return bytes(buf[:size])


def _subtract(ranges: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = ranges
    for h_lo, h_hi in holes:
        nxt = []
        for lo, hi in out:
            if h_hi <= lo or h_lo >= hi:
                nxt.append((lo, hi))
                continue
            if lo < h_lo:
                nxt.append((lo, h_lo))
            if h_hi < hi:
                nxt.append((h_hi, hi))
        out = nxt
    return out


# ---------------------------------------------------------------- small helpers


def _line(rec: dict[str, Any]) -> bytes:
    return (json.dumps(rec, separators=(",", ":")) + "\n").encode()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _entries(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with os.scandir(path) as it:
        for e in it:
            if e.is_dir(follow_symlinks=False) or e.is_file(follow_symlinks=False):
                out[e.name] = [e.inode(), e.is_dir(follow_symlinks=False)]
    return out


def _walk_dirs(base: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    for dirpath, _, _ in os.walk(base):
        p = Path(dirpath)
        yield p, _entries(p)
