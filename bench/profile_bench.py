"""Profile the 1 KiB acks=1 produce path with py-spy: the agent and the producer, each started
under ``py-spy record`` (in this sandbox py-spy can only profile processes it starts itself).

Run with ``python -m bench.profile_bench`` after ``make bench-venv``. Writes collapsed stacks
and flame graphs under ``bench/results/profile/`` and prints each process's top functions by
own (self) samples, which is what docs/benchmarks.md's "bottlenecks" list is built from.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.compare_bench import _create_topic
from infra.processes import spawn, terminate
from infra.zookeeper import start_zookeeper

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "profile"
PYSPY = str(Path(sys.executable).parent / "py-spy")

PRODUCER = """
import asyncio, sys
from bench.compare_bench import strata_send, strata_send_batch
boot, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
fn = strata_send if mode == "send" else strata_send_batch
print(asyncio.run(fn(boot, "prof", n, 1024, 1, 30.0)), flush=True)
"""


def top(collapsed: Path, k: int = 12) -> list[tuple[str, float]]:
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        n = int(count)
        total += n
        own[re.sub(r":\d+\)$", ")", frames[-1])] += n
    return [(f, 100 * c / max(total, 1)) for f, c in own.most_common(k)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--mode", choices=["send", "send_batch"], default="send")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=ROOT / "var", prefix="profile-"))
    zk = start_zookeeper(work / "zookeeper")
    agent_log = work / "agent.log"
    agent = None
    try:
        connect = f"{zk.connect_string}/prof"
        raw = OUT / f"agent-{args.mode}.txt"
        agent = spawn(
            [PYSPY, "record", "-r", "200", "--format", "raw", "-o", str(raw), "--",
             sys.executable, "-m", "broker_agents.main", "--agent-id", "1",
             "--zookeeper", connect, "--data-dir", str(work / "agent")],
            log_path=agent_log, cwd=ROOT,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        address = None
        while address is None and time.monotonic() < deadline:
            for line in agent_log.read_text(errors="replace").splitlines():
                if line.startswith('{"event": "listening"'):
                    info = json.loads(line)
                    address = f"{info['host']}:{info['port']}"
            time.sleep(0.1)
        if address is None:
            raise SystemExit(agent_log.read_text()[-2000:])
        import asyncio

        asyncio.run(_create_topic(connect, "prof", 4, 1, {}))
        prod_raw = OUT / f"producer-{args.mode}.txt"
        subprocess.run(
            [PYSPY, "record", "-r", "200", "--format", "raw", "-o", str(prod_raw), "--",
             sys.executable, "-c", PRODUCER, address, str(args.messages), args.mode],
            cwd=ROOT, check=True, timeout=300,
        )  # fmt: skip
    finally:
        if agent is not None:
            os.kill(agent.pid, signal.SIGINT)  # py-spy writes its output, then exits
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                terminate(agent, timeout=5)
            terminate(agent, timeout=5)
        zk.stop()
    for name in (f"producer-{args.mode}", f"agent-{args.mode}"):
        path = OUT / f"{name}.txt"
        if path.exists():
            print(f"\n== {name}: top functions by own samples")
            for frame, pct in top(path):
                print(f"{pct:5.1f}%  {frame}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
