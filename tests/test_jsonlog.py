"""Every log line of a Strata process is one valid JSON object, whatever the message holds."""

from __future__ import annotations

import io
import json
import logging
import socket
import time
from pathlib import Path

from kazoo.client import KazooClient

from storage import jsonlog
from tests.cluster import Cluster
from tests.harness import ProcessGroup, ZooKeeperChroot


def test_quotes_newlines_and_tracebacks_stay_inside_one_json_line() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(jsonlog.json_formatter())
    logger = logging.getLogger("strata.test.jsonlog")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning('a "quoted" value, a backslash \\ and\na newline')
        try:
            raise ValueError('bad "thing"')
        except ValueError:
            logger.exception("failed with %r", {"k": 'v"'})
    finally:
        logger.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["msg"] == 'a "quoted" value, a backslash \\ and\na newline'
    assert {"ts", "level", "logger", "msg"} <= set(first)
    assert second["level"] == "ERROR" and 'ValueError: bad "thing"' in second["exc_info"]


def test_every_line_an_agent_logs_parses_as_json(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, zk_client: KazooClient, tmp_path: Path
) -> None:
    """An agent fed a damaged partition state (its error message quotes the bad input, double
    quotes included) and garbage on its socket still writes only JSON lines, and goes on
    serving (its controller once crashed the agent on such a node: CI of stop 42)."""
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    agent = cluster.start_agent(1)
    cluster.create_topic("t", 1)
    cluster.wait_for_leaders("t")
    zk_client.set("/topics/t/partitions/0/state", b'{"leader": "one \\"quoted\\" leader"}')
    with socket.create_connection((agent.host, agent.port), timeout=5) as s:
        s.sendall(b"\xff\xff\xff\xff garbage")  # a negative frame size: the connection is closed
        s.settimeout(5)
        assert s.recv(100) == b""
    deadline = time.monotonic() + 20
    while agent.process.log_text().count("unreadable state") < 2:  # the agent and the controller
        assert time.monotonic() < deadline, agent.process.log_text()[-2000:]
        time.sleep(0.05)
    # one unreadable node stops neither the agent nor its controller: a new topic gets a leader
    cluster.create_topic("u", 1)
    cluster.wait_for_leaders("u")
    assert agent.process.alive, agent.process.log_text()[-2000:]
    lines = [line for line in agent.process.log_text().splitlines() if line.strip()]
    parsed = [json.loads(line) for line in lines]  # raises on any line that is not JSON
    unreadable = next(p for p in parsed if "unreadable state" in p.get("msg", ""))
    assert '"' in unreadable["msg"]
