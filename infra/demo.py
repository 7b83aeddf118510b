"""``make demo``: the whole system on one machine, every step checked.

1. the storage engine alone (``infra.demo_storage``: WAL write, reopen, read back as Arrow);
2. the local stack (moto S3, ZooKeeper, 3 agents, admin API, delay scheduler) started in
   ``var/demo/stack``, secured (``strata local up --secure``: TLS, SCRAM logins, ACLs); every
   client below logs in as the stack's admin;
3. a topic created through the admin API; 100,000 keyed messages produced (progress bar);
4. all of them consumed by a consumer group, which commits, and checked byte for byte;
5. a wait until every segment is tiered to S3 (each partition's manifest reaches its end);
6. a Spark aggregation over the archive: records per partition, read by ``format("strata")``
   straight from the bucket (no agent in the path), must equal the partitions' log ends;
7. a range replayed from the archive into a new topic, and checked;
8. 1,000 delayed records scheduled 3 s ahead (``infra.demo_delays``): none readable early, each
   delivered once by the delay scheduler that the stack runs;
9. retries (``infra.demo_retries``): a consumer failing some records, the retry router
   bringing them back after the policy's backoff, the dead-letter topic, and a redrive;
then a summary table, and the stack stopped. Exits 0 only if every step that ran checked out.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from infra import demo_delays, demo_retries, demo_storage, local
from infra.cli import replay_range
from sdk import Consumer, Producer
from sdk.admin import SyncAdmin
from sdk.config import CLIENT_SECURITY_ENV, client_config
from storage.metadata import AsyncZooKeeper
from storage.tier import Manifest

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "demo-orders"
REPLAY_TOPIC = "demo-replay"
GROUP = "demo-readers"
PARTITIONS = 6
BATCH = 1000

console = Console()


@dataclass
class Step:
    name: str
    ok: bool | None  # None: pending
    seconds: float
    detail: str


def _value(i: int) -> bytes:
    return b'{"order":%d,"customer":"c-%d","amount":%d}' % (i, i % 997, (i * 37) % 10_000)


async def produce(bootstrap: str, n: int) -> tuple[int, bytes]:
    digest = 0
    acked = 0
    with Progress(
        TextColumn("  produce"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console,
    ) as bar:  # fmt: skip
        task = bar.add_task("produce", total=n)
        async with Producer(client_config(bootstrap, {"acks": "all", "linger.ms": 5})) as producer:
            futures = []
            for start in range(0, n, BATCH):
                values = [_value(i) for i in range(start, min(n, start + BATCH))]
                keys = [b"c-%d" % (i % 997) for i in range(start, start + len(values))]
                fut = await producer.send_batch(TOPIC, values, keys=keys)

                def done(f: asyncio.Future[Any], k: int = len(values)) -> None:
                    if not f.cancelled() and f.exception() is None:
                        bar.advance(task, k)

                fut.add_done_callback(done)
                futures.append(fut)
            for result in await asyncio.gather(*futures):
                acked += sum(r.record_count for r in result)
    for i in range(n):
        digest ^= int.from_bytes(hashlib.blake2b(_value(i), digest_size=8).digest())
    return acked, digest.to_bytes(8)


async def consume(bootstrap: str, n: int, limit_s: float) -> tuple[int, bytes]:
    digest = 0
    count = 0
    config = client_config(
        bootstrap, {"group.id": GROUP, "auto.offset.reset": "earliest", "enable.auto.commit": False}
    )
    deadline = time.monotonic() + limit_s
    async with Consumer(config) as consumer:
        consumer.subscribe([TOPIC])
        while count < n and time.monotonic() < deadline:
            got = await consumer.getmany(timeout_ms=500)
            for records in got.values():
                for r in records:
                    digest ^= int.from_bytes(
                        hashlib.blake2b(r.value or b"", digest_size=8).digest()
                    )
                    count += 1
            if got:
                await consumer.commit()
        await consumer.commit()
    return count, digest.to_bytes(8)


async def tiered(zookeeper: str, ends: dict[int, int], limit_s: float) -> dict[int, int]:
    """Wait until every partition's manifest reaches its end offset; return manifest ends."""
    zk = AsyncZooKeeper(zookeeper, session_timeout=10.0, request_timeout=5.0)
    await zk.start()
    try:
        deadline = time.monotonic() + limit_s
        while True:
            got = {}
            for p in ends:
                try:
                    data, _ = await zk.get(f"/topics/{TOPIC}/partitions/{p}/segments")
                    got[p] = Manifest.decode(data).end
                except Exception:
                    got[p] = 0
            if all(got[p] >= ends[p] for p in ends) or time.monotonic() > deadline:
                return got
            await asyncio.sleep(0.5)
    finally:
        await zk.stop()


