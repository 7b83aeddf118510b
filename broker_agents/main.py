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
import json
import logging
import signal
import sys
from pathlib import Path

from broker_agents.agent import Agent
from broker_agents.config import AgentConfig
from broker_agents.metrics import AgentMetrics
from storage.wal.group_commit import set_fsync_observer


def parse_args(argv: list[str] | None = None) -> AgentConfig:
    p = argparse.ArgumentParser(description="Run a Strata broker agent")
    p.add_argument("--agent-id", type=int, required=True)
    p.add_argument("--listen", default="127.0.0.1:0", help="host:port (port 0 = any free port)")
    p.add_argument("--zookeeper", required=True, help="host:port[/chroot]")
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--session-timeout-ms", type=int, default=6000)
    p.add_argument(
        "--config", action="append", default=[], metavar="KEY=VALUE", help="any AgentConfig key"
    )
    args = p.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    values: dict[str, object] = {
        "agent.id": args.agent_id,
        "listen.host": host or "127.0.0.1",
        "listen.port": int(port),
        "zookeeper.connect": args.zookeeper,
        "data.dir": args.data_dir,
        "zookeeper.session.timeout.ms": args.session_timeout_ms,
    }
    for item in args.config:
        key, _, value = item.partition("=")
        values[key] = value
    result: AgentConfig = AgentConfig.parse(values)
    return result


async def _main(config: AgentConfig) -> None:
    agent = Agent(config)
    metrics = AgentMetrics(agent)
    agent.server.observer = metrics
    agent.tiering.on_upload = metrics.observe_upload
    set_fsync_observer(metrics.observe_fsync)
    metrics_port = await metrics.start(config.metrics_host, config.metrics_port)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.stop)

    def ready(host: str, port: int) -> None:
        print(
            json.dumps(
                {
                    "event": "listening",
                    "agent_id": config.agent_id,
                    "host": host,
                    "port": port,
                    "metrics_url": f"http://{config.metrics_host}:{metrics_port}/metrics",
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
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format='{"ts":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":"%(message)s"}',
    )
    logging.getLogger("kazoo").setLevel(logging.WARNING)
    asyncio.run(_main(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
