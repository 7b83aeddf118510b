"""At-least-once: produce with acks=all and retries, commit *after* processing, and commit
what was processed before a partition moves (a rebalance listener).

    python -m sdk.examples.at_least_once 127.0.0.1:9092 orders billing

A crash after processing and before the commit redelivers exactly the uncommitted tail to
whoever gets the partition next; nothing is skipped.
"""

from __future__ import annotations

import asyncio
import sys

from sdk import Consumer, Producer, TopicPartition


async def main(bootstrap: str, topic: str, group: str) -> None:
    async with Producer({"bootstrap.servers": bootstrap, "acks": "all", "retries": 10}) as p:
        await p.send_batch(topic, [b"order-%d" % i for i in range(100)])
        await p.flush()
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",
        }
    )
    processed: dict[TopicPartition, int] = {}

    class CommitBeforeLosing:
        async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
            done = {tp: o for tp, o in processed.items() if tp in revoked}
            await consumer.commit(done)

        def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
            print("now reading", sorted(assigned))

    async with consumer:
        consumer.subscribe([topic], listener=CommitBeforeLosing())
        for _ in range(20):
            batch = await consumer.getmany(timeout_ms=500)
            for tp, records in batch.items():
                for record in records:
                    print("processing", record.partition, record.offset, record.value)
                processed[tp] = records[-1].offset + 1  # a committed offset is the next to read
            if batch:
                await consumer.commit({tp: processed[tp] for tp in batch})


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
