"""Client configuration: frozen, validated models that accept Kafka's dotted names.

Every field has a Python name (``linger_ms``) and Kafka's dotted name as its alias
(``linger.ms``); either works, and a mapping of dotted names can be handed straight to
``Producer`` / ``Consumer`` or to ``ProducerConfig.parse``::

    ProducerConfig.parse({"bootstrap.servers": "a:9092,b:9092", "acks": "all", "linger.ms": 10})
    ProducerConfig(bootstrap_servers=["a:9092"], acks=-1)

A bad value, an unknown name or an inconsistent combination raises
:class:`storage.errors.InvalidConfigError` naming the offending keys — from the constructor,
``model_validate`` and ``parse`` alike. Objects are frozen: derive a changed copy with
``cfg.model_copy(update={...})`` (which does not re-validate) or ``parse`` a new mapping.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping
from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from storage.codec import Compression
from storage.errors import InvalidConfigError
from storage.tls import SecurityProtocol, TlsFiles, check_inline_pem, with_inline_pem

MiB = 1 << 20
_HOST_PORT = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.%\w]+)\]|(?P<host>[^:\[\]\s]+)):(?P<port>\d{1,5})$"
)


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` as ``(host, port)``; ``ValueError`` otherwise."""
    m = _HOST_PORT.match(address.strip())
    if m is None or not 0 < int(m["port"]) < 65536:
        raise ValueError(f"{address!r} is not host:port")
    return m["v6"] or m["host"], int(m["port"])


def _describe(cls: type, exc: ValidationError) -> str:
    problems = []
    for e in exc.errors():
        where = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        if e["loc"] and e["type"] not in ("missing", "extra_forbidden"):
            shown = repr(e["input"])
            msg += f" (got {shown if len(shown) <= 80 else shown[:77] + '...'})"
        problems.append(f"{where}: {msg}")
    return f"invalid {cls.__name__}: " + "; ".join(problems)


class ClientConfig(BaseModel):
    """What every client (producer, consumer, admin) needs to reach the agents."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    bootstrap_servers: tuple[str, ...] = Field(alias="bootstrap.servers", min_length=1)
    client_id: str = Field("strata-python", alias="client.id", max_length=32767)
    request_timeout_ms: int = Field(30_000, alias="request.timeout.ms", ge=1)
    metadata_max_age_ms: int = Field(300_000, alias="metadata.max.age.ms", ge=0)
    retry_backoff_ms: int = Field(100, alias="retry.backoff.ms", ge=0)
    retry_backoff_max_ms: int = Field(1000, alias="retry.backoff.max.ms", ge=0)
    socket_connection_setup_timeout_ms: int = Field(
        10_000, alias="socket.connection.setup.timeout.ms", ge=1
    )
    connections_max_idle_ms: int = Field(540_000, alias="connections.max.idle.ms", ge=1)
    max_in_flight_requests_per_connection: int = Field(
        5, alias="max.in.flight.requests.per.connection", ge=1
    )
    # ---- security (docs/security.md) ----------------------------------------------------
    security_protocol: SecurityProtocol = Field(
        SecurityProtocol.PLAINTEXT, alias="security.protocol"
    )
    #: the CA bundle the agents' certificates are checked against (unset: the system's)
    ssl_cafile: str | None = Field(None, alias="ssl.cafile")
    #: a client certificate and its key (mTLS: the certificate's CN is the principal)
    ssl_certfile: str | None = Field(None, alias="ssl.certfile")
    ssl_keyfile: str | None = Field(None, alias="ssl.keyfile")
    #: the same three as PEM text (Kafka's KIP-651 names), e.g. from a secret: written to
    #: private files once per process (storage.tls.inline_pem_files)
    ssl_truststore_certificates: str | None = Field(None, alias="ssl.truststore.certificates")
    ssl_keystore_certificate_chain: str | None = Field(None, alias="ssl.keystore.certificate.chain")
    ssl_keystore_key: SecretStr | None = Field(None, alias="ssl.keystore.key")
    #: check the agent's name against its certificate (Kafka's
    #: ssl.endpoint.identification.algorithm=https)
    ssl_check_hostname: bool = Field(True, alias="ssl.check.hostname")
    #: SASL (security.protocol SASL_PLAINTEXT or SASL_SSL): SCRAM-SHA-256 or SCRAM-SHA-512
    sasl_mechanism: Literal["SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        "SCRAM-SHA-512", alias="sasl.mechanism"
    )
    sasl_username: str | None = Field(None, alias="sasl.username", min_length=1)
    #: never shown: the config's repr and errors print ``**********``
    sasl_password: SecretStr | None = Field(None, alias="sasl.password")

    @model_validator(mode="after")
    def _sasl_needs_credentials(self) -> Self:
        if self.security_protocol.sasl and (not self.sasl_username or not self.sasl_password):
            raise InvalidConfigError(
                f"invalid {type(self).__name__}: security.protocol {self.security_protocol}"
                " needs sasl.username and sasl.password"
            )
        check_inline_pem(self)
        return self

    @field_validator("security_protocol", mode="before")
    @classmethod
    def _protocol(cls, v: Any) -> Any:
        return v.strip().upper() if isinstance(v, str) else v

    @model_validator(mode="wrap")
    @classmethod
    def _typed_errors(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(data)
        except ValidationError as exc:
            raise InvalidConfigError(_describe(cls, exc)) from None

    @field_validator("bootstrap_servers", mode="before")
    @classmethod
    def _split_servers(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [s for s in (p.strip() for p in v.split(",")) if s]
        if isinstance(v, list | tuple):
            for s in v:
                if not isinstance(s, str):
                    raise ValueError(f"{s!r} is not a 'host:port' string")
                split_host_port(s)
        return v

    @classmethod
    def parse(cls, values: Mapping[str, Any] | Self | None = None, **kwargs: Any) -> Self:
        """A config from a mapping of dotted or Python names (or a config object, kept as is)."""
        if isinstance(values, cls) and not kwargs:
            return values
        if isinstance(values, ClientConfig):
            values = values.model_dump()
        merged = {**(values or {}), **kwargs}
        return cls.model_validate(merged)

    @property
    def tls_files(self) -> TlsFiles | None:
        """The TLS material to connect with (None: plaintext)."""
        if not self.security_protocol.tls:
            return None
        files = TlsFiles(
            certfile=self.ssl_certfile,
            keyfile=self.ssl_keyfile,
            cafile=self.ssl_cafile,
            check_hostname=self.ssl_check_hostname,
        )
        return with_inline_pem(files, self)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [split_host_port(s) for s in self.bootstrap_servers]

    @property
    def effective_backoff_max_ms(self) -> int:
        """Kafka's rule: a backoff above its maximum backs off constantly at the backoff."""
        return max(self.retry_backoff_ms, self.retry_backoff_max_ms)


