"""One agent process: ZooKeeper session, registration, watches, server, controller, followers.

Start-up order: connect to ZooKeeper (chroot created if missing), create the fixed nodes,
start listening, register ``/agents/<id>`` (ephemeral; if a previous incarnation's node is
still there, wait for its session to expire), then watch ``/agents``, ``/controller`` and
``/topics`` (and under it every topic spec and partition state). Watch callbacks only record
what changed; one reconciler task applies the changes in order, so the partition manager
never sees two changes of the same partition at once.

Long-lived loops (reconciler, controller candidate, replica fetchers) are named tasks under
one ``asyncio.TaskGroup``: if one fails, the agent stops rather than limping on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import time
from collections.abc import Callable
from typing import Any

from broker_agents import clean_shutdown, preopen
from broker_agents.apis import Apis
from broker_agents.config import AgentConfig
from broker_agents.controller import Controller
from broker_agents.deletion import DeleterSettings, LocalRemoval, TopicDeleter
from broker_agents.disk import DiskGuard
from broker_agents.groups.coordinator import CoordinatorSettings, GroupCoordinator
from broker_agents.identity import advertised_host
from broker_agents.kafka.admin import KafkaTopicAdmin
from broker_agents.kafka.apis import KafkaApis
from broker_agents.kafka.codec import KafkaCodec
from broker_agents.partitions import PartitionManager
from broker_agents.rebalancer import Rebalancer, RebalanceSettings
from broker_agents.replication import IsrMaintenance, ReplicaFetchers
from broker_agents.retention import LocalRetention
from broker_agents.security.authenticator import Authenticator, AuthSettings
from broker_agents.security.guard import Authorizer, Guard
from broker_agents.security.quotas import Quotas
from broker_agents.server import AgentServer, NativeCodec
from broker_agents.tiering import Tiering
from broker_agents.transactions import (
    ClusterRoutes,
    MarkerChannel,
    MarkerWriter,
    OrphanSweeper,
    TransactionCoordinator,
    TxnSettings,
    find_coordinator_router,
)
from broker_agents.view import ClusterView
from sdk.auth import ScramLogin
from storage.config import FsyncPolicy
from storage.errors import MetadataError, NodeExistsError, StorageError
from storage.kafka import walk as kafka_walk
from storage.metadata import (
    AgentRegistration,
    AsyncZooKeeper,
    MetadataStore,
    PartitionState,
    SessionState,
    TopicSpec,
)
from storage.metadata.acls import ACLS
from storage.metadata.groups import GroupStore
from storage.metadata.models import ControllerInfo, load
from storage.metadata.quotas import QUOTAS
from storage.metadata.store import (
    AGENTS,
    CONTROLLER,
    TOPICS,
    agent_path,
    partitions_path,
    state_path,
    topic_path,
)
from storage.metadata.transactions import TxnStore
from storage.metadata.users import UserStore
from storage.protocol import messages as m
from storage.tls import ReloadingContext, client_context, server_context
from storage.wal import fileio
from storage.wal.agent import AgentWal, AgentWalConfig
from storage.wal.agent import replay as replay_wal
from storage.wal.agent.journal import WAL_DIRECTORY

log = logging.getLogger(__name__)

#: partition states applied at once by the reconcile loop (``PartitionManager.apply``): enough
#: that opening thousands of new logs overlaps their fsyncs, few enough to bound the tasks
APPLY_CONCURRENCY = 32
#: a state change that comes within this many seconds of the last round waits this long for
#: more: a restart's 10,000 watches, delivered one by one, were applied in ~6,000 rounds of
#: one or two partitions, each with its fixed cost (the replica fetchers' update walks every
#: partition), and the controller's pass starved behind them (``make bench-many-partitions``)
BURST_COALESCE_S = 0.01
#: partitions named in the reconcile loop's line about the partitions it opened
OPENED_NAMED = 10


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.agent_id = config.agent_id
        tls, peer_tls = self._tls(config)
        peer_login = None
        if config.listener_security_protocol.sasl and config.inter_agent_sasl_username:
            assert config.inter_agent_sasl_password is not None
            peer_login = ScramLogin(
                config.inter_agent_sasl_mechanism,
                config.inter_agent_sasl_username,
                config.inter_agent_sasl_password.get_secret_value(),
            )
        self.zk = AsyncZooKeeper(
            config.zookeeper,
            session_timeout=config.session_timeout_ms / 1000,
            request_timeout=config.request_timeout_ms / 1000,
        )
        self.store = MetadataStore(self.zk)
        self.partitions = PartitionManager(config.agent_id, config.data_dir)
        self.wal: AgentWal | None = None
        if config.wal_mode != "partition":
            self.wal = AgentWal(
                config.data_dir / WAL_DIRECTORY,
                AgentWalConfig(
                    segment_bytes=config.wal_segment_bytes,
                    max_bytes=config.wal_max_bytes,
                    checkpoint_interval_ms=config.wal_checkpoint_interval_ms,
                    fsync_interval_ms=config.wal_fsync_interval_ms,
                ),
                free_bytes=lambda: self.disk.free_bytes(),
            )
            self.partitions.wal = self.wal
            self.partitions.wal_policies = (
                frozenset({FsyncPolicy.ALWAYS, FsyncPolicy.INTERVAL})
                if config.wal_mode == "agent"
                else frozenset({FsyncPolicy.INTERVAL})
            )
            if config.wal_mode == "auto":
                self.partitions.wal_auto = (
                    config.wal_auto_topic_partitions,
                    config.wal_auto_max_own_commits,
                )
        self.partitions.on_disk_failure = self._disk_failure
        self.view = ClusterView()
        self.tiering = Tiering(
            self.agent_id, config, self.partitions, self.view, self.zk, self.store
        )
        if self.tiering.enabled:
            self.partitions.tier_start_offset = self.tiering.start_offset
        self.retention = LocalRetention(
            lambda: self.partitions.partitions.values(),
            config.log_retention_check_interval_ms / 1000,
            self.tiering.committed_end if self.tiering.enabled else None,
        )
        self.groups = GroupCoordinator(
            self.agent_id,
            self.zk,
            self.view,
            lambda: self.partitions.session_ok,
            CoordinatorSettings(
                min_session_timeout_ms=config.group_min_session_timeout_ms,
                max_session_timeout_ms=config.group_max_session_timeout_ms,
                initial_rebalance_delay_ms=config.group_initial_rebalance_delay_ms,
                commit_linger_ms=config.offsets_commit_linger_ms,
            ),
        )
        self.isr = IsrMaintenance(self.agent_id, self.partitions, self.store, self.view, config)
        self.disk = DiskGuard(config.data_dir, config.log_dir_min_free_bytes)
        self.apis = Apis(
            self.agent_id,
            config,
            self.partitions,
            self.view,
            self.tiering,
            self.isr.wake,
            self.disk.check,
        )
        self.apis.handlers.update(self.groups.handlers())
        # transactions (docs/transactions.md): markers in and out, the coordinator
        self.markers = MarkerWriter(self.partitions, self.groups.txn_marker)
        self.txn_channel = MarkerChannel(
            self.agent_id,
            ClusterRoutes(self.partitions.latest, self.view, self.groups.coordinator_id),
            self.markers.write_txn_markers,
            tls=peer_tls,
            login=peer_login,
        )
        self.transactions = TransactionCoordinator(
            self.agent_id,
            self.zk,
            self.view,
            lambda: self.partitions.session_ok,
            self.txn_channel,
            TxnSettings(
                max_timeout_ms=config.transaction_max_timeout_ms,
                abort_check_interval_ms=config.transaction_abort_check_interval_ms,
                complete_write_delay_ms=config.transaction_complete_write_delay_ms,
                id_expiration_ms=config.transactional_id_expiration_ms,
            ),
        )
        self.orphans = OrphanSweeper(
            lambda: [p for p in self.partitions.partitions.values() if p.role == "leader"],
            TxnStore(self.zk),
            self.markers,
            max_timeout_ms=config.transaction_max_timeout_ms,
            interval_ms=config.transaction_orphan_check_interval_ms,
        )
        self.apis.handlers.update(self.transactions.handlers())
        self.apis.handlers[m.ApiKey.WRITE_TXN_MARKERS] = self.markers.write_txn_markers
        self.apis.handlers[m.ApiKey.FIND_COORDINATOR] = find_coordinator_router(
            self.groups.find_coordinator, self.transactions.find_coordinator
        )
        self.auth = Authenticator(
            UserStore(self.zk).get,
            AuthSettings(
                mechanisms=config.sasl_mechanisms,
                max_concurrent=config.sasl_max_concurrent_authentications,
                failure_delay_s=config.connection_failed_authentication_delay_ms / 1000,
                deadline_s=config.sasl_authentication_deadline_ms / 1000,
            ),
        )
        core: Any = self.apis
        groups: Any = self.groups
        txns: Any = self.transactions
        self.authorizer: Authorizer | None = None
        if config.authorizer_enable:
            self.authorizer = Authorizer(config.super_user_set)
            guard = Guard(self.authorizer, self.apis, self.groups, self.transactions)
            self.apis.handlers.update(guard.handlers(self.apis.handlers))
            core, groups, txns = guard.core, guard.groups, guard.txns
        self.quotas = Quotas(config.super_user_set, burst_s=config.quota_burst_ms / 1000)
        self.server = AgentServer(
            self.apis,
            codec=NativeCodec(self.apis, self.auth, self.quotas),
            auth=self.auth,
            sasl=config.listener_security_protocol.sasl,
            tls=tls if config.listener_security_protocol.tls else None,
            handshake_timeout=config.ssl_handshake_timeout_ms / 1000,
            max_frame_bytes=config.max_frame_bytes,
            max_in_flight=config.max_in_flight_per_connection,
            max_queued_bytes=config.queued_max_request_bytes,
            idle_timeout=config.connections_max_idle_ms / 1000,
            frame_timeout=config.request_frame_timeout_ms / 1000,
        )
        self.kafka_server: AgentServer | None = None
        if config.kafka_listener is not None:
            kafka = KafkaApis(
                core,
                groups,
                txns,
                self.view,
                KafkaTopicAdmin(self.store, self.authorizer),
                self.authorizer,
            )
            self.kafka_server = AgentServer(
                self.apis,
                max_frame_bytes=config.max_frame_bytes,
                max_in_flight=config.max_in_flight_per_connection,
                max_queued_bytes=config.queued_max_request_bytes,
                idle_timeout=config.connections_max_idle_ms / 1000,
                frame_timeout=config.request_frame_timeout_ms / 1000,
                codec=KafkaCodec(kafka, self.auth, self.quotas),
                auth=self.auth,
                sasl=config.kafka_security_protocol.sasl,
                tls=tls if config.kafka_security_protocol.tls else None,
                handshake_timeout=config.ssl_handshake_timeout_ms / 1000,
            )
        self.removal = LocalRemoval(
            self.agent_id, self.partitions, self.store, self.tiering.quiesce
        )
        self.deleter = TopicDeleter(
            self.store,
            GroupStore(self.zk),
            self.tiering.store,
            self.view,
            DeleterSettings(batch_objects=config.topic_delete_batch_size, prefix=config.s3_prefix),
        )
        self.controller = Controller(
            self.agent_id,
            self.zk,
            self.store,
            self.view,
            self.deleter,
            Rebalancer(
                self.store,
                RebalanceSettings(
                    auto=config.auto_rebalance_enable,
                    delay_ms=config.auto_rebalance_delay_ms,
                    max_moves=config.rebalance_max_concurrent_moves,
                    replace_after_ms=config.agent_replace_after_ms,
                ),
            ),
        )
        self.fetchers = ReplicaFetchers(
            self.agent_id, self.partitions, self.view, config, tls=peer_tls, login=peer_login
        )
        self.registration: AgentRegistration | None = None
        #: partitions whose local log cannot be opened here (published in the registration)
        self.offline: set[tuple[str, int]] = set()
        self._published_offline: tuple[tuple[str, int], ...] = ()
        self._agent_watches: dict[int, Callable[[], None]] = {}
        #: states to apply, each with the ZooKeeper version it was read at (-1: not known)
        self._pending: dict[tuple[str, int], tuple[PartitionState | None, int]] = {}
        #: backoff of partitions whose state failed to apply (see ``_retry_later``)
        self._retry_delay: dict[tuple[str, int], float] = {}
        self._changed = asyncio.Event()
        self._watched_topics: dict[str, list[Callable[[], None]]] = {}
        self._watched_partitions: set[tuple[str, int]] = set()
        self._stop = asyncio.Event()
        self._agents_generation = 0
        self._background: set[asyncio.Future[None]] = set()
        self._reregister = asyncio.Event()
        self._shutdown: asyncio.Future[None] | None = None
        self._applied = asyncio.Event()  # set after each reconcile round (controlled shutdown)
        self._rounds_started = 0
        self._rounds_done = 0
        self._session_lost = False
        #: the topics of the first ``/topics`` listing whose spec has not been read yet
        self._unread_specs: set[str] | None = None
        self._specs_read = asyncio.Event()

    @staticmethod
    def _tls(
        config: AgentConfig,
    ) -> tuple[Callable[[], ssl.SSLContext] | None, Callable[[], ssl.SSLContext] | None]:
        """The listeners' TLS context and the one agents reach each other's native listener
        with (None where not TLS); both re-read their files when they change."""
        interval = config.ssl_reload_check_interval_ms / 1000
        server = client = None
        if config.listener_security_protocol.tls or config.kafka_security_protocol.tls:
            server = ReloadingContext(config.tls_files, server_context, check_interval=interval)
        if config.listener_security_protocol.tls:
            client = ReloadingContext(config.tls_files, client_context, check_interval=interval)
        return (server.get if server else None), (client.get if client else None)

    def stop(self) -> None:
        """Stop gracefully (SIGTERM): first a controlled shutdown, then the process ends.
        A second call stops at once."""
        if self._shutdown is None and self.registration is not None and not self._stop.is_set():
            self._shutdown = asyncio.ensure_future(self._controlled_shutdown())
            self._shutdown.add_done_callback(lambda _: self._stop.set())
        else:
            self._stop.set()

    async def _controlled_shutdown(self) -> None:
        """Say so in the registration, then wait (up to ``controlled.shutdown.timeout.ms``)
        until the controller has moved every partition this agent leads to another in-sync
        replica (those with none stay until the end). Producers then retry on the new leaders
        instead of timing out on a dead one, and groups move to other coordinators."""
        assert self.registration is not None
        started = time.monotonic()
        deadline = started + self.config.controlled_shutdown_timeout_ms / 1000
        self.registration = self.registration.model_copy(update={"shutting_down": True})
        try:
            await self.store.update_agent(self.registration)
        except MetadataError as exc:
            log.warning("controlled shutdown: cannot say so in ZooKeeper (%s); stopping", exc)
            return
        while (held := self._movable_leaderships()) and time.monotonic() < deadline:
            self._applied.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(deadline - time.monotonic()):
                    await self._applied.wait()
        log.info(
            "controlled shutdown after %.2f s: %d partitions still led here that another"
            " in-sync replica could take",
            time.monotonic() - started,
            len(held),
        )

    def _movable_leaderships(self) -> list[tuple[str, int]]:
        """Partitions led here whose ISR has another live agent that is not stopping."""
        agents = self.view.agents
        out = []
        for key, p in self.partitions.partitions.items():
            state = self.partitions.latest.get(key)
            if p.role != "leader" or state is None:
                continue
            if any(
                r != self.agent_id and r in agents and not agents[r].shutting_down
                for r in state.isr
            ):
                out.append(key)
        return out

    async def run(self, on_ready: Callable[[str, int], None] | None = None) -> None:
        fileio.fs.make_dirs(self.config.data_dir)
        incarnation = clean_shutdown.take(self.config.data_dir, self.agent_id)
        if incarnation is not None:
            self.partitions.incarnation = incarnation
            self.partitions.after_clean_shutdown = True
            log.info("a clean shutdown: still incarnation %s, in sync where it was", incarnation)
        if self.wal is not None:
            # before any partition opens: the partition logs get back what only the WAL held
            started = time.monotonic()
            replayed = await asyncio.to_thread(replay_wal, self.wal.directory, self.config.data_dir)
            if replayed.files:
                log.info(
                    "agent WAL replayed: %d file(s), %d entries, %d batches appended again to"
                    " %d partition(s), %d torn bytes cut, in %.3f s",
                    replayed.files,
                    replayed.entries,
                    replayed.batches_appended,
                    replayed.partitions,
                    replayed.torn_bytes,
                    time.monotonic() - started,
                )
            await asyncio.to_thread(self.wal.open)
        await self.zk.start()
        stopped = False  # by ``stop()``, not by a failure
        try:
            await self.store.init()
            await self._open_local_logs()
            self.zk.add_state_listener(self._on_session)
            await self.tiering.start()
            host, port = await self.server.start(self.config.listen_host, self.config.listen_port)
            kafka_host: str | None = None
            kafka_port: int | None = None
            if self.kafka_server is not None and self.config.kafka_listener is not None:
                # the compiled Kafka record walk, loaded before the first produce needs it
                await asyncio.to_thread(kafka_walk.available)
                want_host, _, want_port = self.config.kafka_listener.rpartition(":")
                kafka_host, kafka_port = await self.kafka_server.start(
                    want_host or "127.0.0.1", int(want_port)
                )
                kafka_host = self.config.kafka_advertised_host or kafka_host
            self.registration = AgentRegistration(
                agent_id=self.agent_id,
                host=advertised_host(host, self.config.advertised_host),
                port=port,
                started_ms=int(time.time() * 1000),
                incarnation=self.partitions.incarnation,
                kafka_host=kafka_host,
                kafka_port=kafka_port,
            )
            await self._register()
            self.partitions.session_ok = True
            self._watch_cluster()
            if on_ready is not None:
                on_ready(self.registration.host, port)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._reconcile_loop(), name="reconciler")
                tg.create_task(self.controller.run(), name="controller")
                tg.create_task(self._registration_loop(), name="registration")
                tg.create_task(self.tiering.run(), name="tiering")
                tg.create_task(self.retention.run(), name="local-retention")
                tg.create_task(self.isr.run(), name="isr-maintenance")
                tg.create_task(self.groups.run(), name="group-coordinator")
                tg.create_task(self.txn_channel.run(), name="txn-marker-channel")
                tg.create_task(self.transactions.run(), name="txn-coordinator")
                tg.create_task(self.orphans.run(), name="hanging-transactions")
                tg.create_task(self.removal.run(), name="topic-removal")
                tg.create_task(self._sweep_stray_directories(), name="stray-directories")
                tg.create_task(self._release_preopened(), name="preopened-logs")
                if self.wal is not None:
                    tg.create_task(self.wal.run(), name="agent-wal")
                await self._stop.wait()
                raise _Stop
        except* _Stop:
            stopped = True
        finally:
            await self.transactions.close()
            await self.groups.close()
            await self.fetchers.stop()
            await self.server.stop()
            if self.kafka_server is not None:
                await self.kafka_server.stop()
            self.auth.close()
            clean = await self.partitions.close()
            if self.wal is not None:
                clean = await self.wal.close() and clean
            await self.zk.stop()
            if stopped and clean and not self.offline:
                clean_shutdown.record(
                    self.config.data_dir, self.agent_id, self.partitions.incarnation
                )

    # ---- registration and session -----------------------------------------------------------
    async def _register(self) -> None:
        """Create ``/agents/<id>``; wait out a previous incarnation's node (same id, old session)."""
        assert self.registration is not None
        deadline = time.monotonic() + self.config.session_timeout_ms / 1000 * 3 + 5
        while True:
            try:
                await self.store.register_agent(self.registration)
                return
            except NodeExistsError:
                stat = await self.zk.exists(agent_path(self.agent_id))
                if stat is not None and stat.ephemeralOwner == self.zk.session_id:
                    return
                if time.monotonic() > deadline:
                    raise
                gone = asyncio.Event()

                def on_change(data: bytes | None, stat: object, gone: asyncio.Event = gone) -> None:
                    if data is None:
                        gone.set()

                cancel = self.zk.watch_data(agent_path(self.agent_id), on_change)
                try:
                    async with asyncio.timeout(1.0):
                        await gone.wait()
                except TimeoutError:
                    pass
                finally:
                    cancel()

    def _on_session(self, state: SessionState) -> None:
        # SUSPENDED: we may already have been replaced; stop leading until confirmed.
        # LOST: our partition states may be stale (another leader elected meanwhile); stay
        # off until re-registered and every hosted partition's state has been read afresh.
        if state == SessionState.LOST:
            self._session_lost = True
        self.partitions.session_ok = state == SessionState.CONNECTED and not self._session_lost
        if state in (SessionState.LOST, SessionState.CONNECTED):
            self._reregister.set()

    async def _registration_loop(self) -> None:
        """After a session loss, the ephemeral node is gone: register again once reconnected."""
        while True:
            await self._reregister.wait()
            self._reregister.clear()
            await self.zk.connected.wait()
            try:
                await self._register()
                if self._session_lost:
                    await self._reread_states()
                    self._session_lost = False
                self.partitions.session_ok = self.zk.state == SessionState.CONNECTED
            except MetadataError as exc:
                log.warning("re-registration failed: %s", exc)
                self._reregister.set()
                await asyncio.sleep(0.2)

    async def _reread_states(self) -> None:
        """Read the state of every partition known here from ZooKeeper and wait until the
        reconciler has applied them (after a session loss the watches may lag behind)."""
        for key in list(self.partitions.latest):
            got = await self.store.get_partition_state(*key)
            self._pending[key] = (None, -1) if got is None else got
        self._changed.set()
        wanted = self._rounds_started + 1
        while self._rounds_done < wanted:
            self._applied.clear()
            await self._applied.wait()

    # ---- watches ----------------------------------------------------------------------------
    def _watch_cluster(self) -> None:
        self.zk.watch_children(AGENTS, self._agents_watch)
        self.zk.watch_data(CONTROLLER, self._controller_changed)
        self.zk.watch_children(TOPICS, self._topics_changed)
        if self.authorizer is not None:
            authz = self.authorizer
            self.zk.watch_data(ACLS, lambda data, stat: authz.update(data))
        self.zk.watch_data(QUOTAS, lambda data, stat: self.quotas.update(data))

    def _agents_watch(self, children: list[str]) -> None:
        self._agents_generation += 1
        task = asyncio.ensure_future(self._agents_changed(children, self._agents_generation))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _agents_changed(self, children: list[str], generation: int) -> None:
        ids = {int(c) for c in children}
        for gone in set(self._agent_watches) - ids:
            self._agent_watches.pop(gone)()
        for new in ids - set(self._agent_watches):
            # a registration changes in place when its agent marks a replica offline
            self._agent_watches[new] = self.zk.watch_data(
                agent_path(new), functools.partial(self._agent_updated, new)
            )
        agents = {}
        for child in children:
            try:
                data, _ = await self.zk.get(agent_path(int(child)))
                agents[int(child)] = load(AgentRegistration, data)
            except MetadataError:
                continue
        if generation != self._agents_generation:
            return  # a newer change is being read; it wins
        self.view.agents = agents
        self.controller.poke()
        self.fetchers.update()

    def _agent_updated(self, agent_id: int, data: bytes | None, stat: object = None) -> None:
        if data is None or agent_id not in self.view.agents:
            return  # gone, or not yet read: the children watch handles both
        try:
            reg = load(AgentRegistration, data)
        except Exception as exc:
            log.error("unreadable registration of agent %d: %s", agent_id, exc)
            return
        if reg != self.view.agents.get(agent_id):
            self.view.agents = {**self.view.agents, agent_id: reg}
            self.controller.poke()

    def _controller_changed(self, data: bytes | None, stat: object) -> None:
        if data is None:
            self.view.controller_id = -1
            return
        try:
            self.view.controller_id = load(ControllerInfo, data).agent_id
        except Exception:
            self.view.controller_id = -1

    def _topics_changed(self, children: list[str]) -> None:
        self.controller.poke()
        current = set(children)
        if self._unread_specs is None:
            self._unread_specs = set(current)
        self._spec_read(current)
        for name in list(self._watched_topics):
            if name not in current:
                self._unwatch_topic(name)
                self.view.topics.pop(name, None)
        for name in current - set(self._watched_topics):
            self._watch_topic(name)

    def _watch_topic(self, name: str) -> None:
        self._watched_topics[name] = [
            self.zk.watch_data(topic_path(name), functools.partial(self._spec_changed, name)),
            self.zk.watch_children(
                partitions_path(name), functools.partial(self._partitions_changed, name)
            ),
        ]

    def _unwatch_topic(self, name: str) -> None:
        """Stop watching ``name``; its partitions here are closed (their state is None)."""
        for cancel in self._watched_topics.pop(name, []):
            cancel()
        for key in [k for k in self._watched_partitions if k[0] == name]:
            self._watched_partitions.discard(key)
            self._pending[key] = (None, -1)
        self._changed.set()

    def _spec_changed(self, name: str, data: bytes | None, stat: object = None) -> None:
        if data is None:
            return
        try:
            spec = load(TopicSpec, data)
        except Exception as exc:
            log.error("unreadable spec of topic %s: %s", name, exc)
            return
        old = self.view.topics.get(name)
        self.view.topics[name] = spec
        self._spec_read()
        if old is not None and old.topic_id != spec.topic_id and name in self._watched_topics:
            # deleted and created again between two events of the /topics watch: the old
            # incarnation's partitions go, and the new one's partitions node is watched afresh
            log.info(
                "topic %s was created again (id %s, was %s)", name, spec.topic_id, old.topic_id
            )
            self._unwatch_topic(name)
            self._watch_topic(name)
        if spec.deletion is not None:
            self.removal.request(spec)
        self.controller.poke()

    def _spec_read(self, existing: set[str] | None = None) -> None:
        """Note progress towards knowing every topic's id at start-up (see the sweep)."""
        if self._unread_specs is None:
            return
        self._unread_specs -= set(self.view.topics)
        if existing is not None:
            self._unread_specs &= existing  # deleted before its spec was read
        if not self._unread_specs:
            self._specs_read.set()

    async def _open_local_logs(self) -> None:
        """Open the live topics' local logs at once, before any state is watched (a warm
        restart, ``broker_agents.preopen``): on one thread, while the event loop waits."""
        try:
            specs = await self.store.topic_specs()
        except MetadataError as exc:
            log.warning("local logs not opened ahead (their states open them): %s", exc)
            return
        preopened = self.partitions.preopened
        seconds = await asyncio.to_thread(
            preopened.open_all,
            self.config.data_dir,
            specs,
            flushed=self.partitions.after_clean_shutdown,
        )
        if len(preopened):
            log.info("opened %d local logs ahead in %.2f s", len(preopened), seconds)

    async def _release_preopened(self) -> None:
        """Close the logs opened ahead that no state claimed (moved away while we were down)."""
        await asyncio.sleep(preopen.KEEP_S)  # a deadline for the states, not an event
        closed = await asyncio.to_thread(preopen.close_all, self.partitions.preopened.detach())
        if closed:
            log.info("closed %d local logs opened ahead that no state claimed", closed)

    async def _sweep_stray_directories(self) -> None:
        """Once every topic's spec is known: remove local directories of topics deleted while
        this agent was down (``PartitionManager.sweep_stray``)."""
        await self._specs_read.wait()
        try:
            await self.partitions.sweep_stray(
                {name: spec.topic_id for name, spec in self.view.topics.items()}
            )
        except (StorageError, OSError) as exc:
            log.warning("cannot sweep local directories of deleted topics: %s", exc)

    def _partitions_changed(self, name: str, children: list[str]) -> None:
        """Watch the states of the new partitions, all at once (one round trip for the
        thousands of a topic just created, not one each)."""
        new = {}
        for child in children:
            key = (name, int(child))
            if key in self._watched_partitions:
                continue
            self._watched_partitions.add(key)
            new[state_path(*key)] = key
        if new:
            self._watched_topics[name].append(
                self.zk.watch_data_many(
                    list(new), lambda path, data, stat: self._state_changed(new[path], data, stat)
                )
            )

    def _state_changed(self, key: tuple[str, int], data: bytes | None, stat: object = None) -> None:
        if key not in self._watched_partitions:
            return
        version = getattr(stat, "version", None)
        self.controller.state_changed(key, version)
        try:
            state = None if data is None else load(PartitionState, data)
        except Exception as exc:
            log.error("unreadable state of %s-%d: %s", key[0], key[1], exc)
            return
        self._pending[key] = (state, -1 if version is None else version)
        self._changed.set()

    async def _apply_all(
        self, work: list[tuple[tuple[str, int], PartitionState | None, TopicSpec | None, int]]
    ) -> list[Exception | None]:
        """Apply a round's states, ``APPLY_CONCURRENCY`` at once (opening a new partition's
        log is mostly fsyncs, which overlap), and return what each raised. A round holds one
        state per partition and rounds run one after another, so one partition's states still
        apply in order."""
        results: list[Exception | None] = [None] * len(work)
        queue = iter(range(len(work)))
        opened: list[str] = []
        waiting: list[str] = []  # led by an earlier incarnation of this agent

        async def applier() -> None:
            for i in queue:
                (topic, partition), state, spec, version = work[i]
                was_hosted = (topic, partition) in self.partitions.partitions
                try:
                    await self.partitions.apply(
                        topic,
                        partition,
                        state,
                        spec.config if spec else None,
                        spec.topic_id if spec else "",
                        version,
                        spec.partitions if spec else 0,
                    )
                except Exception as exc:
                    results[i] = exc
                    continue
                if (topic, partition) in self.partitions.partitions:
                    if not was_hosted:
                        opened.append(f"{topic}-{partition}")
                elif (
                    state is not None
                    and state.leader == self.agent_id
                    and not state.deleting
                    and not state.in_sync_as(self.agent_id, self.partitions.incarnation)
                ):
                    waiting.append(f"{topic}-{partition}")

        await asyncio.gather(*(applier() for _ in range(min(APPLY_CONCURRENCY, len(work)))))
        if opened:
            log.info(
                "hosting %d more partitions (%d in all): %s%s",
                len(opened),
                len(self.partitions.partitions),
                ", ".join(opened[:OPENED_NAMED]),
                ", ..." if len(opened) > OPENED_NAMED else "",
            )
        if waiting:
            log.info(
                "%d partitions led by an earlier incarnation of this agent wait for the"
                " controller: %s%s",
                len(waiting),
                ", ".join(waiting[:OPENED_NAMED]),
                ", ..." if len(waiting) > OPENED_NAMED else "",
            )
        return results

    async def _reconcile_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last_round = -1.0
        while True:
            await self._changed.wait()
            if loop.time() - last_round < BURST_COALESCE_S:
                # a burst (thousands of states delivered one watch at a time): let more of
                # it arrive, so that it is applied in rounds of many rather than of one
                await asyncio.sleep(BURST_COALESCE_S)
            self._changed.clear()
            self._rounds_started += 1
            this_round = self._rounds_started
            pending, self._pending = self._pending, {}
            work: list[tuple[tuple[str, int], PartitionState | None, TopicSpec | None, int]] = []
            for (topic, partition), (state, version) in pending.items():
                spec = self.view.topics.get(topic)
                if state is not None and spec is None:
                    try:
                        spec, _ = await self.store.get_topic(topic)
                        self.view.topics[topic] = spec
                    except Exception:
                        continue
                if spec is not None and spec.deletion is not None:
                    self.removal.request(spec)  # never open what is being deleted
                work.append(((topic, partition), state, spec, version))
            results = await self._apply_all(work)
            for (key, state, _, _), result in zip(work, results, strict=True):
                topic, partition = key
                if isinstance(result, StorageError):
                    # the local log cannot be opened (a quarantined segment, a disk error):
                    # tell the controller, which moves leadership and the ISR away from us
                    log.error("%s-%d is offline on this agent: %s", topic, partition, result)
                    await self._set_offline(key, state is not None)
                    self._retry_later(key)
                    continue
                if isinstance(result, Exception):
                    # e.g. ZooKeeper unavailable while a new leader reads its manifest: without
                    # a retry the partition would stay unhosted until its state changes again
                    log.error("cannot apply the state of %s-%d", topic, partition, exc_info=result)
                    self._retry_later(key)
                    continue
                self._retry_delay.pop(key, None)
                if key in self.offline and (
                    state is None
                    or state.deleting
                    or self.agent_id not in state.replicas
                    or key in self.partitions.partitions
                ):
                    await self._set_offline(key, False)  # deleted, moved away, or opened
            self.fetchers.update()
            self._rounds_done = this_round
            last_round = loop.time()
            self._applied.set()

    async def _disk_failure(self, key: tuple[str, int], exc: StorageError) -> None:
        """A hosted partition's log failed on disk (a full disk, a failed fsync) and was closed:
        offline here, like a log that cannot be opened, until a retry opens it again."""
        log.error("%s-%d is offline on this agent: %s", key[0], key[1], exc)
        await self._set_offline(key, True)
        self._retry_later(key)

    def _retry_later(self, key: tuple[str, int]) -> None:
        """Apply ``key``'s latest state again after a backoff (1 s, doubling up to 30 s)."""
        delay = self._retry_delay.get(key, 0.5) * 2
        self._retry_delay[key] = min(delay, 30.0)

        def again() -> None:
            state = self.partitions.latest.get(key)
            if state is None:
                self._retry_delay.pop(key, None)  # the topic is gone: nothing to apply
            elif key not in self._pending:  # else newer news is queued
                self._pending[key] = (state, -1)
                self._changed.set()

        asyncio.get_running_loop().call_later(self._retry_delay[key], again)

    async def _set_offline(self, key: tuple[str, int], offline: bool) -> None:
        """Add or remove ``key`` from the offline replicas in our registration."""
        if offline:
            self.offline.add(key)
        else:
            self.offline.discard(key)
        wanted = tuple(sorted(self.offline))
        if wanted == self._published_offline:
            return
        assert self.registration is not None
        self.registration = self.registration.model_copy(update={"offline": wanted})
        try:
            await self.store.update_agent(self.registration)
            self._published_offline = wanted
        except MetadataError as exc:
            # tried again with the partition's next retry; a session loss re-registers with
            # ``self.registration``, which has the change
            log.warning("cannot publish the offline replicas %s: %s", list(wanted), exc)


class _Stop(Exception):
    pass
