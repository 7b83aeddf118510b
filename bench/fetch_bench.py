"""Consume one keyed topic of many partitions with one consumer assigned every partition.

One agent (RF 1), topics of 16 and 1,024 partitions (``--partitions``), each filled once with
``--messages`` 1 KiB records with random 8-byte keys (``send_batch`` of 1,024 at a time, so
every request touches many partitions, as a "keyed by customer id" topic does). Then rounds
of consume from the beginning, alternating the topics and the two read paths (``getmany``,
``getmany_arrow``); each cell is the median (min-max) of ``--rounds`` runs: msgs/s, the
consumer's CPU per record (its own ``process_time``: what the wall-clock rate is on an idle
machine, and robust when other work shares the cores), and the agent's CPU per record from
/proc, whole and above its idle rate (measured for 3 s before the runs: a topic's background
work, which is not fetch work). ``--baseline DIR`` starts a second agent from another checkout
(its own ZooKeeper chroot and data) and alternates every run between the two.

``--profile-agent`` runs the agent under py-spy (flat own-sample top list printed at the end);
``--profile-consumer`` runs the consumer under cProfile. Run with::

    python -m bench.fetch_bench --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import inspect
import json
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import create_topic
from infra.processes import spawn, terminate
from infra.zookeeper import start_zookeeper
from sdk import Consumer, Producer, TopicPartition

ROOT = Path(__file__).resolve().parent.parent
PYSPY = str(Path(sys.executable).parent / "py-spy")
SIZE = 1024
CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (children included: py-spy's child is the agent)."""
    total = 0.0
    for p in [pid, *_children(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLK
    return total


def _children(pid: int) -> list[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return []
    out = [int(k) for k in kids]
    for k in list(out):
        out += _children(k)
    return out


async def produce(bootstrap: str, topic: str, n: int) -> None:
    value = os.urandom(SIZE)
    chunk = 1024
    config = {"bootstrap.servers": bootstrap, "acks": 1, "linger.ms": 5}
    async with Producer(config) as producer:
        await producer.partitions_for(topic)
        futures = []
        for _ in range(n // chunk):
            keys = [os.urandom(8) for _ in range(chunk)]
            futures.append(await producer.send_batch(topic, [value] * chunk, keys=keys))
        await producer.flush()
        for f in futures:
            await f


async def consume(
    bootstrap: str, topic: str, partitions: int, arrow: bool
) -> tuple[int, float, float]:
    """(records read, wall seconds, this process's CPU seconds) for one read of the topic."""
    config = {"bootstrap.servers": bootstrap, "auto.offset.reset": "earliest"}
    async with Consumer(config) as consumer:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        expected = sum((await consumer.end_offsets(tps)).values())
        got = 0
        start, cpu = time.perf_counter(), time.process_time()
        async with asyncio.timeout(120):
            while got < expected:
                if arrow:
                    for table in (await consumer.getmany_arrow(timeout_ms=500)).values():
                        got += table.num_rows
                else:
                    for records in (await consumer.getmany(timeout_ms=500)).values():
                        got += len(records)
        return got, time.perf_counter() - start, time.process_time() - cpu


#: one consume run in a process of its own (``consume`` is pasted in: the baseline's checkout
#: has no copy of this module)
CONSUMER = """
import asyncio, json, sys, time
from sdk import Consumer, TopicPartition
{source}
out = asyncio.run(consume(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] != "getmany"))
print(json.dumps(out))
"""


def _start_agent(tree: Path, connect: str, data: Path, log_path: Path, pyspy: Path | None) -> Any:
    """An agent process running the code of ``tree``; (process, address)."""
    cmd = [sys.executable, "-m", "broker_agents.main", "--agent-id", "1",
           "--zookeeper", connect, "--data-dir", str(data)]  # fmt: skip
    if pyspy is not None:
        cmd = [PYSPY, "record", "-r", "100", "--format", "raw", "-o", str(pyspy), "--", *cmd]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    agent = spawn(cmd, log_path=log_path, cwd=tree, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith('{"event": "listening"'):
                info = json.loads(line)
                return agent, f"{info['host']}:{info['port']}"
        time.sleep(0.1)
    terminate(agent, timeout=5)
    raise SystemExit(log_path.read_text()[-2000:])


def _consume_in(
    tree: Path, address: str, topic: str, n: int, mode: str
) -> tuple[int, float, float]:
    """One consume run in a process of its own, with the SDK of ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", CONSUMER.format(source=inspect.getsource(consume)),
         address, topic, str(n), mode],
        env=env, cwd=tree, check=True, timeout=300, capture_output=True, text=True,
    )  # fmt: skip
    got, elapsed, cpu = json.loads(out.stdout.strip().splitlines()[-1])
    return int(got), float(elapsed), float(cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=200_704)
    parser.add_argument("--partitions", type=int, nargs="+", default=[16, 1024])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["getmany", "getmany_arrow"])
    parser.add_argument(
        "--baseline", type=Path, default=None,
        help="a checkout of the code to compare with (its own agent and consumers, alternated)",
    )  # fmt: skip
    parser.add_argument("--profile-agent", action="store_true")
    parser.add_argument("--profile-consumer", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    (ROOT / "var").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=ROOT / "var", prefix="fetch-bench-"))
    zk = start_zookeeper(work / "zookeeper")
    trees = {"this": ROOT} if args.baseline is None else {"baseline": args.baseline, "this": ROOT}
    agents: dict[str, tuple[Any, str]] = {}
    rows: dict[tuple[str, int, str], list[tuple[float, float, float, float]]] = {}
    raw = work / "agent-profile.txt"
    try:
        for label, tree in trees.items():
            connect = f"{zk.connect_string}/fetchbench-{label}"
            spy = raw if args.profile_agent and label == "this" else None
            agents[label] = _start_agent(
                tree, connect, work / f"agent-{label}", work / f"agent-{label}.log", spy
            )
            for n in args.partitions:
                asyncio.run(create_topic(connect, f"t{n}", n, {}))
                t0 = time.perf_counter()
                asyncio.run(produce(agents[label][1], f"t{n}", args.messages))
                print(f"{label}: {args.messages} records to {n} partitions in "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
        idle: dict[str, float] = {}
        for label, (agent, _) in agents.items():
            before = cpu_seconds(agent.pid)
            time.sleep(3)
            idle[label] = (cpu_seconds(agent.pid) - before) / 3
            print(f"{label} agent idle: {idle[label]:.3f} CPU s/s")
        prof = cProfile.Profile() if args.profile_consumer else None
        for _ in range(args.rounds):
            for n in args.partitions:
                for mode in args.modes:
                    for label, (agent, address) in agents.items():
                        before = cpu_seconds(agent.pid)
                        if prof is not None and label == "this":
                            prof.enable()
                            got, elapsed, own = asyncio.run(
                                consume(address, f"t{n}", n, mode != "getmany")
                            )
                            prof.disable()
                        else:
                            got, elapsed, own = _consume_in(trees[label], address, f"t{n}", n, mode)
                        cpu = cpu_seconds(agent.pid) - before
                        net = max(cpu - idle[label] * elapsed, 0.0)
                        row = (got / elapsed, own * 1e6 / got, cpu * 1e6 / got, net * 1e6 / got)
                        rows.setdefault((label, n, mode), []).append(row)
                        print(f"{label:<8} {n:>5} {mode:<14} {row[0]:>10,.0f} msgs/s, consumer "
                              f"{row[1]:.1f} us CPU/record, agent {row[2]:.1f} us/record "
                              f"({row[3]:.1f} above idle)", flush=True)  # fmt: skip
        if prof is not None:
            prof.dump_stats(args.profile_consumer)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    finally:
        for agent, _ in agents.values():
            if args.profile_agent:
                os.kill(agent.pid, signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    agent.wait(timeout=30)
            terminate(agent, timeout=5)
        zk.stop()
    print("\n| code | partitions | read path | msgs/s | consumer CPU us/record "
          "| agent CPU us/record | agent above idle |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|")
    result: list[dict[str, Any]] = []
    for (label, n, mode), runs in sorted(
        rows.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])
    ):
        cols = list(zip(*runs, strict=True))
        cells = [f"{statistics.median(c):,.{0 if i == 0 else 1}f} ({min(c):,.{0 if i == 0 else 1}f}"
                 f"-{max(c):,.{0 if i == 0 else 1}f})" for i, c in enumerate(cols)]  # fmt: skip
        print(f"| {label} | {n:,} | `{mode}` | " + " | ".join(cells) + " |")
        result.append({"code": label, "partitions": n, "mode": mode, "runs": runs,
                       "idle_cpu_per_s": idle[label]})  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.profile_agent and raw.exists():
        from bench.profile_bench import top

        shutil.copy(raw, ROOT / "var" / "fetch-agent-profile.txt")
        print("\n== agent: top functions by own samples")
        for frame, pct in top(raw, 25):
            print(f"{pct:5.1f}%  {frame}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
