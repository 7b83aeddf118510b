"""The note of a clean shutdown: a graceful restart is the same incarnation.

An agent's incarnation (``AgentRegistration.incarnation``) tells the controller whether the
process named in an ISR is the one that received the records. A new process may have lost
what its predecessor had not fsynced (#19), so the controller fences it: every partition it
led is elected again at a new epoch, and it leaves every ISR until it has caught up.

After a graceful stop nothing was lost: every partition log was flushed and closed, and the
agent WAL checkpointed and closed. The stop then writes this note, last, fsynced and renamed
into place. The next start takes it (reads it and removes it durably, before the agent
registers) and registers under the same incarnation, so the states in ZooKeeper still name
it in sync: it leads its partitions again as soon as their logs are open, without the
controller writing thousands of new states (Kafka skips log recovery on the same kind of
note, ``.kafka_cleanshutdown``). A crash, a disk error or a failed close leaves no note, and
the next process is a new incarnation, fenced as before.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from storage.wal import fileio
from storage.wal.fileio import write_file_atomically

log = logging.getLogger(__name__)

NOTE = "clean_shutdown"


def record(data_dir: Path, agent_id: int, incarnation: str) -> None:
    """After a graceful stop in which everything was flushed and closed without error."""
    body = json.dumps({"agent_id": agent_id, "incarnation": incarnation}).encode()
    write_file_atomically(data_dir / NOTE, body)
    fileio.fs.fsync_dir(data_dir)


def take(data_dir: Path, agent_id: int) -> str | None:
    """The incarnation a clean shutdown of ``agent_id`` left in ``data_dir`` (None: none, or
    one that does not parse or is another agent's). The note is removed, durably, either way:
    it speaks for one restart only."""
    path = data_dir / NOTE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        note = json.loads(text)
        incarnation = note["incarnation"] if note["agent_id"] == agent_id else None
        if incarnation is not None and not isinstance(incarnation, str):
            incarnation = None
    except (ValueError, TypeError, KeyError):
        log.warning("%s does not parse; starting as a new incarnation", path)
        incarnation = None
    fileio.fs.unlink(path, missing_ok=True)
    fileio.fs.fsync_dir(data_dir)
    return incarnation
