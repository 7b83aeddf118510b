"""A restart's warm start: every local log of a live topic opened at once, before the agent
takes part in the cluster.

Why: an agent that hosts thousands of partitions opened each log when its state arrived,
on a pool of threads, while the event loop was busy reading and applying those states. Each
file-system call on a worker thread then waited for the interpreter lock that the loop held
(a convoy: up to the switch interval per call), so 10,000 opens took 10 s, not the 1 s they
take on one thread with the loop idle. Here they run on one thread while the loop waits for
them, before ZooKeeper watches deliver anything, and ``PartitionManager`` takes a log from
:class:`Preopened` when its state says to host it.

What is opened: the directory ``<topic>-<p>`` of every topic that exists and is not being
deleted, for ``p`` below its partition count, whose ``partition.metadata`` names the topic's
current id; with the topic's current configuration. Anything else (strays, directories
without the file, partitions whose open fails) is left to the ordinary path, which removes,
creates or reports it as before. A log that no state claims (the partition moved away while
the agent was down) is closed when :meth:`Preopened.release` runs, ``KEEP_S`` after start.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from storage.config import LogConfig
from storage.errors import StorageError
from storage.metadata import TopicConfig, TopicSpec
from storage.wal import PartitionLog
from storage.wal.partition_meta import read_topic_id

log = logging.getLogger(__name__)

KEEP_S = 60.0
"""How long logs opened at start wait for their state; unclaimed ones are closed then."""


@dataclass(frozen=True, slots=True)
class WarmLog:
    log: PartitionLog
    topic_id: str


class Preopened:
    """Logs opened at start, each handed out once (``take``) or closed (``release``)."""

    def __init__(self) -> None:
        self._logs: dict[tuple[str, int], WarmLog] = {}
        #: the configuration each topic's logs were opened with
        self._configs: dict[str, TopicConfig] = {}
        #: directories whose ``partition.metadata`` named their topic's id at start: not
        #: strays (``PartitionManager.sweep_stray`` need not read them again)
        self.verified: set[Path] = set()

    def __len__(self) -> int:
        return len(self._logs)

    def open_all(self, data_dir: Path, specs: list[TopicSpec], *, flushed: bool) -> float:
        """Open the live topics' local logs (on the calling thread: run it on a worker while
        the event loop waits). Returns the seconds it took."""
        started = time.monotonic()
        live = {s.name: s for s in specs if s.deletion is None and s.topic_id}
        log_configs = {name: s.config.log_config() for name, s in live.items()}
        names = [p.name for p in data_dir.iterdir()] if data_dir.is_dir() else []
        # thousands of long-lived objects at once: the cyclic collector would walk the growing
        # heap again and again meanwhile (a fifth of the time); it runs once afterwards.
        # Process-wide: safe because the event loop only awaits this call meanwhile
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._open(data_dir, names, live, log_configs, flushed)
        finally:
            if collecting:
                gc.enable()
        return time.monotonic() - started

    def _open(
        self,
        data_dir: Path,
        names: list[str],
        live: dict[str, TopicSpec],
        log_configs: dict[str, LogConfig],
        flushed: bool,
    ) -> None:
        for name in names:
            topic, sep, index = name.rpartition("-")
            spec = live.get(topic)
            if not sep or spec is None or not index.isdigit() or int(index) >= spec.partitions:
                continue
            directory = data_dir / name
            try:
                if read_topic_id(directory) != spec.topic_id:
                    continue
                self.verified.add(directory)
                plog = PartitionLog.open(directory, log_configs[topic], flushed=flushed)
            except (StorageError, OSError) as exc:
                log.debug("%s: not opened ahead (%s); opened when its state arrives", name, exc)
                continue
            self._logs[(topic, int(index))] = WarmLog(plog, spec.topic_id)
            self._configs[topic] = spec.config

    def take(self, key: tuple[str, int], config: TopicConfig, topic_id: str) -> PartitionLog | None:
        """The log opened ahead for ``key`` if it was opened for this incarnation and
        configuration (else it is closed, and the caller opens the partition itself)."""
        warm = self._logs.pop(key, None)
        if warm is None:
            return None
        if warm.topic_id == topic_id and self._same_config(key[0], config):
            return warm.log
        warm.log.close()
        return None

    def _same_config(self, topic: str, config: TopicConfig) -> bool:
        """Whether ``topic``'s logs were opened with ``config``: compared once per topic
        (a model's ``==`` costs 50 us, half a second over 10,000 partitions), then by
        identity with the caller's object, which the partitions of a topic share."""
        mine = self._configs.get(topic)
        if mine is config:
            return True
        if mine != config:
            return False
        self._configs[topic] = config
        return True

    def discard_topic(self, topic: str) -> None:
        """Close the logs of ``topic`` (it is being deleted here)."""
        for key in [k for k in self._logs if k[0] == topic]:
            self._logs.pop(key).log.close()

    def detach(self) -> list[PartitionLog]:
        """Forget every log not taken and return them, for ``close_all`` (call it on the
        thread that calls ``take``, so that a log is either taken or detached, never both)."""
        logs, self._logs = self._logs, {}
        return [warm.log for warm in logs.values()]

    def release(self) -> int:
        """Close every log not taken; returns how many."""
        return close_all(self.detach())


def close_all(logs: list[PartitionLog]) -> int:
    """Close ``logs`` (on a worker thread: each close flushes); returns how many."""
    for plog in logs:
        try:
            plog.close()
        except StorageError as exc:
            log.warning("closing %s: %s", plog.directory, exc)
    return len(logs)
