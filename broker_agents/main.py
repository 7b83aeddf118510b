"""``python -m broker_agents.main``: run one agent process.

Prints one JSON line on stdout when it is registered and serving
(``{"event": "listening", "agent_id": 1, "host": "127.0.0.1", "port": 40123, "metrics_url":
"http://127.0.0.1:40124/metrics"}``), logs to stderr (one JSON object a line), serves
Prometheus metrics (``broker_agents.metrics``; ``metrics.port``, 0 = any free port), and
stops cleanly on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from broker_agents.agent import Agent
from broker_agents.config import ENV_PREFIX, AgentConfig
from broker_agents.identity import resolve_agent_id
from broker_agents.metrics import AgentMetrics
from storage import jsonlog
from storage.errors import InvalidConfigError
from storage.wal import crashfs
from storage.wal.group_commit import set_fsync_observer

log = logging.getLogger(__name__)

#: glibc ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(mmap_threshold: int = 8 << 20, trim_threshold: int = 64 << 20) -> bool:
    """Let glibc keep freed request-sized buffers for reuse instead of returning them.

    Every produce request is received into a fresh buffer (1 MiB with the SDK's defaults).
    glibc serves such sizes with ``mmap`` and gives them back on ``free`` (or trims the heap
    top), so the next request's buffer is faulted in and zeroed by the kernel page by page:
    about a third of the agent's system time at full produce rate (perf; docs/benchmarks.md).
    With these thresholds, blocks under ``mmap_threshold`` come from the heap and up to
    ``trim_threshold`` bytes of free heap top stay mapped. Returns False where the C library
    has no ``mallopt`` (not glibc); nothing changes then.
    """
    try:  # the C library the process already runs on (no ``find_library`` subprocess)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(
        mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )


def give_back_freed_memory() -> None:
    """Return freed memory to the system: called after many connections have closed.

    A full collection first: it clears the interpreter's free lists (frames, tuples, dicts
    left by thousands of connection tasks), which otherwise pin Python's memory arenas; then
    glibc's ``malloc_trim`` returns free heap pages whatever the thresholds above keep (up to
    ``trim_threshold`` at the heap top, and any free pages below it). 3,000 closed idle
    connections: +63 MiB RSS kept without this, +22 MiB with it (tests/test_hostile_peers.py).
    """
    started = time.perf_counter()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
    log.info("gave freed memory back in %.1f ms", (time.perf_counter() - started) * 1000)


def parse_args(argv: list[str] | None = None, env: Mapping[str, str] = os.environ) -> AgentConfig:
    """The agent's settings: its command line over ``STRATA_AGENT_*`` variables of ``env``
    (``AgentConfig.env_values``) over the defaults. A flag not given leaves the variable's
    value in place."""
    p = argparse.ArgumentParser(description="Run a Strata broker agent")
    p.add_argument(
        "--agent-id", type=int, default=None, help="default: stored in the data dir, or allocated"
    )
    p.add_argument("--listen", default=None, help="host:port (port 0 = any free port)")
    p.add_argument("--zookeeper", default=None, help="host:port[/chroot]")
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--session-timeout-ms", type=int, default=None)
    p.add_argument(
        "--config", action="append", default=[], metavar="KEY=VALUE", help="any AgentConfig key"
    )
    args = p.parse_args(argv)
    values: dict[str, object] = {
        "agent.id": -1,
        "listen.host": "127.0.0.1",
        "listen.port": 0,
        "zookeeper.session.timeout.ms": 6000,
        **AgentConfig.env_values(env),
    }
    flags = {
        "agent.id": args.agent_id,
        "zookeeper.connect": args.zookeeper,
        "data.dir": args.data_dir,
        "zookeeper.session.timeout.ms": args.session_timeout_ms,
    }
    values.update({key: value for key, value in flags.items() if value is not None})
    if args.listen is not None:
        host, _, port = args.listen.rpartition(":")
        if not port.isdigit():
            p.error(f"--listen takes host:port, not {args.listen!r}")
        values["listen.host"] = host or "127.0.0.1"
        values["listen.port"] = int(port)
    for item in args.config:
        key, _, value = item.partition("=")
        values[key] = value
    for key, flag in (("zookeeper.connect", "--zookeeper"), ("data.dir", "--data-dir")):
        if key not in values:
            p.error(f"{flag} (or {ENV_PREFIX}{key.replace('.', '_').upper()}) is required")
    result: AgentConfig = AgentConfig.parse(values)
    return result


async def _main(config: AgentConfig) -> None:
    agent = Agent(config)
    metrics = AgentMetrics(agent)
    agent.server.observer = metrics
    if agent.kafka_server is not None:
        agent.kafka_server.observer = metrics.kafka_observer()
    agent.server.give_back_memory = give_back_freed_memory
    agent.tiering.on_upload = metrics.observe_upload
    agent.apis.on_filter_scan = metrics.observe_filter_scan
    set_fsync_observer(metrics.observe_fsync)
    metrics_port = await metrics.start(config.metrics_host, config.metrics_port)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.stop)

    def ready(host: str, port: int) -> None:
        reg = agent.registration
        print(
            json.dumps(
                {
                    "event": "listening",
                    "agent_id": config.agent_id,
                    "host": host,
                    "port": port,
                    "metrics_url": f"http://{config.metrics_host}:{metrics_port}/metrics",
                    "kafka": None
                    if reg is None or reg.kafka_port is None
                    else f"{reg.kafka_host}:{reg.kafka_port}",
                }
            ),
            flush=True,
        )

    try:
        await agent.run(ready)
    finally:
        await metrics.stop()
        set_fsync_observer(None)


def main(argv: list[str] | None = None) -> int:
    jsonlog.configure()
    keep_freed_memory()
    crashfs.install_from_env()  # tests and fault drills only: off unless STRATA_CRASHFS is set
    try:
        config = parse_args(argv)
    except InvalidConfigError as exc:  # a usage error: say which setting, no traceback
        print(f"broker_agents.main: bad settings: {exc}", file=sys.stderr)
        return 2
    if config.agent_id < 0:
        agent_id = resolve_agent_id(None, config.data_dir, config.zookeeper)
        config = config.model_copy(update={"agent_id": agent_id})
    try:
        asyncio.run(_main(config))
    except Exception:  # logged as one JSON line like the rest, not a bare traceback on stderr
        log.critical("agent %d stopped on an unhandled error", config.agent_id, exc_info=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
