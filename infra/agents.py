"""Start broker agent processes (``python -m broker_agents.main``) and wait until they serve."""

from __future__ import annotations

import json
import os
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
    metrics_url: str = ""
    kafka: str = ""  # the Kafka listener's host:port ("" without one)

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
    env: dict[str, str] | None = None,
    startup_timeout: float = 30.0,
    die_with_parent: bool = True,
) -> AgentProcess:
    """Start one agent and return once it has printed its "listening" line.

    ``env``: variables added to this process's environment for the child (S3 settings).
    """
    pending = spawn_agent(
        agent_id,
        zookeeper,
        data_dir,
        log_path=log_path,
        configs=configs,
        env=env,
        die_with_parent=die_with_parent,
    )
    return pending.wait(startup_timeout)


@dataclass(frozen=True)
class PendingAgent:
    """An agent process started but not yet known to serve (see :meth:`wait`)."""

    agent_id: int
    log_path: Path
    offset: int
    process: subprocess.Popen[bytes] = field(repr=False, compare=False)

    def listening(self) -> dict[str, object] | None:
        with open(self.log_path, "rb") as f:
            f.seek(self.offset)
            for line in f.read().decode(errors="replace").splitlines():
                if line.startswith('{"event": "listening"'):
                    info: dict[str, object] = json.loads(line)
                    return info
        return None

    def wait(self, timeout: float = 30.0) -> AgentProcess:
        """Return once the agent serves; stop it and raise ``LocalStackError`` if it does not."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.listening()
            if info is not None:
                return AgentProcess(
                    self.agent_id,
                    str(info["host"]),
                    int(str(info["port"])),
                    self.log_path,
                    self.process,
                    metrics_url=str(info.get("metrics_url", "")),
                    kafka=str(info.get("kafka") or ""),
                )
            if self.process.poll() is not None:
                raise LocalStackError(
                    f"agent {self.agent_id} exited while starting:\n{log_tail(self.log_path)}"
                )
            if time.monotonic() > deadline:
                terminate(self.process)
                raise LocalStackError(
                    f"agent {self.agent_id} not serving after {timeout:g} s:\n"
                    f"{log_tail(self.log_path)}"
                )
            time.sleep(0.02)


def spawn_agent(
    agent_id: int,
    zookeeper: str,
    data_dir: Path,
    *,
    log_path: Path | None = None,
    configs: dict[str, object] | None = None,
    env: dict[str, str] | None = None,
    die_with_parent: bool = True,
) -> PendingAgent:
    """Start one agent process without waiting for it (start several, then wait for each)."""
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
    process = spawn(
        argv,
        log_path=log_path,
        cwd=ROOT,
        env=None if env is None else {**os.environ, **env},
        die_with_parent=die_with_parent,
    )
    return PendingAgent(agent_id, log_path, offset, process)