def _timed(name: str, steps: list[Step], fn: Callable[[], tuple[bool | None, str]]) -> bool:
    console.print(f"[bold]» {name}[/]")
    t = time.perf_counter()
    try:
        ok, detail = fn()
    except Exception as exc:
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    steps.append(Step(name, ok, time.perf_counter() - t, detail))
    mark = {True: "[green]ok[/]", False: "[red]FAIL[/]", None: "[yellow]pending[/]"}[ok]
    console.print(f"  {mark} {detail}")
    return ok is not False


def spark_counts_per_partition(endpoint: str, bucket: str, zookeeper: str) -> dict[int, int]:
    """Count the archive's records per partition with Spark (``spark.source``, ``local[2]``)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from spark.source import register

    session = (
        SparkSession.builder.master("local[2]")
        .appName("strata-demo")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        register(session)
        df = (
            session.read.format("strata")
            .option("topic", TOPIC)
            .option("bucket", bucket)
            .option("endpoint", endpoint)
            .option("region", "us-east-1")
            .option("accessKey", "local")
            .option("secretKey", "local")
            .option("manifest", "zookeeper")
            .option("zookeeper", zookeeper)
            .load()
        )
        rows = df.groupBy("partition").count().collect()
        return {int(r["partition"]): int(r["count"]) for r in rows}
    finally:
        session.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--storage-messages", type=int, default=100_000)
    parser.add_argument("--dir", type=Path, default=ROOT / "var" / "demo")
    args = parser.parse_args(argv)
    n = args.messages
    steps: list[Step] = []

    def storage() -> tuple[bool, str]:
        rc = demo_storage.main(
            ["--messages", str(args.storage_messages), "--dir", str(args.dir / "wal" / "orders-0")]
        )
        return rc == 0, f"{args.storage_messages:,} messages through the WAL and back"

    if not _timed("storage engine", steps, storage):
        return _summary(steps)

    stack = local.Stack(local.StackConfig(state_dir=args.dir / "stack", agents=3, secure=True))
    state_box: list[local.StackState] = []

    def up() -> tuple[bool, str]:
        local.down(args.dir / "stack")
        shutil.rmtree(args.dir / "stack", ignore_errors=True)
        state = stack.start()
        state_box.append(state)
        # every client from here on (this process's, the retry router's, Spark's workers')
        # logs in as the stack's admin: sdk.config.client_config reads these
        for key, value in state.client.items():
            os.environ[CLIENT_SECURITY_ENV[key]] = value
        return True, (
            f"healthy in {state.healthy_after_s} s: agents {state.bootstrap} "
            "(TLS + SCRAM + ACLs, logged in as admin)"
        )

    try:
        if not _timed("start the local stack", steps, up):
            return _summary(steps)
        state = state_box[0]
        admin = SyncAdmin(state.admin_url, config=state.client)
        configs = {"segment.bytes": 1 << 20, "segment.ms": 2000}

        def create() -> tuple[bool, str]:
            d = admin.create_topic(TOPIC, PARTITIONS, 3, configs)
            return d.partitions == PARTITIONS, f"{TOPIC}: {PARTITIONS} partitions, RF 3"

        sent: list[bytes] = []

        def do_produce() -> tuple[bool, str]:
            t = time.perf_counter()
            acked, digest = asyncio.run(produce(state.bootstrap, n))
            sent.append(digest)
            rate = acked / (time.perf_counter() - t)
            return acked == n, f"{acked:,} acknowledged (acks=all), {rate:,.0f} msgs/s"

        def do_consume() -> tuple[bool, str]:
            count, digest = asyncio.run(consume(state.bootstrap, n, 120))
            same = bool(sent) and digest == sent[0]
            return (
                count == n and same,
                f"{count:,} consumed by group {GROUP}, contents match: {same}",
            )

        ends: dict[int, int] = {}

        def do_tier() -> tuple[bool, str]:
            async def end_offsets() -> dict[int, int]:
                async with Consumer(client_config(state.bootstrap)) as c:
                    tps = [(TOPIC, p) for p in range(PARTITIONS)]
                    got = await c.end_offsets(tps)
                    return {tp.partition: o for tp, o in got.items()}

            ends.update(asyncio.run(end_offsets()))
            got = asyncio.run(tiered(state.zookeeper_connect, ends, 90))
            objects = local.s3_client(state.s3_endpoint).list_objects_v2(Bucket=state.bucket)
            keys = objects.get("KeyCount", 0)
            done = sum(got.values())
            return done >= n, f"{done:,} of {n:,} offsets in committed S3 segments ({keys} objects)"

        def do_spark() -> tuple[bool | None, str]:
            if importlib.util.find_spec("spark.source") is None:
                return None, "pending: spark/ has no reader"
            counts = spark_counts_per_partition(
                state.s3_endpoint, state.bucket, state.zookeeper_connect
            )
            want = {p: e for p, e in ends.items() if e}
            return counts == want, (
                f"Spark (local[2]) read {sum(counts.values()):,} records straight from S3,"
                f" per partition {counts}: {'equal to' if counts == want else 'NOT'} the log ends"
            )

        def do_replay() -> tuple[bool, str]:
            admin.create_topic(REPLAY_TOPIC, PARTITIONS, 3)
            copied = asyncio.run(
                replay_range(
                    state.bootstrap, TOPIC, REPLAY_TOPIC, list(range(PARTITIONS)), 0, 1000,
                    lambda _: None,
                )
            )  # fmt: skip
            expected = sum(min(1000, e) for e in ends.values())
            return copied == expected, f"offsets [0, 1000) of each partition: {copied:,} copied"

        def do_delays() -> tuple[bool, str]:
            admin.create_topic(demo_delays.TOPIC, demo_delays.PARTITIONS, 3)
            try:
                return True, demo_delays.run(state.bootstrap)
            except AssertionError as exc:
                return False, str(exc)

        def do_retries() -> tuple[bool, str]:
            admin.create_topic(demo_retries.TOPIC, demo_retries.PARTITIONS, 3)
            try:
                return True, demo_retries.run(
                    state.bootstrap, state.admin_url, state.zookeeper_connect, args.dir
                )
            except AssertionError as exc:
                return False, str(exc)

        for name, fn in (
            ("create a topic", create),
            ("produce", do_produce),
            ("consume with a group", do_consume),
            ("tier segments to S3", do_tier),
            ("Spark aggregation over the archive", do_spark),
            ("replay a range into a new topic", do_replay),
            ("delayed messages", do_delays),
            ("retries, dead letters, redrive", do_retries),
        ):
            if not _timed(name, steps, fn):
                break
    finally:
        console.print("[bold]» stop the local stack[/]")
        stack.stop()
    return _summary(steps)


def _summary(steps: list[Step]) -> int:
    table = Table("step", "result", "time", "detail", title="Strata demo")
    for s in steps:
        mark = {True: "[green]ok[/]", False: "[red]FAIL[/]", None: "[yellow]pending[/]"}[s.ok]
        table.add_row(s.name, mark, f"{s.seconds:.1f} s", s.detail)
    console.print(table)
    failed = [s for s in steps if s.ok is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
