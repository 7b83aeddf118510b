"""Who an agent is and where it can be reached, when the deployment does not say.

**The id.** ``agent.id`` may be given (the local stack, tests, hand-run clusters: then it is
the operator's to keep with its disk). When it is not (a fleet of identical containers: one ECS service with a desired count), the agent takes
the id stored in its data directory (``agent.id``, Kafka's ``meta.properties``), and a fresh
disk allocates a new one from ZooKeeper: a persistent sequential node under ``/agent_ids``,
numbered from :data:`ALLOCATED_BASE` so that hand-given ids below it never collide. The file
is written (fsynced, then renamed) before the agent registers, so a restart on the same disk is
the same agent with the same replicas; a container that comes back on a new disk is a new
agent, and the old id's replicas are re-created elsewhere (``agent.replace.after.ms``).

**The address.** An agent listening on every interface (``0.0.0.0``) without
``advertised.host`` advertises the address its host name resolves to (in an ECS task with
``awsvpc`` networking: the task's own private IP).
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

from storage.errors import InvalidConfigError
from storage.metadata.zk import kazoo_client
from storage.wal import fileio
from storage.wal.fileio import write_file_atomically

log = logging.getLogger(__name__)

ID_FILE = "agent.id"
ID_ROOT = "/agent_ids"
ALLOCATED_BASE = 1001
WILDCARDS = ("0.0.0.0", "::", "")


def stored_id(data_dir: Path) -> int | None:
    path = data_dir / ID_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise InvalidConfigError(f"{path} holds {text!r}, not an agent id")
    return int(text)


def store_id(data_dir: Path, agent_id: int) -> None:
    fileio.fs.make_dirs(data_dir)
    write_file_atomically(data_dir / ID_FILE, f"{agent_id}\n".encode())
    fileio.fs.fsync_dir(data_dir)


def allocate_id(zookeeper: str, timeout_s: float = 10.0) -> int:
    """A new agent id, never handed out before in this cluster (ZooKeeper's sequence)."""
    zk = kazoo_client(zookeeper, timeout=timeout_s)
    try:  # closed even when the start fails (its socket pair would be left to the GC)
        zk.start(timeout=timeout_s)
        zk.ensure_path(ID_ROOT)
        path = zk.create(f"{ID_ROOT}/id-", b"", sequence=True)
    finally:
        zk.stop()
        zk.close()
    return ALLOCATED_BASE + int(path.rsplit("-", 1)[1])


def resolve_agent_id(given: int | None, data_dir: Path, zookeeper: str) -> int:
    """``given`` if there is one (the operator's), else the stored id, else a new one."""
    if given is not None:
        return given
    stored = stored_id(data_dir)
    if stored is not None:
        return stored
    agent_id = allocate_id(zookeeper)
    store_id(data_dir, agent_id)
    log.info("allocated agent id %d (stored in %s)", agent_id, data_dir / ID_FILE)
    return agent_id


def advertised_host(listen_host: str, configured: str | None) -> str:
    """Where clients and peers reach this agent."""
    if configured:
        return configured
    if listen_host in WILDCARDS:
        return socket.gethostbyname(socket.gethostname())
    return listen_host
