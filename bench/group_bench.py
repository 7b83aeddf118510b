"""Offset-commit benchmark: 10 groups x 1,000 partitions against one coordinator.

Run with ``make bench-groups`` (``python -m bench.group_bench [--write-docs]``). Starts a real
ZooKeeper and one agent (the coordinator of every group), then for ``--seconds``:

* every group has ``--members`` committers, each owning ``partitions / members`` partitions
  and committing all of them in one OffsetCommit request, again as soon as the previous one
  is acknowledged (a synchronous commit loop — the worst case for the coordinator);
* **commits/s** counts partition offsets acknowledged per second (requests/s alongside);
* **ZooKeeper writes/s** is measured on the ZooKeeper side: the zxid advances by one per
  write transaction, read from a probe znode created before and after the run; the offsets
  znodes' versions give the znode rewrites.

Commits from outside the group protocol (generation -1; the groups have no members) take the
same path in the coordinator as members' commits: the generation check is O(1), the cost is
the coalescing and the ZooKeeper transaction.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import publish
from infra.agents import start_agent
from infra.zookeeper import start_zookeeper
from sdk.connection import Connection
from storage.metadata import AsyncZooKeeper
from storage.metadata.groups import GroupStore, offsets_path
from storage.protocol import messages as m

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "bench"


async def _zxid(zk: AsyncZooKeeper) -> int:
    path = await asyncio.to_thread(
        zk.client.create, "/bench-probe-", b"", ephemeral=True, sequence=True
    )
    stat = await zk.exists(path)
    assert stat is not None
    return int(stat.czxid)


async def _offset_versions(store: GroupStore, groups: list[str]) -> int:
    total = 0
    for g in groups:
        stat = await store.zk.exists(offsets_path(g, TOPIC))
        total += 0 if stat is None else int(stat.version) + 1
    return total


async def run(
    address: tuple[str, int],
    zk_connect: str,
    groups: int,
    partitions: int,
    members: int,
    seconds: float,
) -> dict[str, Any]:
    names = [f"group-{i}" for i in range(groups)]
    share = partitions // members
    counters = {"commits": 0, "requests": 0}
    conns = [Connection(address[0], address[1], max_in_flight=members) for _ in range(groups)]
    zk = AsyncZooKeeper(zk_connect)
    await zk.start()
    store = GroupStore(zk)
    stop = asyncio.Event()
    latencies: list[float] = []

    async def committer(conn: Connection, group: str, index: int) -> None:
        parts = range(index * share, (index + 1) * share)
        offset = 0
        while not stop.is_set():
            offset += 1
            req = m.OffsetCommitRequest(
                group,
                m.NO_GENERATION,
                "",
                None,
                [
                    m.OffsetCommitTopic(
                        TOPIC, [m.OffsetCommitPartition(p, offset, None) for p in parts]
                    )
                ],
            )
            sent = time.perf_counter()
            resp: m.OffsetCommitResponse = await conn.request(req)
            latencies.append(time.perf_counter() - sent)
            codes = {p.error_code for t in resp.topics for p in t.partitions}
            if codes != {0}:
                raise SystemExit(f"commit failed: {codes}")
            counters["commits"] += len(parts)
            counters["requests"] += 1

    try:
        # warm up: load every group on the coordinator, create its offsets znode
        await asyncio.gather(
            *(committer_once(conns[i], g, partitions) for i, g in enumerate(names))
        )
        zxid0 = await _zxid(zk)
        versions0 = await _offset_versions(store, names)
        started = time.perf_counter()
        tasks = [
            asyncio.create_task(committer(conns[i], g, k))
            for i, g in enumerate(names)
            for k in range(members)
        ]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
        zxid1 = await _zxid(zk)
        versions1 = await _offset_versions(store, names)
    finally:
        for c in conns:
            await c.close()
        await zk.stop()
    latencies.sort()
    zk_tx = zxid1 - zxid0 - 1  # minus the first probe's own transaction
    return {
        "groups": groups,
        "partitions": partitions,
        "committers_per_group": members,
        "seconds": round(elapsed, 2),
        "commits_per_s": round(counters["commits"] / elapsed),
        "requests_per_s": round(counters["requests"] / elapsed),
        "zk_transactions_per_s": round(zk_tx / elapsed, 1),
        "offset_znode_writes_per_s": round((versions1 - versions0) / elapsed, 1),
        "commits_per_zk_transaction": round(counters["commits"] / max(zk_tx, 1)),
        "commit_latency_ms_p50": round(latencies[len(latencies) // 2] * 1000, 2),
        "commit_latency_ms_p99": round(latencies[int(len(latencies) * 0.99)] * 1000, 2),
    }


async def committer_once(conn: Connection, group: str, partitions: int) -> None:
    req = m.OffsetCommitRequest(
        group,
        m.NO_GENERATION,
        "",
        None,
        [
            m.OffsetCommitTopic(
                TOPIC, [m.OffsetCommitPartition(p, 0, None) for p in range(partitions)]
            )
        ],
    )
    await conn.request(req)


def render(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            "<!-- group-bench:begin (generated by `make bench-groups`; do not edit by hand) -->",
            f"Measured {r['date']} on {r['machine']} (`{r['command']}`): one agent coordinating "
            f"{r['groups']} groups x {r['partitions']} partitions, {r['committers_per_group']} "
            f"synchronous committers per group (each commits its {r['partitions'] // r['committers_per_group']} "
            f"partitions per request), {r['seconds']} s; `offsets.commit.linger.ms` = 5.",
            "",
            "| metric | value |",
            "|---|---:|",
            f"| offset commits acknowledged / s (partition offsets) | {r['commits_per_s']:,} |",
            f"| OffsetCommit requests / s | {r['requests_per_s']:,} |",
            f"| ZooKeeper write transactions / s (zxid delta, whole ensemble) | {r['zk_transactions_per_s']:,} |",
            f"| offsets znode rewrites / s | {r['offset_znode_writes_per_s']:,} |",
            f"| commits per ZooKeeper transaction | {r['commits_per_zk_transaction']:,} |",
            f"| commit latency p50 / p99 | {r['commit_latency_ms_p50']} / {r['commit_latency_ms_p99']} ms |",
            "<!-- group-bench:end -->",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Strata offset-commit benchmark")
    parser.add_argument("--groups", type=int, default=10)
    parser.add_argument("--partitions", type=int, default=1000)
    parser.add_argument("--members", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--dir", type=Path, default=ROOT / "var" / "bench")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.dir))
    zk = start_zookeeper(work / "zookeeper")
    agent = None
    try:
        connect = f"{zk.connect_string}/bench"
        agent = start_agent(1, connect, work / "agent-1")
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
            "command": "make bench-groups",
            **asyncio.run(
                run(
                    (agent.host, agent.port),
                    connect,
                    args.groups,
                    args.partitions,
                    args.members,
                    args.seconds,
                )
            ),
        }
    finally:
        if agent is not None:
            agent.stop()
        zk.stop()
        shutil.rmtree(work, ignore_errors=True)
    table = render(result)
    publish("group", table, result, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
