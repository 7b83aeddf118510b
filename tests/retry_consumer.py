"""A consumer with retries as its own process, for the kill -9 test of ``test_retries``.

    python -m tests.retry_consumer --bootstrap H:P --group G --topic T --log FILE

It fails the records the test's plan says (``tests.test_retries.failure_plan``: ~10% on their
first two attempts, 1% always) with ``retry_later``, and logs every success as one line
``ok <record number>`` to FILE (O_APPEND, one write each: a kill -9 loses nothing written).
It commits after every batch (never past a failure record not yet stored).

With ``--poison 37,201`` it injects no failures; instead the process kills itself (SIGKILL,
nothing cleaned up) when it is handed one of those records, from any topic: a record that
crashes its consumer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import zlib

from sdk import Consumer
from sdk.retry import retry_info


def fails(i: int, attempt: int) -> bool:
    h = zlib.crc32(str(i).encode()) % 1000
    return h < 10 or (h < 110 and attempt <= 2)


async def main(args: argparse.Namespace) -> None:
    fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    poison = {int(v) for v in args.poison.split(",")} if args.poison else set()
    consumer = Consumer(
        {
            "bootstrap.servers": args.bootstrap,
            "group.id": args.group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "session.timeout.ms": 3000,
            "heartbeat.interval.ms": 300,
            "fetch.max.wait.ms": 50,
            "retry.enable": True,
        }
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with consumer:
        consumer.subscribe([args.topic])
        while not stop.is_set():
            got = await consumer.getmany(timeout_ms=200)
            lines = []
            for records in got.values():
                for record in records:
                    i = int(record.value or b"-1")
                    attempt = retry_info(record).attempt
                    if i in poison:
                        os.kill(os.getpid(), signal.SIGKILL)
                    if not poison and fails(i, attempt):
                        await consumer.retry_later(record, reason=f"injected failure {attempt}")
                    else:
                        lines.append(f"ok {i}\n")
            if lines:
                os.write(fd, "".join(lines).encode())
            if got:
                await consumer.commit()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for name in ("--bootstrap", "--group", "--topic", "--log"):
        p.add_argument(name, required=True)
    p.add_argument("--poison", default="")
    asyncio.run(main(p.parse_args()))
