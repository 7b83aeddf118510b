"""Recovery of the agent WAL: bring every partition log back to what the WAL holds, before
any partition opens (``docs/architecture.md``, *The agent WAL*).

For each partition the WAL names (by directory and topic id), replay starts from an
**anchor**: an offset below which the partition's own files hold the right bytes on disk —
its log end at the last completed checkpoint (``checkpoint``), or at its latest OPEN entry
(opening a log fsyncs it). The entries after the anchor are simulated: DATA appends at the
end, TRUNCATE cuts, RESTART empties. The partition's files are then cut to the lowest offset
the history after the anchor rewrote (the anchor, or a lower truncation point), and the
batches of the simulated history from there are appended again (each checked with its CRC),
so a log ends exactly where the WAL's history ends: nothing the WAL holds is missing, and
nothing a truncation removed comes back. The logs are fsynced, then the WAL files removed.

A torn frame at the end of the newest file is cut (it was never covered by an fsync). A
damaged frame anywhere else, or an entry that does not follow its partition's history, is
corruption: ``CorruptSegmentError``, never a silent skip.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

from storage.codec.header import read_header
from storage.config import FsyncPolicy, LogConfig
from storage.errors import CorruptSegmentError, StorageError, StrataError
from storage.wal import fileio
from storage.wal.agent.format import (
    Entry,
    Frame,
    Kind,
    parse_name,
    read_frames,
    valid_frame_after,
)
from storage.wal.agent.journal import CHECKPOINT
from storage.wal.fileio import fsync_dir, storage_errors
from storage.wal.log import PartitionLog
from storage.wal.partition_meta import read_topic_id
from storage.wal.segment import INDEX_SUFFIX, LOG_SUFFIX

_log = logging.getLogger(__name__)

#: logs are reopened only to be filled again: any batch the WAL took fits
_REPLAY_CONFIG = LogConfig(max_message_bytes=1 << 30, fsync_policy=FsyncPolicy.NEVER)


class _PartitionUnavailable(StorageError):
    """A partition's own files cannot be opened (quarantined, a disk error)."""


@dataclass
class _History:
    anchor: int | None = None
    entries: list[Entry] = field(default_factory=list)


@dataclass
class ReplayResult:
    files: int = 0
    entries: int = 0
    partitions: int = 0
    batches_appended: int = 0
    torn_bytes: int = 0
    skipped: list[str] = field(default_factory=list)
    #: partitions whose own files could not take the replay: directory -> why
    failed: dict[str, str] = field(default_factory=dict)


def replay(wal_dir: Path, data_dir: Path) -> ReplayResult:
    """Apply the WAL in ``wal_dir`` to the partition logs under ``data_dir``, then empty it."""
    result = ReplayResult()
    if not wal_dir.is_dir():
        return result
    anchors: dict[tuple[str, str], int] = {}
    first = 0
    ckpt = wal_dir / CHECKPOINT
    if ckpt.exists():
        with storage_errors(f"cannot read {ckpt}"):
            doc = json.loads(ckpt.read_bytes())
        first = int(doc["first_file"])
        anchors = {(name, tid): int(end) for name, (tid, end) in doc["anchors"].items()}
    files = sorted(
        (parsed, p) for p in wal_dir.iterdir() if (parsed := parse_name(p.name)) is not None
    )
    histories: dict[tuple[str, str], _History] = {}
    maps: list[tuple[int, mmap.mmap | None]] = []
    try:
        for i, ((seq, failed), path) in enumerate(files):
            if seq < first:
                continue  # applied by the checkpoint (a removal it did not finish)
            result.files += 1
            with storage_errors(f"cannot read {path}"):
                fd = fileio.fs.open(path, os.O_RDWR)
            size = os.fstat(fd).st_size
            buf: mmap.mmap | None = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
            maps.append((fd, buf))
            frames, end, error = read_frames(buf if buf is not None else b"")
            # (a frame's views of ``buf`` live in ``histories`` until the end)
            later = [p for _, p in files[i + 1 :]]
            if error is not None:
                if buf is not None and valid_frame_after(buf, end):
                    raise CorruptSegmentError(
                        f"agent WAL frame damaged with valid frames after it ({error})",
                        path=str(path),
                        position=end,
                    )
                # a torn tail: bytes no completed fsync covered (a power loss, or the fsync
                # that failed before the file was set aside)
                result.torn_bytes += size - end
                _log.warning("agent WAL: torn tail cut at byte %d of %s", end, path.name)
                with storage_errors(f"cannot cut {path}"):
                    fileio.fs.ftruncate(fd, end)
                    fileio.fs.fsync(fd)
                if later and not failed:
                    # files are fsynced oldest first, and an acknowledgement waits for the
                    # newest: nothing in a later file was ever acknowledged as durable
                    _log.warning(
                        "agent WAL: %d later file(s) dropped after the torn tail", len(later)
                    )
                    _apply_file(frames, path, histories, result)
                    for p in later:
                        fileio.fs.unlink(p)
                    break
            _apply_file(frames, path, histories, result)
        for key, h in histories.items():
            if h.anchor is None:
                h.anchor = anchors.get(key)
            if not h.entries:
                continue
            result.partitions += 1
            try:
                result.batches_appended += _apply(data_dir, key, h, result)
            except _PartitionUnavailable as exc:
                # this partition's own files fail (a quarantined segment, a disk error): it
                # stays as it is, and the agent's open reports it offline as without a WAL;
                # the WAL is kept (replaying it again is harmless) for a repair to come
                _log.error("agent WAL: cannot replay into %s: %s", key[0], exc)
                result.failed[key[0]] = str(exc)
    finally:
        histories.clear()  # the entries hold views of the maps
        for fd, buf in maps:
            if buf is not None:
                with contextlib.suppress(BufferError):  # a view still alive: the GC closes it
                    buf.close()
            os.close(fd)
    if not result.failed:
        _clear(wal_dir)
    return result


