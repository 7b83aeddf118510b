"""10,000 partitions on one agent: creation, leadership, memory, and a graceful restart.

Run with ``make bench-many-partitions`` (``python -m bench.many_partitions_bench
[--partitions N] [--rounds R] [--write-docs]``). Starts a real ZooKeeper and one agent
(replication factor 1); each round uses a fresh chroot and data directory and measures:

* **create**: from the admin call (``TopicAdmin.create_topic``, what ``POST /topics`` runs)
  until every partition has a state in ZooKeeper (the controller has placed it and named a
  leader);
* **led**: from the same start until the agent leads every partition (its
  ``strata_partitions_leader`` gauge, polled every ``POLL_S``);
* **RSS**: the agent's resident memory once idle after that (``IDLE_S`` later);
* **restart**: SIGTERM (a graceful stop: controlled shutdown, logs closed), a new agent
  process on the same data directory, and the time from its start (spawn) until it leads
  every partition again; also from its "listening" line, without the interpreter's start-up.

Figures are the median (and range) of the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import publish, spread
from handlers.admin import TopicAdmin
from infra.agents import AgentProcess, spawn_agent, start_agent
from infra.zookeeper import start_zookeeper
from storage.metadata import AsyncZooKeeper, MetadataStore, TopicConfig
from storage.metadata.store import partitions_path

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "many"
POLL_S = 0.2
IDLE_S = 5.0
DEADLINE_S = 300.0
TARGETS = {"create_s": 10.0, "rss_mib": 512.0, "restart_led_s": 5.0}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def leaders(agent: AgentProcess) -> int:
    """The agent's ``strata_partitions_leader`` gauge (-1 if the scrape fails)."""
    try:
        with urllib.request.urlopen(agent.metrics_url, timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("strata_partitions_leader "):
                    return int(float(line.split()[1]))
    except OSError:
        pass
    return -1


def wait_led(agent: AgentProcess, partitions: int, start: float) -> float:
    """Seconds from ``start`` (monotonic) until ``agent`` leads ``partitions`` partitions."""
    while leaders(agent) < partitions:
        if time.monotonic() - start > DEADLINE_S:
            raise TimeoutError(f"agent {agent.agent_id} leads {leaders(agent)} of {partitions}")
        if agent.process.poll() is not None:
            raise RuntimeError(f"agent exited ({agent.process.returncode})")
        time.sleep(POLL_S)
    return time.monotonic() - start


async def create(connect: str, partitions: int) -> tuple[float, float]:
    """(seconds of the admin call, seconds until every partition has a state)."""
    zk = AsyncZooKeeper(connect)
    await zk.start()
    try:
        store = MetadataStore(zk)
        start = time.monotonic()
        await TopicAdmin(store).create_topic(TOPIC, partitions, 1, TopicConfig())
        admin_s = time.monotonic() - start
        while True:
            stat = await zk.exists(partitions_path(TOPIC))
            if (
                stat is not None
                and stat.numChildren >= partitions
                and len(await store.partition_states(TOPIC)) >= partitions
            ):
                return admin_s, time.monotonic() - start
            if time.monotonic() - start > DEADLINE_S:
                raise TimeoutError("partition states not all written")
            await asyncio.sleep(POLL_S)
    finally:
        await zk.stop()


def one_round(zk_connect: str, work: Path, partitions: int, index: int) -> dict[str, float]:
    connect = f"{zk_connect}/many-{index}"
    data = work / f"agent-{index}"
    agent = start_agent(1, connect, data)
    try:
        start = time.monotonic()
        admin_s, create_s = asyncio.run(create(connect, partitions))
        led_s = wait_led(agent, partitions, start)
        time.sleep(IDLE_S)
        rss = rss_mib(agent.pid)
        stop_start = time.monotonic()
        agent.stop(timeout=60)
        stop_s = time.monotonic() - stop_start
        restart = time.monotonic()
        agent = spawn_agent(1, connect, data).wait(60)
        listening_s = time.monotonic() - restart
        restart_led_s = wait_led(agent, partitions, restart)
        time.sleep(IDLE_S)
        rss_after = rss_mib(agent.pid)
    finally:
        agent.stop(timeout=60)
    row = {
        "admin_call_s": admin_s,
        "create_s": create_s,
        "led_s": led_s,
        "rss_mib": rss,
        "stop_s": stop_s,
        "restart_led_s": restart_led_s,
        "restart_led_after_listening_s": restart_led_s - listening_s,
        "rss_after_restart_mib": rss_after,
    }
    print({k: round(v, 2) for k, v in row.items()}, flush=True)
    return row


def render(r: dict[str, Any]) -> str:
    def cell(key: str, fmt: str = ".2f") -> str:
        s = r["figures"][key]
        return f"**{s['median']:{fmt}}** ({s['min']:{fmt}}-{s['max']:{fmt}})"

    def verdict(key: str) -> str:
        return "met" if r["figures"][key]["median"] <= TARGETS[key] else "**missed**"

    return "\n".join(
        [
            "<!-- many_partitions-bench:begin (generated by `make bench-many-partitions`;"
            " do not edit by hand) -->",
            f"Measured {r['date']} on {r['machine']} with `{r['command']}`: one agent, one topic"
            f" of {r['partitions']:,} partitions, replication factor 1; median (range) of"
            f" {r['rounds']} rounds, each on a fresh chroot and data directory.",
            "",
            "| what | seconds or MiB | target |",
            "|---|---:|---|",
            f"| admin call (`POST /topics`) returns | {cell('admin_call_s')} s | |",
            f"| every partition has a state (leader) in ZooKeeper | {cell('create_s')} s |"
            f" ≤ 10 s: {verdict('create_s')} |",
            f"| the agent leads every partition | {cell('led_s')} s | |",
            f"| agent RSS, idle after creation | {cell('rss_mib', '.0f')} MiB |"
            f" ≤ 512 MiB: {verdict('rss_mib')} |",
            f"| graceful stop (SIGTERM until exit) | {cell('stop_s')} s | |",
            f"| restart: process start until it leads every partition again |"
            f" {cell('restart_led_s')} s | ≤ 5 s: {verdict('restart_led_s')} |",
            f"| of which after its listening line | {cell('restart_led_after_listening_s')} s | |",
            f"| agent RSS, idle after the restart | {cell('rss_after_restart_mib', '.0f')} MiB | |",
            "<!-- many_partitions-bench:end -->",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Strata: 10,000 partitions on one agent")
    parser.add_argument("--partitions", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=ROOT / "var" / "bench")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.dir))
    zk = start_zookeeper(work / "zookeeper")
    try:
        rows = [one_round(zk.connect_string, work, args.partitions, i) for i in range(args.rounds)]
    finally:
        zk.stop()
        shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {platform.machine()},"
        f" Python {platform.python_version()}",
        "command": "make bench-many-partitions",
        "partitions": args.partitions,
        "rounds": args.rounds,
        "figures": {k: spread([row[k] for row in rows]) for k in rows[0]},
        "_rows": rows,
    }
    publish("many_partitions", render(result), result, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
