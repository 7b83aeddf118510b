"""The idempotent producer's bookkeeping: a producer id, and per partition an epoch and the
next sequence number.

With ``enable.idempotence`` (the default unless ``acks=0``) every batch carries the producer's
id, the partition's producer epoch and the sequence number of its first record; sequences
count records per partition from 0, modulo 2**31. The leader stores a batch only if it
continues the sequence, and answers a retry of a stored batch with the offsets it got the
first time (``storage.wal.producers``). That gives two things:

* a retry after a lost response or a timeout does not store the records twice;
* several requests may be in flight per partition (up to five batches, the window the agent
  remembers) without reordering: a batch that overtakes a failed one is refused with
  ``OutOfOrderSequenceError`` and resent after it.

A sequence is given to a batch when it is first drained and stays with it across retries.
When a sequenced batch fails for good (a fatal error, or ``delivery.timeout.ms``), its
sequences leave a gap that the leader would refuse for ever; likewise when the leader answers
``OutOfOrderSequenceError`` for the batch right after the last acknowledged one (the leader
lost acknowledged records, possible with ``acks=1`` on a failover). The partition is then
*reset*: once none of its batches is in flight, its epoch goes up by one and its sequences
restart at 0, and the batches already sequenced are restamped in queue order
(``storage.codec.with_producer``). Epochs are per partition because the agents check them per
partition; when one would pass 32767 the partition gets a fresh producer id.

A transactional producer (``sdk.transactions``) gets its id and epoch from its transaction
coordinator instead, one epoch for every partition: ``set_producer`` restarts every
partition's sequences under it (after ``init_transactions`` and after an abort that bumped
the epoch); its partitions never move to an epoch of their own.

Producer ids are random 63-bit numbers drawn by the client, not handed out by the agents:
no round trip and no coordination, and two producers collide with odds of about 2**-63 per
pair. An id is kept only for the producer object's lifetime: like Kafka's idempotent producer
(without transactions), a restarted process is a new producer, and exactly-once holds per
producer session and partition.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from sdk.records import TopicPartition
from storage.codec.header import SEQUENCE_MASK

MAX_EPOCH = 0x7FFF


def new_producer_id() -> int:
    return secrets.randbits(63)


@dataclass(slots=True)
class PartitionSequence:
    producer_id: int
    epoch: int = 0
    next_sequence: int = 0
    #: the sequence after the last acknowledged batch of this epoch
    acknowledged: int = 0


class Sequencer:
    """Producer id, epoch and sequences of every partition (see the module docstring)."""

    def __init__(self, new_id: Callable[[], int] = new_producer_id) -> None:
        self._new_id = new_id
        self.producer_id = new_id()
        self.epoch = 0
        self._partitions: dict[TopicPartition, PartitionSequence] = {}

    def state(self, tp: TopicPartition) -> PartitionSequence:
        st = self._partitions.get(tp)
        if st is None:
            st = self._partitions[tp] = PartitionSequence(self.producer_id, self.epoch)
        return st

    def set_producer(self, producer_id: int, epoch: int) -> None:
        """Every partition starts over at sequence 0 under ``producer_id`` and ``epoch`` (a
        transactional producer's id and epoch, from its coordinator)."""
        self.producer_id, self.epoch = producer_id, epoch
        self._partitions.clear()

    def assign(self, tp: TopicPartition, count: int) -> tuple[int, int, int]:
        """(producer id, epoch, base sequence) for a new batch of ``count`` records."""
        st = self.state(tp)
        seq = st.next_sequence
        st.next_sequence = (seq + count) & SEQUENCE_MASK
        return st.producer_id, st.epoch, seq

    def unassign(self, tp: TopicPartition, sequence: int) -> None:
        """Take back the sequences ``assign`` just gave from ``sequence`` on (the batch could
        not be encoded, so it was never sent)."""
        self.state(tp).next_sequence = sequence

    def acknowledged(self, tp: TopicPartition, epoch: int, sequence: int, count: int) -> None:
        st = self.state(tp)
        if epoch != st.epoch:
            return
        end = (sequence + count) & SEQUENCE_MASK
        if (end - st.acknowledged) & SEQUENCE_MASK <= SEQUENCE_MASK // 2:  # ahead, modulo 2**31
            st.acknowledged = end

    def follows_last_acknowledged(self, tp: TopicPartition, epoch: int, sequence: int) -> bool:
        """Whether a batch is the next one after everything acknowledged: if the leader calls
        it out of order, nothing of ours is missing before it and only a reset helps."""
        st = self.state(tp)
        return epoch == st.epoch and sequence == st.acknowledged

    def new_epoch(self, tp: TopicPartition) -> None:
        """Restart the partition's sequences under the next epoch (a new id past the last)."""
        st = self.state(tp)
        if st.epoch >= MAX_EPOCH:
            st.producer_id, st.epoch = self._new_id(), 0
        else:
            st.epoch += 1
        st.next_sequence = st.acknowledged = 0
