"""Agents without a given id (one container image, many tasks): ids from ZooKeeper, kept on
disk (``broker_agents.identity``)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kazoo.client import KazooClient

from broker_agents.identity import ALLOCATED_BASE, ID_FILE, advertised_host
from storage.metadata.models import AgentRegistration
from tests.cluster import ROOT
from tests.harness import ProcessGroup, ZooKeeperChroot


def _start(processes: ProcessGroup, zk: ZooKeeperChroot, data: Path, name: str) -> tuple[int, int]:
    """Start an agent without --agent-id: (its id, its pid)."""
    argv = [
        sys.executable,
        "-m",
        "broker_agents.main",
        "--zookeeper",
        zk.connect_string,
        "--data-dir",
        str(data),
        "--listen",
        "0.0.0.0:0",
    ]
    proc = processes.start(argv, name=name, cwd=ROOT)
    deadline = time.monotonic() + 30
    while True:
        for line in proc.log_text().splitlines():
            if line.startswith('{"event": "listening"'):
                return int(json.loads(line)["agent_id"]), proc.pid
        assert proc.alive, proc.log_text()[-2000:]
        assert time.monotonic() < deadline, proc.log_text()[-2000:]
        time.sleep(0.05)


def test_ids_are_allocated_once_and_kept_with_the_disk(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, zk_client: KazooClient, tmp_path: Path
) -> None:
    first, pid = _start(processes, zk_chroot, tmp_path / "a", "agent-a")
    second, _ = _start(processes, zk_chroot, tmp_path / "b", "agent-b")
    assert first >= ALLOCATED_BASE and second >= ALLOCATED_BASE and first != second
    assert (tmp_path / "a" / ID_FILE).read_text().strip() == str(first)
    # listening on every interface: registered under the address the host name resolves to
    data, _ = zk_client.get(f"/agents/{first}")
    reg = AgentRegistration.model_validate_json(data)
    assert reg.host == advertised_host("0.0.0.0", None) != "0.0.0.0"
    # the same disk again: the same agent
    processes.stop(pid)
    again, _ = _start(processes, zk_chroot, tmp_path / "a", "agent-a2")
    assert again == first
