"""Hanging transactions: a partition's open transaction that no coordinator will ever end.

A transaction is open on a partition from its producer's first transactional batch there
until a marker ends it, and while it is open the partition's last stable offset stays
behind it: ``read_committed`` consumers stop there, and the uploader tiers nothing past it
(``storage/wal/txn.py``). Normally the coordinator ends every transaction it knows, aborting
it at the latest after its ``transaction.timeout.ms`` (at most ``transaction.max.timeout.ms``).
But a transactional batch the coordinator does not know of is never ended: a produce request
that reaches the leader after its transaction was aborted (a Kafka client keeps its epoch
across an abort, so the late batch opens a new transaction under it; Kafka's KIP-890 problem),
or a client that writes transactional batches without ``AddPartitionsToTxn``. Left alone,
such a *hanging* transaction blocks the partition's committed readers and its tiering for
good.

The sweeper (one per agent, over the partitions it leads) aborts them, as Kafka's
``kafka-transactions.sh --find-hanging`` / ``abort`` do by hand (KIP-664), but checked
against the coordinators' state first:

1. Every ``transaction.orphan.check.interval.ms`` it notes each open transaction (producer
   id, first offset) of the partitions led here, with when it first saw it.
2. One seen open for longer than ``transaction.max.timeout.ms`` plus one interval is a
   candidate: its coordinator, had it known of it, would have ended it by then (a leader
   change resets the clock: the new leader starts counting when it first sees it).
3. The candidates' producer ids are looked up in ``/transactions`` (one read of every
   record, only when there are candidates). A candidate is left alone if a record of its
   producer id has an ongoing or deciding transaction (``ongoing``, ``prepare_*``) that
   names this partition: that coordinator will end it (its timeout, or markers on their
   way after a failover).
4. Otherwise the leader appends an abort marker for it, unless the producer has written to
   the partition since step 3 began (then it is alive: the next round looks again). The
   check and the append happen in one step of the event loop, and a producer adds a
   partition to a transaction in ZooKeeper before it writes there, so a transaction that a
   coordinator learns of after the read cannot be cut by the marker. The marker's token is
   the producer's record version (or the last token applied here, if larger): a decision the
   coordinator writes later has a newer one and still applies.

Each abort is logged with the partition, producer id, epoch and first offset, and counted
(``orphans_aborted``, exported as ``strata_transactions_hanging_aborted_total``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from storage.codec.header import read_header
from storage.errors import StrataError
from storage.metadata.transactions import TxnRecord

if TYPE_CHECKING:
    from broker_agents.partitions import Partition

log = logging.getLogger(__name__)

#: phases in which a coordinator will still end the transaction on its partitions
_COORDINATED = frozenset({"ongoing", "prepare_commit", "prepare_abort"})


class TxnRecords(Protocol):
    async def records(self) -> list[tuple[str, TxnRecord, int]]: ...


class OrphanAborter(Protocol):
    def abort_orphan(self, p: Partition, producer_id: int, epoch: int, token: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Candidate:
    partition: Partition
    producer_id: int
    first_offset: int


class OrphanSweeper:
    """Aborts hanging transactions on the partitions this agent leads (module docstring)."""

    def __init__(
        self,
        leaders: Callable[[], Iterable[Partition]],
        records: TxnRecords,
        aborter: OrphanAborter,
        *,
        max_timeout_ms: int,
        interval_ms: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.leaders = leaders
        self.records = records
        self.aborter = aborter
        self.interval = interval_ms / 1000
        self.threshold = (max_timeout_ms + interval_ms) / 1000
        self.clock = clock
        #: (topic, partition, producer id, first offset) -> when first seen open
        self._seen: dict[tuple[str, int, int, int], float] = {}
        self.orphans_aborted = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sweep()
            except StrataError as exc:  # ZooKeeper away: the next round tries again
                log.warning("hanging-transaction sweep failed: %s", exc)
            except Exception:  # a bug here must not stop the agent: logged, tried again
                log.exception("hanging-transaction sweep failed")

    def candidates(self) -> list[Candidate]:
        """Note the open transactions led here; those open past the threshold."""
        now = self.clock()
        seen: dict[tuple[str, int, int, int], float] = {}
        out = []
        for p in self.leaders():
            for pid, first in p.log.transactions.ongoing.items():
                key = (p.topic, p.index, pid, first)
                since = seen[key] = self._seen.get(key, now)
                if now - since >= self.threshold:
                    out.append(Candidate(p, pid, first))
        self._seen = seen
        return out

    async def sweep(self) -> int:
        """One round; returns how many transactions it aborted."""
        found = self.candidates()
        if not found:
            return 0
        before = {id(c): _last_write(c) for c in found}
        by_pid: dict[int, tuple[TxnRecord, int]] = {}
        for _, record, version in await self.records.records():
            if record.producer_id not in by_pid or version > by_pid[record.producer_id][1]:
                by_pid[record.producer_id] = (record, version)
        aborted = 0
        for c in found:
            p = c.partition
            known = by_pid.get(c.producer_id)
            if known is not None and _coordinated(known[0], p.topic, p.index):
                continue
            # no await from here to the append: nothing can be written in between
            if p.role != "leader" or p.log.transactions.ongoing.get(c.producer_id) != (
                c.first_offset
            ):
                continue  # ended meanwhile, or no longer ours
            if _last_write(c) != before[id(c)]:
                continue  # the producer wrote since: alive, look again next round
            epoch = _epoch_of(p, c)
            token = max(known[1] if known else 0, p.log.transactions.tokens.get(c.producer_id, 0))
            log.warning(
                "aborting a hanging transaction on %s-%d: producer %d epoch %d, open since"
                " offset %d, no coordinator ends it",
                p.topic,
                p.index,
                c.producer_id,
                epoch,
                c.first_offset,
            )
            self.aborter.abort_orphan(p, c.producer_id, epoch, token)
            self._seen.pop((p.topic, p.index, c.producer_id, c.first_offset), None)
            aborted += 1
        self.orphans_aborted += aborted
        return aborted


def _coordinated(record: TxnRecord, topic: str, index: int) -> bool:
    return record.phase in _COORDINATED and index in record.partitions.get(topic, ())


def _last_write(c: Candidate) -> int:
    """The last offset the candidate's producer wrote on its partition (-1: none known)."""
    last = c.partition.log.producers.last_offset(c.producer_id)
    return -1 if last is None else last


def _epoch_of(p: Partition, c: Candidate) -> int:
    """The open transaction's epoch: the producer's latest here, else its first batch's."""
    epoch = p.log.producers.epoch_of(c.producer_id)
    if epoch is not None:
        return epoch
    chunk = p.log.read(c.first_offset, 1)
    return read_header(chunk.data).producer_epoch
