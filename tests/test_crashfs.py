"""The power-loss model (``storage.wal.crashfs``) against a direct model of what a disk keeps.

The state machine drives ``RecordingFileSystem`` on real files with random creates, writes at
any offset, appends, truncations, renames over existing files, removals, directory creation
and removal, fsyncs of files and directories (some failing with an injected EIO), and power
losses. The reference keeps, per file, what the disk holds (set at each successful fsync) and,
per directory, the entries of its last successful fsync; after each ``drop_unsynced`` the
directory tree must be exactly what the reference says survives.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from storage.wal import crashfs
from storage.wal.crashfs import RecordingFileSystem, drop_unsynced, set_faults, start_recording

INF = 1 << 62
SHM = Path("/dev/shm")


@dataclass(eq=False)
class RefFile:
    content: bytearray = field(default_factory=bytearray)
    disk: bytes | None = None  # None: never fsynced
    dirty_lo: int = INF  # lowest byte changed since the last good fsync
    #: (lo, hi, disk content then): pages a failed fsync did not write (fsyncgate)
    lost: list[tuple[int, int, bytes]] = field(default_factory=list)

    def changed(self, lo: int, hi: int) -> None:
        """Bytes [lo, hi) of existing content were rewritten or cut: no longer lost."""
        kept = []
        for a, b, base in self.lost:
            if hi <= a or lo >= b:
                kept.append((a, b, base))
                continue
            if a < lo:
                kept.append((a, lo, base))
            if hi < b:
                kept.append((hi, b, base))
        self.lost = kept


@dataclass(eq=False)
class RefDir:
    entries: dict[str, RefFile | RefDir] = field(default_factory=dict)
    durable: dict[str, RefFile | RefDir] = field(default_factory=dict)


NAMES = st.sampled_from(["f0", "f1"])
DIRS = st.sampled_from(["", "a"])
DATA = st.binary(min_size=1, max_size=300)
WHERE = st.integers(0, 120)  # a position in % of the file's length (past 100: past the end)


class CrashMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # the model, not the disk, is under test: on tmpfs the real fsyncs cost nothing
        self.tmp = Path(tempfile.mkdtemp(prefix="crashfs-", dir=SHM if SHM.is_dir() else None))
        self.root = self.tmp / "data"
        self.journal = self.tmp / "journal"
        start_recording(self.root, self.journal)
        self.fs = RecordingFileSystem(self.journal)
        self.ref = RefDir()
        self.losses = 0

    def teardown(self) -> None:
        shutil.rmtree(self.tmp)

    # ---- helpers -----------------------------------------------------------------------
    def dir(self, name: str) -> RefDir | None:
        if not name:
            return self.ref
        d = self.ref.entries.get(name)
        return d if isinstance(d, RefDir) else None

    def file(self, d: str, name: str) -> RefFile | None:
        parent = self.dir(d)
        f = parent.entries.get(name) if parent else None
        return f if isinstance(f, RefFile) else None

    def path(self, d: str, name: str = "") -> Path:
        return self.root / d / name if d else self.root / name

    def fd(self, d: str, name: str) -> int:
        return self.fs.open(self.path(d, name), os.O_RDWR)

    @initialize(data=DATA)
    def durable_start(self, data: bytes) -> None:
        """A durable file and directory to start from (most sequences then change something)."""
        self.make_dir("a")
        for d in ("", "a"):
            self.create(d, "f0")
            self.write(d, "f0", 0, data)
        self.sync_everything()

    # ---- files -------------------------------------------------------------------------
    @rule(d=DIRS, name=NAMES)
    def create(self, d: str, name: str) -> None:
        parent = self.dir(d)
        if parent is None or name in parent.entries:
            return
        os.close(self.fs.open(self.path(d, name), os.O_RDWR | os.O_CREAT | os.O_EXCL))
        parent.entries[name] = RefFile()

    @rule(d=DIRS, name=NAMES, where=WHERE, data=DATA)
    def overwrite(self, d: str, name: str, where: int, data: bytes) -> None:
        f = self.file(d, name)
        if f is not None:
            self.write(d, name, len(f.content) * where // 100, data)

    def write(self, d: str, name: str, at: int, data: bytes) -> None:
        f = self.file(d, name)
        if f is None:
            return
        fd = self.fd(d, name)
        try:
            self.fs.pwrite(fd, [data], at)
        finally:
            os.close(fd)
        old = len(f.content)
        if at > old:
            f.content.extend(bytes(at - old))
        f.content[at : at + len(data)] = data
        f.dirty_lo = min(f.dirty_lo, at, old)
        f.changed(at, min(at + len(data), old))

    @rule(d=DIRS, name=NAMES, data=DATA)
    def append(self, d: str, name: str, data: bytes) -> None:
        f = self.file(d, name)
        if f is not None:
            self.write(d, name, len(f.content), data)

    @rule(d=DIRS, name=NAMES, where=WHERE)
    def truncate(self, d: str, name: str, where: int) -> None:
        f = self.file(d, name)
        if f is None:
            return
        size = len(f.content) * where // 100
        fd = self.fd(d, name)
        try:
            self.fs.ftruncate(fd, size)
        finally:
            os.close(fd)
        old = len(f.content)
        if size < old:
            del f.content[size:]
            f.changed(size, old)
        else:
            f.content.extend(bytes(size - old))
        f.dirty_lo = min(f.dirty_lo, size, old)

    @rule(d=DIRS, name=NAMES, fail=st.booleans())
    def fsync(self, d: str, name: str, fail: bool) -> None:
        f = self.file(d, name)
        if f is None:
            return
        fd = self.fd(d, name)
        try:
            if fail:
                set_faults(self.journal, fsync_eio=[(os.path.realpath(self.path(d, name)), 1)])
                with pytest.raises(OSError) as exc:
                    self.fs.fsync(fd)
                assert exc.value.errno == errno.EIO
                set_faults(self.journal)
            else:
                self.fs.fsync(fd)
        finally:
            os.close(fd)
        if fail:
            if f.dirty_lo < len(f.content):
                f.lost.append((f.dirty_lo, len(f.content), f.disk or b""))
            f.dirty_lo = INF  # those pages now count as clean, as after a real EIO
            return
        disk = bytearray(f.content)
        for lo, hi, base in f.lost:
            for i in range(lo, min(hi, len(disk))):
                disk[i] = base[i] if i < len(base) else 0
        f.disk = bytes(disk)
        f.dirty_lo = INF

    # ---- names -------------------------------------------------------------------------
    @rule(d=DIRS, fail=st.booleans())
    def fsync_dir(self, d: str, fail: bool) -> None:
        parent = self.dir(d)
        if parent is None:
            return
        if fail:
            set_faults(self.journal, fsync_eio=[(os.path.realpath(self.path(d)) + os.sep, 1)])
            with pytest.raises(OSError):
                self.fs.fsync_dir(self.path(d))
            set_faults(self.journal)
            return
        self.fs.fsync_dir(self.path(d))
        parent.durable = dict(parent.entries)

    @rule(d=DIRS, name=NAMES, to_d=DIRS, to=NAMES)
    def rename(self, d: str, name: str, to_d: str, to: str) -> None:
        f = self.file(d, name)
        target = self.dir(to_d)
        if f is None or target is None or isinstance(target.entries.get(to), RefDir):
            return
        if (d, name) == (to_d, to):
            return
        self.fs.replace(self.path(d, name), self.path(to_d, to))
        parent = self.dir(d)
        assert parent is not None
        del parent.entries[name]
        target.entries[to] = f

    @rule(d=DIRS, name=NAMES)
    def unlink(self, d: str, name: str) -> None:
        if self.file(d, name) is None:
            return
        self.fs.unlink(self.path(d, name))
        parent = self.dir(d)
        assert parent is not None
        del parent.entries[name]

    @rule(d=st.just("a"))
    def make_dir(self, d: str) -> None:
        if d in self.ref.entries:
            return
        self.fs.make_dirs(self.path(d))  # fsyncs the parent
        self.ref.entries[d] = RefDir()
        self.ref.durable = dict(self.ref.entries)

    @rule(d=st.just("a"))
    def remove_dir(self, d: str) -> None:
        if self.dir(d) is None:
            return
        self.fs.remove_tree(self.path(d))  # fsyncs the parent
        del self.ref.entries[d]
        self.ref.durable = dict(self.ref.entries)

    @rule()
    def sync_everything(self) -> None:
        """Every file and directory fsynced (so later changes have something to undo)."""
        for d in ["", "a"]:
            parent = self.dir(d)
            if parent is None:
                continue
            for name, node in list(parent.entries.items()):
                if isinstance(node, RefFile):
                    self.fsync(d, name, False)
            self.fsync_dir(d, False)

    # ---- power loss ----------------------------------------------------------------------
    @precondition(lambda self: self.losses < 4)
    @rule()
    def power_loss(self) -> None:
        drop_unsynced(self.journal)
        self.losses += 1
        expected = self.survivors(self.ref, "")
        assert tree(self.root) == expected
        self.ref = self.rebuild(self.ref)
        self.fs = RecordingFileSystem(self.journal)  # the restarted process

    def survivors(self, d: RefDir, prefix: str) -> dict[str, bytes | None]:
        out: dict[str, bytes | None] = {}
        for name, node in d.durable.items():
            if isinstance(node, RefDir):
                out[prefix + name] = None
                out.update(self.survivors(node, prefix + name + "/"))
            else:
                out[prefix + name] = node.disk or b""
        return out

    def rebuild(self, d: RefDir) -> RefDir:
        new = RefDir()
        for name, node in d.durable.items():
            if isinstance(node, RefDir):
                new.entries[name] = self.rebuild(node)
            else:
                disk = node.disk or b""
                new.entries[name] = RefFile(bytearray(disk), disk)
        new.durable = dict(new.entries)
        return new

    @invariant()
    def files_match_the_reference(self) -> None:
        assert tree(self.root) == self.current(self.ref, "")

    def current(self, d: RefDir, prefix: str) -> dict[str, bytes | None]:
        out: dict[str, bytes | None] = {}
        for name, node in d.entries.items():
            if isinstance(node, RefDir):
                out[prefix + name] = None
                out.update(self.current(node, prefix + name + "/"))
            else:
                out[prefix + name] = bytes(node.content)
        return out


def tree(root: Path) -> dict[str, bytes | None]:
    """Relative path -> content (None for a directory)."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        prefix = "" if rel == "." else rel + "/"
        for n in dirnames:
            out[prefix + n] = None
        for n in filenames:
            out[prefix + n] = Path(dirpath, n).read_bytes()
    return out


CrashMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCrashModel = CrashMachine.TestCase


# ---- single cases, spelled out -----------------------------------------------------------


@pytest.fixture
def recorded(tmp_path: Path) -> tuple[Path, Path, RecordingFileSystem]:
    root, journal = tmp_path / "data", tmp_path / "journal"
    start_recording(root, journal)
    return root, journal, RecordingFileSystem(journal)


def test_an_append_is_kept_only_up_to_the_last_fsync(
    recorded: tuple[Path, Path, RecordingFileSystem],
) -> None:
    root, journal, fs = recorded
    fd = fs.open(root / "seg", os.O_RDWR | os.O_CREAT | os.O_EXCL)
    fs.pwrite(fd, [b"synced"], 0)
    fs.fsync(fd)
    fs.fsync_dir(root)
    fs.pwrite(fd, [b"-lost"], 6)
    os.close(fd)
    assert (root / "seg").read_bytes() == b"synced-lost"
    drop_unsynced(journal)
    assert (root / "seg").read_bytes() == b"synced"


def test_a_file_whose_directory_was_never_fsynced_is_gone(
    recorded: tuple[Path, Path, RecordingFileSystem],
) -> None:
    root, journal, fs = recorded
    fd = fs.open(root / "seg", os.O_RDWR | os.O_CREAT | os.O_EXCL)
    fs.pwrite(fd, [b"data"], 0)
    fs.fsync(fd)
    os.close(fd)
    drop_unsynced(journal)
    assert not (root / "seg").exists()