class ProducerConfig(ClientConfig):
    """A producer's settings (see ``sdk.producer`` for how batching uses them)."""

    acks: Literal[0, 1, -1] = Field(1, alias="acks")
    linger_ms: int = Field(5, alias="linger.ms", ge=0)
    batch_size: int = Field(MiB, alias="batch.size", ge=0, le=256 * MiB)
    buffer_memory: int = Field(64 * MiB, alias="buffer.memory", ge=1)
    max_block_ms: int = Field(60_000, alias="max.block.ms", ge=0)
    max_request_size: int = Field(MiB, alias="max.request.size", ge=1, le=1 << 30)
    compression_type: Literal["none", "zstd", "lz4"] = Field("none", alias="compression.type")
    retries: int = Field(2_147_483_647, alias="retries", ge=0)
    delivery_timeout_ms: int = Field(120_000, alias="delivery.timeout.ms", ge=1)
    queue_buffering_max_messages: int = Field(100_000, alias="queue.buffering.max.messages", ge=1)
    #: write each batch's tag and header summary (``storage.codec.summary``), which broker-side
    #: filters read to skip batches undecoded; off for a topic no one filters (the retry
    #: machinery's internal topics): the producer does not build it nor the leader check it
    batch_summary: bool = Field(True, alias="batch.summary")
    #: None: on unless acks=0 (Kafka 3's default); see ``sdk.idempotence``
    enable_idempotence: bool | None = Field(None, alias="enable.idempotence")
    #: makes the producer transactional (``sdk.transactions``); needs acks=all (the default
    #: then) and idempotence
    transactional_id: str | None = Field(
        None, alias="transactional.id", min_length=1, max_length=249
    )
    #: the coordinator aborts a transaction open longer than this
    transaction_timeout_ms: int = Field(60_000, alias="transaction.timeout.ms", ge=1)

    @model_validator(mode="before")
    @classmethod
    def _transactional_acks(cls, data: Any) -> Any:
        """A transactional producer defaults to acks=all (Kafka's rule)."""
        if (
            isinstance(data, Mapping)
            and (
                data.get("transactional.id") is not None or data.get("transactional_id") is not None
            )
            and "acks" not in data
        ):
            data = {**data, "acks": -1}
        return data

    @field_validator("acks", mode="before")
    @classmethod
    def _acks(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip().lower()
            if v == "all":
                return -1
            if v.lstrip("-").isdigit():
                return int(v)
        return v

    @field_validator("compression_type", mode="before")
    @classmethod
    def _compression(cls, v: Any) -> Any:
        if isinstance(v, Compression):
            return v.name.lower()
        if isinstance(v, str):
            v = v.strip().lower()
            if v in ("gzip", "snappy"):
                raise ValueError(f"compression.type {v!r} is not supported; use none, zstd or lz4")
        return v

    @model_validator(mode="after")
    def _delivery_covers_one_attempt(self) -> Self:
        floor = self.linger_ms + self.request_timeout_ms
        if self.delivery_timeout_ms < floor:
            # raised as is: a model validator of a subclass runs outside ``_typed_errors``
            raise InvalidConfigError(
                f"invalid {type(self).__name__}: delivery.timeout.ms ({self.delivery_timeout_ms}) must be at least "
                f"linger.ms + request.timeout.ms ({floor})"
            )
        return self

    @model_validator(mode="after")
    def _idempotence_needs_acks_and_retries(self) -> Self:
        if self.enable_idempotence and (self.acks == 0 or self.retries == 0):
            raise InvalidConfigError(
                f"invalid {type(self).__name__}: enable.idempotence needs acks 1 or all and "
                f"retries > 0 (acks is {self.acks}, retries {self.retries})"
            )
        return self

    @model_validator(mode="after")
    def _transactions_need_acks_all(self) -> Self:
        if self.transactional_id is not None and (
            self.acks != -1 or self.enable_idempotence is False
        ):
            raise InvalidConfigError(
                f"invalid {type(self).__name__}: transactional.id needs acks=all and"
                f" idempotence (acks is {self.acks}, enable.idempotence"
                f" {self.enable_idempotence})"
            )
        return self

    @property
    def idempotent(self) -> bool:
        if self.enable_idempotence is None:
            return self.acks != 0
        return self.enable_idempotence

    @property
    def compression(self) -> Compression:
        return Compression[self.compression_type.upper()]


class ConsumerConfig(ClientConfig):
    """A consumer's settings; the group ones are explained in ``sdk.group``."""

    group_id: str | None = Field(None, alias="group.id")
    group_instance_id: str | None = Field(None, alias="group.instance.id", min_length=1)
    enable_auto_commit: bool = Field(True, alias="enable.auto.commit")
    auto_commit_interval_ms: int = Field(5000, alias="auto.commit.interval.ms", ge=1)
    session_timeout_ms: int = Field(45_000, alias="session.timeout.ms", ge=1)
    heartbeat_interval_ms: int = Field(3000, alias="heartbeat.interval.ms", ge=1)
    max_poll_interval_ms: int = Field(300_000, alias="max.poll.interval.ms", ge=1)
    partition_assignment_strategy: tuple[
        Literal["range", "roundrobin", "cooperative-sticky"], ...
    ] = Field(("range",), alias="partition.assignment.strategy", min_length=1)
    fetch_max_wait_ms: int = Field(500, alias="fetch.max.wait.ms", ge=0)
    fetch_min_bytes: int = Field(1, alias="fetch.min.bytes", ge=0)
    fetch_max_bytes: int = Field(50 * MiB, alias="fetch.max.bytes", ge=1, le=1 << 30)
    max_partition_fetch_bytes: int = Field(MiB, alias="max.partition.fetch.bytes", ge=1, le=1 << 30)
    auto_offset_reset: Literal["earliest", "latest", "none"] = Field(
        "latest", alias="auto.offset.reset"
    )
    max_poll_records: int = Field(500, alias="max.poll.records", ge=1)
    #: read_committed: records of open transactions are not returned until they end, and
    #: never those of aborted ones (``docs/transactions.md``)
    isolation_level: Literal["read_uncommitted", "read_committed"] = Field(
        "read_uncommitted", alias="isolation.level"
    )
    check_crcs: bool = Field(True, alias="check.crcs")
    #: read the group's retry topic too and allow ``retry_later`` (``docs/retries.md``)
    retry_enable: bool = Field(False, alias="retry.enable")
    #: "key": later records of a key wait behind one in retry (implies retry.enable)
    retry_ordering: Literal["none", "key"] = Field("none", alias="retry.ordering")

    @field_validator("partition_assignment_strategy", mode="before")
    @classmethod
    def _strategies(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [s.strip() for s in v.split(",") if s.strip()]
        return v

    @property
    def read_committed(self) -> bool:
        return self.isolation_level == "read_committed"

    @field_validator("auto_offset_reset", mode="before")
    @classmethod
    def _reset(cls, v: Any) -> Any:
        # Kafka's old names, still common in configs
        return {"smallest": "earliest", "largest": "latest"}.get(v, v) if isinstance(v, str) else v


#: the environment of a process that makes clients for a deployment rather than for a user
#: (the handlers, the event-source runner): how to reach a secured cluster (docs/security.md)
CLIENT_SECURITY_ENV = {
    "security.protocol": "STRATA_CLIENT_SECURITY_PROTOCOL",
    "sasl.mechanism": "STRATA_CLIENT_SASL_MECHANISM",
    "sasl.username": "STRATA_CLIENT_SASL_USERNAME",
    "sasl.password": "STRATA_CLIENT_SASL_PASSWORD",
    "ssl.cafile": "STRATA_CLIENT_SSL_CAFILE",
    "ssl.certfile": "STRATA_CLIENT_SSL_CERTFILE",
    "ssl.keyfile": "STRATA_CLIENT_SSL_KEYFILE",
    "ssl.truststore.certificates": "STRATA_CLIENT_SSL_TRUSTSTORE_CERTIFICATES",
    "ssl.keystore.certificate.chain": "STRATA_CLIENT_SSL_KEYSTORE_CERTIFICATE_CHAIN",
    "ssl.keystore.key": "STRATA_CLIENT_SSL_KEYSTORE_KEY",
    "ssl.check.hostname": "STRATA_CLIENT_SSL_CHECK_HOSTNAME",
}
#: a Secrets Manager secret (ARN) whose JSON object holds any of those settings by their
#: Kafka names: how a Lambda function, which has no secrets in its environment, gets them
CLIENT_SECRET_ENV = "STRATA_CLIENT_SECRET_ARN"
SECRET_TIMEOUT_S = 5.0


def client_security(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The security settings ``env`` (default: the process's environment) names in
    ``CLIENT_SECURITY_ENV``, over those of the secret ``STRATA_CLIENT_SECRET_ARN`` names (also
    what ``sdk.admin.Admin`` takes as its ``config``)."""
    env = os.environ if env is None else env
    out = dict(_secret_settings(env[CLIENT_SECRET_ENV])) if env.get(CLIENT_SECRET_ENV) else {}
    out.update({key: env[name] for key, name in CLIENT_SECURITY_ENV.items() if env.get(name)})
    return out


@functools.lru_cache(maxsize=4)
def _secret_settings(arn: str) -> tuple[tuple[str, str], ...]:
    """The client settings in the secret ``arn`` (read once per process; boto3's credentials,
    region and endpoint; a deadline of ``SECRET_TIMEOUT_S`` per attempt)."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    config = Config(
        connect_timeout=SECRET_TIMEOUT_S,
        read_timeout=SECRET_TIMEOUT_S,
        retries={"max_attempts": 3, "mode": "standard"},
    )
    try:
        text = boto3.client("secretsmanager", config=config).get_secret_value(SecretId=arn)[
            "SecretString"
        ]
    except (BotoCoreError, ClientError, KeyError) as exc:
        raise InvalidConfigError(f"cannot read the client secret {arn}: {exc}") from None
    try:
        values = json.loads(text)
    except ValueError:
        values = None
    if not isinstance(values, dict):
        raise InvalidConfigError(f"the client secret {arn} is not a JSON object")
    unknown = sorted(set(values) - set(CLIENT_SECURITY_ENV))
    if unknown:  # names only: values may be passwords
        raise InvalidConfigError(
            f"the client secret {arn} has settings a client does not take from it: {unknown}"
            f" (allowed: {sorted(CLIENT_SECURITY_ENV)})"
        )
    return tuple((k, str(v)) for k, v in values.items())


def client_config(
    bootstrap: str, settings: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``bootstrap.servers``, the security settings ``env`` (default: the process's
    environment) names in ``CLIENT_SECURITY_ENV``, then ``settings``."""
    out: dict[str, Any] = {"bootstrap.servers": bootstrap}
    out.update(client_security(env))
    out.update(settings or {})
    return out
