"""Configuration of one agent process (validated at the edge, ``from_env`` for deployments)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, SecretStr, model_validator

from storage.config import _Config
from storage.protocol import DEFAULT_MAX_FRAME
from storage.tls import ClientAuth, SecurityProtocol, TlsFiles, check_inline_pem, with_inline_pem

#: agent settings from the environment: this prefix and the key, upper-cased, ``_`` for ``.``
ENV_PREFIX = "STRATA_AGENT_"


class AgentConfig(_Config):
    # -1: the id stored in data.dir, or a new one from ZooKeeper (broker_agents.identity)
    agent_id: int = Field(-1, alias="agent.id", ge=-1, le=1_000_000)
    listen_host: str = Field("127.0.0.1", alias="listen.host")
    listen_port: int = Field(0, alias="listen.port", ge=0, le=65535)
    advertised_host: str | None = Field(None, alias="advertised.host")
    # the Kafka protocol listener (docs/kafka.md): "host:port" (port 0: any free port), off
    # when unset; advertised to Kafka clients in Metadata and FindCoordinator
    kafka_listener: str | None = Field(None, alias="kafka.listener", pattern=r"^.*:\d{1,5}$")
    kafka_advertised_host: str | None = Field(None, alias="kafka.advertised.host")
    # ---- security (docs/security.md) --------------------------------------------------------
    # PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL for the native listener; the Kafka listener
    # takes kafka.listener.security.protocol (unset: the same). Agents reach each other on the
    # native listener, so with SSL there they show ssl.certfile as a client certificate too.
    listener_security_protocol: SecurityProtocol = Field(
        SecurityProtocol.PLAINTEXT, alias="listener.security.protocol"
    )
    kafka_listener_security_protocol: SecurityProtocol | None = Field(
        None, alias="kafka.listener.security.protocol"
    )
    ssl_certfile: str | None = Field(None, alias="ssl.certfile")
    ssl_keyfile: str | None = Field(None, alias="ssl.keyfile")
    ssl_cafile: str | None = Field(None, alias="ssl.cafile")
    # the same three as PEM text (Kafka's KIP-651 names), e.g. from a secret in the
    # environment (STRATA_AGENT_SSL_KEYSTORE_KEY): written to private files at start
    ssl_keystore_certificate_chain: str | None = Field(None, alias="ssl.keystore.certificate.chain")
    ssl_keystore_key: SecretStr | None = Field(None, alias="ssl.keystore.key")
    ssl_truststore_certificates: str | None = Field(None, alias="ssl.truststore.certificates")
    # none: no client certificates; requested: verified when shown (the CN is the principal);
    # required: a connection without a certificate the CA signed is refused
    ssl_client_auth: ClientAuth = Field(ClientAuth.NONE, alias="ssl.client.auth")
    # whether an agent checks the name in another agent's certificate against its address
    ssl_check_hostname: bool = Field(True, alias="ssl.check.hostname")
    ssl_handshake_timeout_ms: int = Field(10_000, alias="ssl.handshake.timeout.ms", ge=100)
    # how often the certificate files are looked at for a change (reload without restart)
    ssl_reload_check_interval_ms: int = Field(1000, alias="ssl.reload.check.interval.ms", ge=0)
    # SASL listeners: the SCRAM mechanisms offered (credentials in ZooKeeper, /config/users)
    sasl_enabled_mechanisms: str = Field(
        "SCRAM-SHA-256,SCRAM-SHA-512",
        alias="sasl.enabled.mechanisms",
        pattern=r"^(SCRAM-SHA-(256|512))(,SCRAM-SHA-(256|512))*$",
    )
    # SCRAM steps at a time (a small thread pool; 4x this may wait, more are turned away)
    sasl_max_concurrent_authentications: int = Field(
        2, alias="sasl.max.concurrent.authentications", ge=1, le=64
    )
    # a failed login is answered this late, then the connection is closed (Kafka's name)
    connection_failed_authentication_delay_ms: int = Field(
        100, alias="connection.failed.authentication.delay.ms", ge=0
    )
    # a connection to a SASL listener that has not authenticated by then is closed
    # how this agent logs in to the others' SASL listener (unneeded with SASL_SSL and a
    # client certificate, ssl.client.auth requested or required: the certificate is its
    # principal); the user must exist in /config/users (``strata users set``)
    inter_agent_sasl_mechanism: str = Field(
        "SCRAM-SHA-512", alias="inter.agent.sasl.mechanism", pattern=r"^SCRAM-SHA-(256|512)$"
    )
    inter_agent_sasl_username: str | None = Field(None, alias="inter.agent.sasl.username")
    inter_agent_sasl_password: SecretStr | None = Field(None, alias="inter.agent.sasl.password")
    # ACLs (/config/acls) checked on every request; off: everyone may do everything
    authorizer_enable: bool = Field(False, alias="authorizer.enable")
    # principals that skip the ACLs, ';'-separated (Kafka's form): the agents' own
    # (inter.agent.sasl.username or their certificates' CN) belong here, and an admin's
    super_users: str = Field("", alias="super.users")
    sasl_authentication_deadline_ms: int = Field(
        10_000, alias="sasl.authentication.deadline.ms", ge=100
    )
    # client quotas (/config/quotas): how far ahead of its rate a principal may run before
    # its answers are held (broker_agents/security/quotas.py)
    quota_burst_ms: int = Field(1000, alias="quota.burst.ms", ge=0, le=60_000)
    zookeeper: str = Field(alias="zookeeper.connect")
    data_dir: Path = Field(alias="data.dir")
    session_timeout_ms: int = Field(6000, alias="zookeeper.session.timeout.ms", ge=1000)
    request_timeout_ms: int = Field(10000, alias="zookeeper.request.timeout.ms", ge=100)
    # Prometheus endpoint (GET /metrics); port 0: any free port, printed in the listening line
    metrics_host: str = Field("127.0.0.1", alias="metrics.host")
    metrics_port: int = Field(0, alias="metrics.port", ge=0, le=65535)
    max_frame_bytes: int = Field(DEFAULT_MAX_FRAME, alias="socket.request.max.bytes", ge=1024)
    max_in_flight_per_connection: int = Field(64, alias="max.in.flight.per.connection", ge=1)
    # request bytes read off the sockets and not yet handled, over all connections (Kafka's
    # queued.max.request.bytes): past it the agent stops reading until handlers finish
    queued_max_request_bytes: int = Field(256 << 20, alias="queued.max.request.bytes", ge=1 << 20)
    # once a request frame has started, the rest must arrive within this (slow peers are cut)
    request_frame_timeout_ms: int = Field(30_000, alias="request.frame.timeout.ms", ge=100)
    # a connection that sends nothing (or takes no answer) for this long is closed
    connections_max_idle_ms: int = Field(600_000, alias="connections.max.idle.ms", ge=100)
    # produce is refused (LogDirFullError, retriable) while the data directory has less free
    # ---- the agent WAL (docs/architecture.md, "The agent WAL") ------------------------------
    # agent: one WAL per data directory makes the appends of every always/interval topic durable
    # (one fsync a round, however many partitions); partition: each partition log fsyncs its
    # own files; auto: interval topics on the agent WAL (one flusher, not one per partition),
    # always topics on their own group commit (measured faster at few partitions on one ext4
    # disk: the WAL writes every byte twice) unless the topic has more than
    # wal.auto.topic.partitions partitions or wal.auto.max.own.commits partitions here
    # already commit on their own: then on the WAL too (#30, docs/benchmarks.md "Partitions
    # are cheap")
    wal_mode: Literal["auto", "agent", "partition"] = Field("auto", alias="wal.mode")
    wal_auto_topic_partitions: int = Field(64, alias="wal.auto.topic.partitions", ge=0)
    wal_auto_max_own_commits: int = Field(256, alias="wal.auto.max.own.commits", ge=0)
    # a checkpoint (partition files fsynced, older WAL files removed) starts at this size...
    wal_max_bytes: int = Field(256 << 20, alias="wal.max.bytes", ge=1 << 16)
    # ...or this long after the last one
    wal_checkpoint_interval_ms: int = Field(30_000, alias="wal.checkpoint.interval.ms", ge=10)
    wal_segment_bytes: int = Field(64 << 20, alias="wal.segment.bytes", ge=1 << 12)
    # the fsync period of topics with fsync.policy=interval (one agent-wide flusher)
    wal_fsync_interval_ms: int = Field(50, alias="wal.fsync.interval.ms", ge=1)
    log_dir_min_free_bytes: int = Field(256 << 20, alias="log.dir.min.free.bytes", ge=0)
    replica_fetch_max_bytes: int = Field(8 << 20, alias="replica.fetch.max.bytes", ge=1024)
    replica_fetch_wait_max_ms: int = Field(500, alias="replica.fetch.wait.max.ms", ge=0)
    # bytes/s all replicas being added by moves (rebalance, decommission, replacement) copy
    # together on this agent; 0: no limit (broker_agents.replication, docs/operations.md)
    follower_replication_throttled_rate: int = Field(
        16 << 20, alias="follower.replication.throttled.rate", ge=0
    )
    # a filtered fetch looks at most this many bytes of batches per partition before it
    # answers with how far it got (docs/filters.md): bounds one fetch's work on a long range
    # that matches nothing
    fetch_filter_max_scan_bytes: int = Field(
        64 << 20, alias="fetch.filter.max.scan.bytes", ge=1 << 16
    )
    # ---- the object tier (off unless a bucket is given here or in STRATA_BUCKET) ----------
    # endpoint, region and credentials: boto3's own (AWS_ENDPOINT_URL, AWS_REGION, AWS_*)
    s3_bucket: str | None = Field(None, alias="s3.bucket")
    s3_endpoint_url: str | None = Field(None, alias="s3.endpoint.url")
    s3_region: str | None = Field(None, alias="s3.region")
    s3_prefix: str = Field("", alias="s3.prefix")
    s3_request_timeout_ms: int = Field(10000, alias="s3.request.timeout.ms", ge=100)
    s3_max_attempts: int = Field(5, alias="s3.max.attempts", ge=1, le=100)
    tier_upload_concurrency: int = Field(2, alias="tier.upload.concurrency", ge=1, le=64)
    tier_max_pending_bytes: int = Field(4 << 30, alias="tier.max.pending.bytes", ge=1)
    tier_multipart_part_bytes: int = Field(
        64 << 20, alias="tier.multipart.part.bytes", ge=5 << 20, le=5 << 30
    )
    tier_cache_bytes: int = Field(256 << 20, alias="tier.cache.bytes", ge=0)
    tier_read_block_bytes: int = Field(4 << 20, alias="tier.read.block.bytes", ge=4096)
    tier_readahead_blocks: int = Field(16, alias="tier.readahead.blocks", ge=0, le=256)
    tier_check_interval_ms: int = Field(250, alias="tier.check.interval.ms", ge=10)
    tier_retention_check_interval_ms: int = Field(
        30000, alias="tier.retention.check.interval.ms", ge=10
    )
    log_retention_check_interval_ms: int = Field(
        30000, alias="log.retention.check.interval.ms", ge=10
    )
    tier_orphan_check_interval_ms: int = Field(300000, alias="tier.orphan.check.interval.ms", ge=10)
    tier_orphan_grace_ms: int = Field(600000, alias="tier.orphan.grace.ms", ge=0)
    replica_lag_time_max_ms: int = Field(10_000, alias="replica.lag.time.max.ms", ge=100)
    # SIGTERM: how long to wait for leadership to move away before stopping anyway
    controlled_shutdown_timeout_ms: int = Field(
        30_000, alias="controlled.shutdown.timeout.ms", ge=0
    )
    # consumer groups (docs/groups.md)
    group_min_session_timeout_ms: int = Field(1000, alias="group.min.session.timeout.ms", ge=1)
    group_max_session_timeout_ms: int = Field(300_000, alias="group.max.session.timeout.ms", ge=1)
    group_initial_rebalance_delay_ms: int = Field(
        3000, alias="group.initial.rebalance.delay.ms", ge=0
    )
    offsets_commit_linger_ms: int = Field(5, alias="offsets.commit.linger.ms", ge=0)
    # transactions (docs/transactions.md)
    transaction_max_timeout_ms: int = Field(900_000, alias="transaction.max.timeout.ms", ge=1)
    # how often the coordinator looks for transactions past their transaction.timeout.ms
    transaction_abort_check_interval_ms: int = Field(
        1000, alias="transaction.abort.timed.out.transaction.cleanup.interval.ms", ge=10
    )
    # a completed transaction's final state is written this late (usually the next
    # transaction's first write carries it, and the write is saved)
    transaction_complete_write_delay_ms: int = Field(
        1000, alias="transaction.complete.write.delay.ms", ge=0
    )
    # how often a leader looks for hanging transactions: open on a partition longer than
    # transaction.max.timeout.ms (plus this), and no coordinator's (broker_agents.transactions.orphans)
    transaction_orphan_check_interval_ms: int = Field(
        60_000, alias="transaction.orphan.check.interval.ms", ge=10
    )
    # a transactional.id idle this long is forgotten (Kafka's default: 7 days)
    transactional_id_expiration_ms: int = Field(
        7 * 24 * 3600 * 1000, alias="transactional.id.expiration.ms", ge=1000
    )
    # balancing and replacement (docs/operations.md, broker_agents.rebalancer): with
    # auto.rebalance.enable the controller evens out replicas and preferred leaders once the
    # live agents have not changed for auto.rebalance.delay.ms; an agent dead for
    # agent.replace.after.ms (-1: never) has its replicas re-created on live agents
    auto_rebalance_enable: bool = Field(False, alias="auto.rebalance.enable")
    auto_rebalance_delay_ms: int = Field(10_000, alias="auto.rebalance.delay.ms", ge=0)
    rebalance_max_concurrent_moves: int = Field(
        8, alias="rebalance.max.concurrent.moves", ge=1, le=10_000
    )
    agent_replace_after_ms: int = Field(-1, alias="agent.replace.after.ms", ge=-1)
    # deleting topics (docs/operations.md): segment objects per DeleteObjects request
    topic_delete_batch_size: int = Field(1000, alias="topic.delete.batch.size", ge=1, le=1000)

    @property
    def kafka_security_protocol(self) -> SecurityProtocol:
        return self.kafka_listener_security_protocol or self.listener_security_protocol

    @property
    def super_user_set(self) -> frozenset[str]:
        return frozenset(u.strip() for u in self.super_users.split(";") if u.strip())

    @property
    def sasl_mechanisms(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.sasl_enabled_mechanisms.split(",")))

    @model_validator(mode="after")
    def _pem_one_way(self) -> Self:
        check_inline_pem(self)
        return self

    @property
    def tls_files(self) -> TlsFiles:
        files = TlsFiles(
            certfile=self.ssl_certfile,
            keyfile=self.ssl_keyfile,
            cafile=self.ssl_cafile,
            client_auth=self.ssl_client_auth,
            check_hostname=self.ssl_check_hostname,
        )
        return with_inline_pem(files, self)

    @classmethod
    def env_values(
        cls, env: Mapping[str, str] = os.environ, prefix: str = ENV_PREFIX
    ) -> dict[str, str]:
        """The settings ``env`` gives: ``STRATA_AGENT_`` and the key upper-cased with ``_``
        for ``.`` (``STRATA_AGENT_INTER_AGENT_SASL_PASSWORD``). Secrets belong here rather
        than on the command line, where every process on the host can read them."""
        values = {}
        for name, field in cls.model_fields.items():
            alias = field.alias or name
            key = prefix + alias.replace(".", "_").upper()
            if key in env:
                values[alias] = env[key]
        return values

    @classmethod
    def from_env(cls, prefix: str = ENV_PREFIX) -> AgentConfig:
        """From ``STRATA_AGENT_AGENT_ID``, ``STRATA_AGENT_ZOOKEEPER_CONNECT``, ... (dots -> _)."""
        result: AgentConfig = cls.parse(cls.env_values(os.environ, prefix))
        return result
