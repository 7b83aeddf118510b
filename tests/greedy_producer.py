"""A producer that sends as fast as it may, as its own process, for the quota tests.

    python -m tests.greedy_producer --bootstrap H:P --user U --password P --topic T
        --seconds S --out FILE [--batch-size B] [--buffer-memory M]

Sends 1,000-byte values for ``--seconds`` seconds (or until SIGTERM), then writes
``{"acks": [[t, n], ...], "throttle_ms": ...}`` to FILE (``t``: ``time.monotonic()`` when an
acknowledgement of ``n`` bytes of values arrived; the clock is the machine's, shared with the
test) and stops without waiting for what is still unacknowledged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import time
from pathlib import Path
from typing import Any

from sdk import Producer
from storage.errors import StrataError

VALUE = b"q" * 1000


async def main(args: argparse.Namespace) -> dict[str, Any]:
    acks: list[tuple[float, int]] = []

    def acked(fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            acks.append((time.monotonic(), len(VALUE)))

    producer = Producer(
        {
            "bootstrap.servers": args.bootstrap,
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": args.user,
            "sasl.password": args.password,
            "acks": 1,
            "batch.size": args.batch_size,
            "buffer.memory": args.buffer_memory,
        }
    )
    await producer.start()
    loop = asyncio.get_running_loop()
    end = time.monotonic() + args.seconds
    stopped = False
    waiting: asyncio.Timeout | None = None

    def stop() -> None:
        nonlocal stopped
        stopped = True
        if waiting is not None:
            waiting.reschedule(loop.time())

    loop.add_signal_handler(signal.SIGTERM, stop)
    while time.monotonic() < end and not stopped:
        try:
            async with asyncio.timeout(max(end - time.monotonic(), 0.001)) as waiting:
                fut = await producer.send(args.topic, VALUE)  # waits while the buffer is full
        except TimeoutError:
            break
        finally:
            waiting = None
        fut.add_done_callback(acked)
    result = {"acks": list(acks), "throttle_ms": producer.metrics()["produce_throttle_time_ms"]}
    with contextlib.suppress(StrataError):
        await producer.close(flush_timeout=0)
    return result


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--user", required=True)
    p.add_argument("--password", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=64 * 1024)
    p.add_argument("--buffer-memory", type=int, default=1 << 20)
    return p.parse_args()


if __name__ == "__main__":
    args = parse()
    Path(args.out).write_text(json.dumps(asyncio.run(main(args))))
