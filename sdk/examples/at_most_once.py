"""At-most-once: produce with acks=0, commit *before* processing.

    python -m sdk.examples.at_most_once 127.0.0.1:9092 orders billing

A crash after the commit and before the processing loses those records (they are never
delivered again); nothing is ever processed twice.
"""

from __future__ import annotations

import asyncio
import sys

from sdk import Consumer, Producer


async def main(bootstrap: str, topic: str, group: str) -> None:
    async with Producer({"bootstrap.servers": bootstrap, "acks": 0}) as producer:
        await producer.send_batch(topic, [b"order-%d" % i for i in range(100)])
        await producer.flush()
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    async with consumer:
        consumer.subscribe([topic])
        for _ in range(20):
            batch = await consumer.getmany(timeout_ms=500)
            if not batch:
                continue
            await consumer.commit()  # the positions: one past what getmany returned
            for records in batch.values():
                for record in records:
                    print("processing", record.partition, record.offset, record.value)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
