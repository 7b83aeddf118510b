"""The local write-ahead log: segments, indexes, recovery, group commit.

See ``log`` for the theory of operation and ``segment`` / ``index`` for the files.
"""

from storage.wal import fileio
from storage.wal.group_commit import GroupCommitLog
from storage.wal.log import AppendInfo, FlushJob, LogSlice, PartitionLog

__all__ = ["AppendInfo", "FlushJob", "GroupCommitLog", "LogSlice", "PartitionLog", "fileio"]