def test_an_atomic_rename_without_a_directory_fsync_leaves_the_old_file(
    recorded: tuple[Path, Path, RecordingFileSystem],
) -> None:
    root, journal, fs = recorded
    (root / "index").write_bytes(b"old")  # (not recorded: written before the layer ran)
    start_recording(root, journal)
    fs = RecordingFileSystem(journal)
    fd = fs.open(root / "index.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    fs.pwrite(fd, [b"new"], 0)
    fs.fsync(fd)
    os.close(fd)
    fs.replace(root / "index.tmp", root / "index")
    assert (root / "index").read_bytes() == b"new"
    drop_unsynced(journal)
    assert sorted(p.name for p in root.iterdir()) == ["index"]
    assert (root / "index").read_bytes() == b"old"


def test_pages_a_failed_fsync_did_not_write_stay_lost_after_a_later_good_fsync(
    recorded: tuple[Path, Path, RecordingFileSystem],
) -> None:
    """fsyncgate: the retry "succeeds", the bytes are still not on the disk."""
    root, journal, fs = recorded
    fd = fs.open(root / "seg", os.O_RDWR | os.O_CREAT | os.O_EXCL)
    fs.pwrite(fd, [b"aaaa"], 0)
    fs.fsync(fd)
    fs.fsync_dir(root)
    fs.pwrite(fd, [b"bbbb"], 4)
    set_faults(journal, fsync_eio=[("seg", 1)])
    with pytest.raises(OSError):
        fs.fsync(fd)
    fs.pwrite(fd, [b"cccc"], 8)
    fs.fsync(fd)  # no error: the kernel reported it once
    os.close(fd)
    drop_unsynced(journal)
    assert (root / "seg").read_bytes() == b"aaaa\0\0\0\0cccc"


def test_a_quota_fails_writes_with_enospc_until_it_is_raised(
    recorded: tuple[Path, Path, RecordingFileSystem],
) -> None:
    root, journal, fs = recorded
    set_faults(journal, quota_bytes=10)
    fd = fs.open(root / "seg", os.O_RDWR | os.O_CREAT | os.O_EXCL)
    fs.pwrite(fd, [b"12345678"], 0)
    with pytest.raises(OSError) as exc:
        fs.pwrite(fd, [b"abc"], 8)
    assert exc.value.errno == errno.ENOSPC
    fs.pwrite(fd, [b"zz"], 0)  # an overwrite needs no new space
    set_faults(journal)
    fs.pwrite(fd, [b"abc"], 8)
    os.close(fd)
    assert (root / "seg").read_bytes() == b"zz345678abc"


def test_the_journal_cannot_live_in_the_data_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        start_recording(tmp_path, tmp_path / "journal")


def test_install_from_env_is_off_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(crashfs.ENV, raising=False)
    assert crashfs.install_from_env() is None
