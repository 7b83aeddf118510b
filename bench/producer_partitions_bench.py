"""The producer's cost per record as partitions grow (issue #30, producer side).

Run with ``python -m bench.producer_partitions_bench``. Starts a real ZooKeeper and one agent,
creates one topic per partition count (``fsync.policy`` from ``--fsync``), then runs the
producer in a child process for each count in turn, ``--rounds`` times alternated (16, 1024,
16, 1024, ...): ``send_batch`` of ``--chunk`` keyed records (random 16-byte keys, as in
"events keyed by customer id") of ``--size`` bytes each, for ``--seconds``. Each run reports
the producer process's CPU seconds per 1,000 records (``time.process_time``, from the first
timed ``send_batch`` to the end of ``flush``) and msgs/s; the table gives the median and range
of the rounds.

``--sdk-root DIR`` runs the producer from another checkout (its ``sdk`` package), so that
two versions can be measured alternately on the same stack: ``--sdk-root /path/to/main
--sdk-root .`` runs both, in turn, in every round. ``--profile DIR`` records each child under
``py-spy`` (raw collapsed stacks in ``DIR``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import create_topic, settle_writeback
from infra.agents import start_agent
from infra.zookeeper import start_zookeeper
from sdk.cluster import Cluster
from sdk.config import ClientConfig

ROOT = Path(__file__).resolve().parent.parent
PYSPY = str(Path(sys.executable).parent / "py-spy")

#: the producer, run in a child so that its CPU time is its own (argv: bootstrap, topic,
#: seconds, size, chunk)
CHILD = """
import asyncio, json, os, sys, time
from sdk import Producer

boot, topic = sys.argv[1], sys.argv[2]
seconds, size, chunk = float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

async def main():
    values = [os.urandom(size)] * chunk
    keysets = [[os.urandom(16) for _ in range(chunk)] for _ in range(64)]
    config = {
        "bootstrap.servers": boot, "acks": 1, "linger.ms": 5, "batch.size": 1 << 20,
        "max.request.size": 4 << 20, "buffer.memory": 256 << 20,
        "max.in.flight.requests.per.connection": 5,
    }
    async with Producer(config) as producer:
        await producer.partitions_for(topic)
        await (await producer.send_batch(topic, values, keys=keysets[0]))  # warm up
        cpu, start = time.process_time(), time.perf_counter()
        futures, i = [], 0
        while time.perf_counter() - start < seconds:
            futures.append(await producer.send_batch(topic, values, keys=keysets[i % 64]))
            i += 1
        await producer.flush()
        cpu, elapsed = time.process_time() - cpu, time.perf_counter() - start
        stored = sum(r.record_count for f in futures for r in f.result())  # not timed
    print(json.dumps({"records": stored, "seconds": elapsed, "cpu": cpu}))

asyncio.run(main())
"""


async def wait_for_leaders(bootstrap: str, topic: str, partitions: int, limit: float) -> None:
    """Until the metadata names a leader for every partition: a new topic's leaders are
    elected over seconds, and a producer that meets partitions without one refreshes its
    metadata again and again (that would be measured too)."""
    cluster = Cluster(ClientConfig.parse({"bootstrap.servers": bootstrap}))
    cluster.add_topics([topic])
    deadline = time.monotonic() + limit
    try:
        while True:
            await cluster.refresh()
            parts = cluster.partitions(topic) or {}
            if len(cluster.available_partitions(topic)) == partitions and not any(
                i.error_code for i in parts.values()
            ):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: partitions without a leader after {limit} s")
            await asyncio.sleep(0.2)
    finally:
        await cluster.close()


def run_child(
    sdk_root: Path, bootstrap: str, topic: str, args: argparse.Namespace, profile: Path | None
) -> dict[str, float]:
    cmd = [sys.executable, "-c", CHILD, bootstrap, topic, str(args.seconds), str(args.size)]
    cmd.append(str(args.chunk))
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        out = profile / f"producer-{topic}-{sdk_root.name}.txt"
        cmd = [PYSPY, "record", "-r", "200", "--format", "raw", "-o", str(out), "--", *cmd]
    env = {**os.environ, "PYTHONPATH": str(sdk_root)}
    done = subprocess.run(
        cmd, env=env, cwd=sdk_root, capture_output=True, text=True, timeout=args.seconds + 120
    )
    if done.returncode:
        raise RuntimeError(f"producer failed ({done.returncode}): {done.stderr[-2000:]}")
    line = [x for x in done.stdout.splitlines() if x.startswith("{")][-1]
    r = json.loads(line)
    return {
        "msgs_per_s": r["records"] / r["seconds"],
        "cpu_ms_per_1k": 1e6 * r["cpu"] / r["records"],
    }


def summary(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:,.0f} ({min(values):,.0f} to {max(values):,.0f})"


def render(result: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "| producer code | partitions | msgs/s, median (range) | producer CPU ms per 1,000 "
        "records, median (range) |",
        "|---|---:|---:|---:|",
    ]
    for code, rows in result.items():
        for partitions, runs in rows.items():
            rate = summary([r["msgs_per_s"] for r in runs])
            cpu = [r["cpu_ms_per_1k"] for r in runs]
            span = f"{statistics.median(cpu):.1f} ({min(cpu):.1f} to {max(cpu):.1f})"
            lines.append(f"| {code} | {partitions:,} | {rate} | {span} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--partitions", type=int, nargs="+", default=[16, 1024])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--fsync", default="interval", choices=["always", "interval", "never"])
    parser.add_argument("--sdk-root", type=Path, action="append")
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--dir", type=Path, default=ROOT / "var" / "bench")
    args = parser.parse_args(argv)
    roots = [r.resolve() for r in (args.sdk_root or [ROOT])]
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.dir))
    zk = start_zookeeper(work / "zookeeper")
    agent = None
    result: dict[str, dict[int, list[dict[str, float]]]] = {
        str(r): {p: [] for p in args.partitions} for r in roots
    }
    try:
        connect = f"{zk.connect_string}/bench"
        agent = start_agent(1, connect, work / "agent-1")
        for p in args.partitions:
            asyncio.run(create_topic(connect, f"keyed-{p}", p, {"fsync.policy": args.fsync}))
        for p in args.partitions:
            asyncio.run(wait_for_leaders(agent.address, f"keyed-{p}", p, 300))
        for _ in range(args.rounds):
            for p in args.partitions:
                for root in roots:
                    settle_writeback(args.dir)
                    r = run_child(root, agent.address, f"keyed-{p}", args, args.profile)
                    print(f"{root} {p}: {r}", flush=True)
                    result[str(root)][p].append(r)
    finally:
        if agent is not None:
            agent.stop()
        zk.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(render(result, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
