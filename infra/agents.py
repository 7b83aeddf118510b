"""Start broker agent processes (``python -m broker_agents.main``) and wait until they serve."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from infra.processes import LocalStackError, log_tail, spawn, terminate

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class AgentProcess:
    agent_id: int
    host: str
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False, compare=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, *, timeout: float = 10.0) -> int:
        return terminate(self.process, timeout=timeout)


def start_agent(
    agent_id: int,
    zookeeper: str,
    data_dir: Path,
    *,
    log_path: Path | None = None,
    configs: dict[str, object] | None = None,
    startup_timeout: float = 30.0,
    die_with_parent: bool = True,
) -> AgentProcess:
    """Start one agent and return once it has printed its "listening" line."""
    log_path = log_path or data_dir.parent / f"agent-{agent_id}.log"
    argv = [
        sys.executable,
        "-m",
        "broker_agents.main",
        "--agent-id",
        str(agent_id),
        "--zookeeper",
        zookeeper,
        "--data-dir",
        str(data_dir),
    ]
    for key, value in (configs or {}).items():
        argv += ["--config", f"{key}={value}"]
    offset = log_path.stat().st_size if log_path.exists() else 0
    process = spawn(argv, log_path=log_path, cwd=ROOT, die_with_parent=die_with_parent)
    deadline = time.monotonic() + startup_timeout
    while True:
        with open(log_path, "rb") as f:
            f.seek(offset)
            for line in f.read().decode(errors="replace").splitlines():
                if line.startswith('{"event": "listening"'):
                    info = json.loads(line)
                    return AgentProcess(agent_id, info["host"], info["port"], log_path, process)
        if process.poll() is not None:
            raise LocalStackError(f"agent {agent_id} exited while starting:\n{log_tail(log_path)}")
        if time.monotonic() > deadline:
            terminate(process)
            raise LocalStackError(
                f"agent {agent_id} not serving after {startup_timeout:g} s:\n{log_tail(log_path)}"
            )
        time.sleep(0.02)
