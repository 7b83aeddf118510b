"""A transactional producer as its own process, for the fencing and timeout tests.

    python -m tests.txn_client --bootstrap H:P --txn-id T --topic t --partition P --log FILE
        [--records N] [--timeout-ms MS] [--then hang|resume]

It initializes, begins a transaction, sends ``N`` records (values ``<txn-id>-<i>``) and waits
until they are acknowledged, then logs one JSON line per event to FILE (O_APPEND, one write
per line)::

    {"ev": "sent", "offsets": [...], "epoch": 0}

``--then hang`` leaves the transaction open for ever (the test kills the process).
``--then resume`` waits for SIGUSR1 (the test sends it after SIGSTOP/SIGCONT), then tries to
send one more record and to commit, logging what each did::

    {"ev": "send", "error": "InvalidProducerEpochError", "message": "..."}   (or "error": null)
    {"ev": "commit", "error": "InvalidProducerEpochError", "message": "..."}
    {"ev": "abort", "error": "ProducerFencedError", "message": "..."}      (after a failed commit)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from typing import Any

from sdk import Producer
from storage.errors import StrataError


class Log:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, ev: str, **fields: Any) -> None:
        os.write(self.fd, (json.dumps({"ev": ev, "t": time.time(), **fields}) + "\n").encode())


def _outcome(exc: BaseException | None) -> dict[str, Any]:
    if exc is None:
        return {"error": None, "message": ""}
    return {"error": type(exc).__name__, "message": str(exc)}


async def main(args: argparse.Namespace) -> None:
    log = Log(args.log)
    producer = Producer(
        {
            "bootstrap.servers": args.bootstrap,
            "transactional.id": args.txn_id,
            "transaction.timeout.ms": args.timeout_ms,
            "linger.ms": 0,
            "retry.backoff.ms": 50,
            "delivery.timeout.ms": 40_000,
            "request.timeout.ms": 10_000,
            "max.block.ms": 20_000,
        }
    )
    resume = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, resume.set)
    await producer.start()
    await producer.init_transactions()
    producer.begin_transaction()
    futures = [
        await producer.send(args.topic, f"{args.txn_id}-{i}".encode(), partition=args.partition)
        for i in range(args.records)
    ]
    offsets = [(await f).offset for f in futures]
    log("sent", offsets=offsets, epoch=producer.metrics()["producer_epoch"])
    if args.then == "hang":
        await asyncio.Event().wait()
    await resume.wait()
    error: BaseException | None = None
    try:
        fut = await producer.send(
            args.topic, f"{args.txn_id}-late".encode(), partition=args.partition
        )
        await fut
    except StrataError as exc:
        error = exc
    log("send", **_outcome(error))
    error = None
    try:
        await producer.commit_transaction()
    except StrataError as exc:
        error = exc
    log("commit", **_outcome(error))
    if error is not None:
        error = None
        try:
            await producer.abort_transaction()
        except StrataError as exc:
            error = exc
        log("abort", **_outcome(error))
    await producer.close(flush_timeout=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--txn-id", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--partition", type=int, default=0)
    parser.add_argument("--log", required=True)
    parser.add_argument("--records", type=int, default=5)
    parser.add_argument("--timeout-ms", type=int, default=60_000)
    parser.add_argument("--then", choices=("hang", "resume"), default="resume")
    asyncio.run(main(parser.parse_args()))