def _apply_file(
    frames: list[Frame],
    path: Path,
    histories: dict[tuple[str, str], _History],
    result: ReplayResult,
) -> None:
    """Add one file's entries to each partition's history (an OPEN starts it afresh)."""
    names: dict[int, tuple[str, str]] = {}
    for frame in frames:
        for e in frame.entries:
            result.entries += 1
            if e.kind == Kind.NAME:
                names[e.pid] = e.data
                continue
            key = names.get(e.pid)
            if key is None:
                raise CorruptSegmentError(
                    f"agent WAL entry for unnamed partition id {e.pid}",
                    path=str(path),
                    position=frame.position,
                )
            h = histories.setdefault(key, _History())
            if e.kind == Kind.OPEN:
                h.anchor = e.offset
                h.entries = []
            else:
                h.entries.append(e)


def _apply(data_dir: Path, key: tuple[str, str], h: _History, result: ReplayResult) -> int:
    dirname, topic_id = key
    directory = data_dir / dirname
    if not directory.is_dir():
        result.skipped.append(dirname)  # the partition was deleted (or moved away) since
        return 0
    found = read_topic_id(directory)
    if topic_id and found is not None and found != topic_id:
        result.skipped.append(dirname)  # another incarnation of the topic lives there now
        return 0
    if h.anchor is None:
        raise CorruptSegmentError(
            f"agent WAL has entries for {dirname} but no anchor", path=str(directory)
        )
    end = h.anchor
    cut = h.anchor
    restart: int | None = None
    kept: list[tuple[Entry, int]] = []  # DATA entry, its next offset
    for e in h.entries:
        if e.kind == Kind.DATA:
            if e.offset != end:
                raise CorruptSegmentError(
                    f"agent WAL: batch at {e.offset} where {end} was expected",
                    path=str(directory),
                )
            end = e.offset + read_header(e.data).record_count
            kept.append((e, end))
        elif e.kind == Kind.TRUNCATE:
            if e.offset < end:
                kept = [(d, n) for d, n in kept if d.offset < e.offset]
                end = e.offset
                cut = min(cut, end)
        elif e.kind == Kind.RESTART:
            kept = []
            restart = end = cut = e.offset
    if restart is not None:
        _wipe(directory)
    try:
        log = PartitionLog.open(
            directory, _REPLAY_CONFIG, start_offset=restart if restart is not None else 0
        )
    except StrataError as exc:
        raise _PartitionUnavailable(str(exc)) from exc
    appended = 0
    try:
        cut = max(cut, log.log_start_offset)
        if log.log_end_offset < cut:
            raise CorruptSegmentError(
                f"log ends at {log.log_end_offset}, below {cut}, which the agent WAL says"
                " was on disk",
                path=str(directory),
            )
        if log.log_end_offset > cut:
            log.truncate_to(cut)
        for e, next_offset in kept:
            if next_offset <= log.log_end_offset:
                continue  # below the log start (retention) or the cut
            try:
                log.append(e.data, leader_epoch=e.epoch, deep_check=False)
            except StrataError as exc:
                raise CorruptSegmentError(
                    f"agent WAL: batch at {e.offset} does not check out ({exc})",
                    path=str(directory),
                ) from exc
            appended += 1
        log.flush()
    finally:
        log.close()
    return appended


def _wipe(directory: Path) -> None:
    for p in directory.iterdir():
        if p.name.endswith((LOG_SUFFIX, INDEX_SUFFIX)):
            with storage_errors(f"cannot delete {p}"):
                fileio.fs.unlink(p)
    fsync_dir(directory)


def _clear(wal_dir: Path) -> None:
    """Everything the WAL held is in the partition logs, fsynced: remove it."""
    try:
        for p in wal_dir.iterdir():
            if parse_name(p.name) is not None or p.name in (CHECKPOINT, CHECKPOINT + ".tmp"):
                fileio.fs.unlink(p)
        fsync_dir(wal_dir)
    except OSError as exc:
        raise StorageError(f"cannot clear the agent WAL in {wal_dir}: {exc}") from exc
