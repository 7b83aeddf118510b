"""A secured cluster set up the way ``template.yaml`` sets one up on AWS, on loopback.

There, no certificate or password is a file: ECS hands each agent task its TLS material and
its SCRAM login as environment variables (from a Secrets Manager secret), and the scheduler
and the Lambda functions read their client settings from a secret at start
(``STRATA_CLIENT_SECRET_ARN``). Here:

* two real agents get only environment variables (PEM text, Kafka's KIP-651 names), serve
  SASL_SSL with ACLs on, and replicate to each other as their own super user (acks=all, RF 2);
* a client whose every security setting comes from a secret in moto's Secrets Manager
  produces and consumes; one without them is refused;
* bad material is refused at start with a typed error that does not show it.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path
from typing import Any

import boto3
import pytest
from pydantic import SecretStr

from broker_agents.config import AgentConfig
from infra.certs import ThrowawayCA
from infra.local import REGION
from infra.moto_s3 import MotoServer
from sdk import Consumer, Producer
from sdk.auth import ScramLogin
from sdk.config import ClientConfig, client_config
from storage.errors import InvalidConfigError, StrataError
from storage.tls import TlsFiles, client_context, inline_pem_files
from tests.cluster import Cluster, read_records
from tests.harness import ProcessGroup, ZooKeeperChroot
from tests.test_security_sasl import _add_users

PASSWORDS = {"strata-agents": "agents-pass-2c7e", "strata-service": "service-pass-8d1f"}


def _pem(path: Path) -> str:
    return path.read_text()


@pytest.fixture
def aws(s3_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A Secrets Manager client on moto; this process's boto3 pointed at it too."""
    s3_server.reset()
    env = {
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
        "AWS_ACCESS_KEY_ID": "local",
        "AWS_SECRET_ACCESS_KEY": "local",
        "AWS_DEFAULT_REGION": REGION,
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return boto3.client("secretsmanager", endpoint_url=s3_server.endpoint_url, region_name=REGION)


@pytest.mark.slow
def test_agents_and_clients_secured_from_secrets_alone(
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    tmp_path: Path,
    aws: Any,
) -> None:
    ca = ThrowawayCA.create(tmp_path / "ca")
    _add_users(zk_chroot, PASSWORDS)
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    c.client_ssl = client_context(TlsFiles(cafile=str(ca.cafile), check_hostname=False))
    c.client_login = ScramLogin("SCRAM-SHA-512", "strata-agents", PASSWORDS["strata-agents"])
    for i in (1, 2):
        issued = ca.issue(f"agent-{i}")
        env = {  # what the template's AgentTaskDefinition gives a task, nothing else
            **os.environ,
            "STRATA_AGENT_SSL_KEYSTORE_CERTIFICATE_CHAIN": _pem(issued.certfile),
            "STRATA_AGENT_SSL_KEYSTORE_KEY": _pem(issued.keyfile),
            "STRATA_AGENT_SSL_TRUSTSTORE_CERTIFICATES": _pem(ca.cafile),
            "STRATA_AGENT_INTER_AGENT_SASL_USERNAME": "strata-agents",
            "STRATA_AGENT_INTER_AGENT_SASL_PASSWORD": PASSWORDS["strata-agents"],
        }
        c.start_agent(
            i,
            "listener.security.protocol=SASL_SSL",
            "ssl.check.hostname=false",
            "authorizer.enable=true",
            "super.users=User:strata-agents;User:strata-service",
            env=env,
        )
    c.create_topic("t", 1, replication_factor=2, configs={"min.insync.replicas": 2})
    c.wait_for_leaders("t")
    secret = aws.create_secret(
        Name="strata/client",
        SecretString=json.dumps(
            {
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": "SCRAM-SHA-512",
                "sasl.username": "strata-service",
                "sasl.password": PASSWORDS["strata-service"],
                "ssl.truststore.certificates": _pem(ca.cafile),
                "ssl.check.hostname": "false",
            }
        ),
    )
    conf = client_config(
        c.bootstrap,
        {"request.timeout.ms": 5000, "acks": "all"},
        env={"STRATA_CLIENT_SECRET_ARN": secret["ARN"]},
    )
    assert conf["sasl.password"] == PASSWORDS["strata-service"]

    async def run() -> None:
        async with Producer(conf) as producer:
            futs = [await producer.send("t", b"v%d" % i, partition=0) for i in range(10)]
            await producer.flush()
        # acks=all, min.insync.replicas=2: the follower fetched them over SASL_SSL
        assert [f.result().offset for f in futs] == list(range(10))
        read_conf = {k: v for k, v in conf.items() if k != "acks"}
        async with Consumer(read_conf | {"auto.offset.reset": "earliest"}) as consumer:
            consumer.assign([("t", 0)])
            got = await read_records(consumer, 10)
        assert [r.value for r in got] == [b"v%d" % i for i in range(10)]
        # the same listener refuses a client that does not log in
        anonymous = {
            "bootstrap.servers": c.bootstrap,
            "security.protocol": "SSL",
            "ssl.truststore.certificates": _pem(ca.cafile),
            "ssl.check.hostname": False,
            "request.timeout.ms": 3000,
            "retries": 0,
            "max.block.ms": 3000,
        }
        with pytest.raises(StrataError):
            async with Producer(anonymous) as p:
                await (await p.send("t", b"nope", partition=0))

    asyncio.run(run())
    for agent in c.agents.values():  # neither the key nor a password in the logs
        log = agent.process.log_text()
        assert "PRIVATE KEY" not in log and PASSWORDS["strata-agents"] not in log


def test_a_secret_with_settings_a_client_does_not_take_is_refused_by_name(aws: Any) -> None:
    arn = aws.create_secret(
        Name="strata/odd", SecretString=json.dumps({"sasl.password": "p-91", "acks": "0"})
    )["ARN"]
    with pytest.raises(InvalidConfigError, match=r"\['acks'\]") as err:
        client_config("h:1", env={"STRATA_CLIENT_SECRET_ARN": arn})
    assert "p-91" not in str(err.value)
    with pytest.raises(InvalidConfigError, match="cannot read the client secret"):
        client_config("h:1", env={"STRATA_CLIENT_SECRET_ARN": arn + "-gone"})


def test_pem_text_is_written_private_and_checked(tmp_path: Path) -> None:
    ca = ThrowawayCA.create(tmp_path / "ca")
    issued = ca.issue("agent")
    paths = inline_pem_files(_pem(issued.certfile), _pem(issued.keyfile), _pem(ca.cafile))
    assert Path(paths["keyfile"]).read_text() == _pem(issued.keyfile)
    assert stat.S_IMODE(os.stat(paths["keyfile"]).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(Path(paths["keyfile"]).parent).st_mode) == 0o700
    # the same material is written once per process
    assert inline_pem_files(_pem(issued.certfile), _pem(issued.keyfile), _pem(ca.cafile)) == paths

    base = {"zookeeper.connect": "zk:2181", "data.dir": str(tmp_path)}
    config = AgentConfig.parse(
        base
        | {
            "ssl.keystore.certificate.chain": _pem(issued.certfile),
            "ssl.keystore.key": _pem(issued.keyfile),
        }
    )
    assert Path(config.tls_files.certfile or "").read_text() == _pem(issued.certfile)
    assert "PRIVATE" not in repr(config)
    with pytest.raises(InvalidConfigError, match="not both"):
        AgentConfig.parse(
            base | {"ssl.cafile": "/x", "ssl.truststore.certificates": _pem(ca.cafile)}
        )
    with pytest.raises(InvalidConfigError, match="not PEM") as err:
        ClientConfig.parse(
            {
                "bootstrap.servers": "h:1",
                "security.protocol": "SSL",
                "ssl.keystore.certificate.chain": _pem(issued.certfile),
                "ssl.keystore.key": SecretStr("hunter2-not-a-key"),
            }
        )
    assert "hunter2" not in str(err.value)
