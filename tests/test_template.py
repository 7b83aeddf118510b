"""template.yaml: the SAM transform and cfn-lint pass offline; a broken copy fails.

``infra.template_check`` is what CI runs (through ``make test``); these tests also pin the
properties issue 8 asks of the template, on the transformed CloudFormation.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from infra.template_check import check, transform

ROOT = Path(__file__).resolve().parent.parent
TEXT = (ROOT / "template.yaml").read_text()


@pytest.fixture(scope="module")
def cfn() -> dict[str, Any]:
    out, problems = transform(TEXT)
    assert out is not None, problems
    return out


def test_template_transforms_and_lints_without_errors() -> None:
    problems = check(TEXT)
    assert [p for p in problems if p.level == "error"] == [], "\n".join(map(str, problems))


@pytest.mark.parametrize(
    ("pattern", "replacement", "rule"),
    [
        (r"Cluster: !Ref AgentCluster\n", "Cluster: !Ref AgentClusterGone\n", "E1020"),
        (r"!GetAtt AgentTaskRole\.Arn", "!GetAtt NoSuchRole.Arn", "E1010"),
        (r"\$\{DataBucket\.Arn\}/\$\{S3Prefix\}\*", "${DataBucket.Arn}/${NoPrefix}*", "E1019"),
        (r"ApiId: !Ref AdminApi", "ApiId: !Ref NoSuchApi", "sam"),
    ],
)
def test_a_dangling_reference_fails_the_check(pattern: str, replacement: str, rule: str) -> None:
    broken, n = re.subn(pattern, replacement, TEXT, count=1)
    assert n == 1, pattern
    errors = [p for p in check(broken) if p.level == "error"]
    assert errors, f"{replacement!r} was not caught"
    assert any(p.rule == rule for p in errors), errors


def _of_type(cfn: dict[str, Any], kind: str) -> dict[str, Any]:
    return {k: r for k, r in cfn["Resources"].items() if r["Type"] == kind}


def test_bucket_is_encrypted_private_tls_only_and_aborts_multipart(cfn: dict[str, Any]) -> None:
    props = cfn["Resources"]["DataBucket"]["Properties"]
    assert props["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert all(props["PublicAccessBlockConfiguration"].values())
    rules = props["LifecycleConfiguration"]["Rules"]
    assert any("AbortIncompleteMultipartUpload" in r for r in rules)
    statement = cfn["Resources"]["DataBucketPolicy"]["Properties"]["PolicyDocument"]["Statement"]
    assert any(
        s["Effect"] == "Deny" and s["Condition"]["Bool"]["aws:SecureTransport"] == "false"
        for s in statement
    )


def test_admin_api_is_iam_authorised(cfn: dict[str, Any]) -> None:
    routes = _of_type(cfn, "AWS::ApiGatewayV2::Route")
    if routes:
        assert all(r["Properties"]["AuthorizationType"] == "AWS_IAM" for r in routes.values())
    else:  # SAM renders the HTTP API as an OpenAPI body
        body = cfn["Resources"]["AdminApi"]["Properties"]["Body"]
        for methods in body["paths"].values():
            for op in methods.values():
                assert op["security"] == [{"AWS_IAM": []}]


def _statements(role: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for p in role["Properties"]["Policies"] for s in p["PolicyDocument"]["Statement"]]


def test_least_privilege_roles(cfn: dict[str, Any]) -> None:
    agent = _statements(cfn["Resources"]["AgentTaskRole"])
    actions = {
        a for s in agent for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
    }
    assert {"s3:PutObject", "s3:GetObject", "s3:DeleteObject", "s3:ListBucket"} <= actions
    assert not any("*" in a for a in actions)
    spark = _statements(cfn["Resources"]["SparkReadRole"])
    spark_actions = {s["Action"] for s in spark}
    assert spark_actions == {"s3:GetObject", "s3:ListBucket"}
    for s in agent + spark:  # every statement is scoped to the prefix
        resource = s["Resource"]
        text = str(resource)
        assert "S3Prefix" in text or s.get("Condition"), s


def test_agents_run_as_one_service_of_agent_count_tasks_with_a_wal_volume(
    cfn: dict[str, Any],
) -> None:
    services = {k: v for k, v in _of_type(cfn, "AWS::ECS::Service").items() if "Agent" in k}
    assert list(services) == ["AgentService"]
    assert services["AgentService"]["Properties"]["DesiredCount"] == {"Ref": "AgentCount"}
    assert cfn["Parameters"]["AgentCount"]["Type"] == "Number"
    agents = {
        k: v for k, v in _of_type(cfn, "AWS::ECS::TaskDefinition").items() if k.startswith("Agent")
    }
    assert list(agents) == ["AgentTaskDefinition"]
    props = agents["AgentTaskDefinition"]["Properties"]
    assert props["Volumes"] == [{"Name": "wal"}]
    container = props["ContainerDefinitions"][0]
    assert container["MountPoints"][0]["SourceVolume"] == "wal"
    command = container["Command"]
    assert {"Ref": "ZooKeeperConnect"} in command
    # identical tasks: no agent id (allocated, kept on the volume), replacement on
    assert "--agent-id" not in command
    assert "auto.rebalance.enable=true" in command
    assert any("agent.replace.after.ms" in str(c) for c in command)
    # the agent parses this command line
    from broker_agents.main import parse_args

    args = [
        c if isinstance(c, str) else re.sub(r"\$\{[^}]+\}", "1", str(c.get("Fn::Sub", "")))
        for c in command[3:]
    ]
    args[args.index("--zookeeper") + 1] = "127.0.0.1:2181"
    assert parse_args(args).agent_id == -1


def test_the_delay_scheduler_runs_as_a_fargate_service_with_no_bucket_access(
    cfn: dict[str, Any],
) -> None:
    service = cfn["Resources"]["SchedulerService"]["Properties"]
    assert service["LaunchType"] == "FARGATE" and service["DesiredCount"] >= 2
    td = cfn["Resources"]["SchedulerTaskDefinition"]["Properties"]
    command = td["ContainerDefinitions"][0]["Command"]
    assert command[:3] == ["python", "-m", "infra.event_source"]
    assert command[command.index("--function") + 1] == "handlers.scheduler:handler"
    env = {e["Name"]: e["Value"] for e in td["ContainerDefinitions"][0]["Environment"]}
    assert env["STRATA_ZOOKEEPER_CONNECT"] == {"Ref": "ZooKeeperConnect"}
    role = cfn["Resources"]["SchedulerTaskRole"]["Properties"]
    assert "ManagedPolicyArns" not in role
    assert "Policies" not in _resolve(role, secured=False)
    # secured, it may read its client settings and nothing else
    statements = [
        s for p in _resolve(role, True)["Policies"] for s in p["PolicyDocument"]["Statement"]
    ]
    assert [(s["Action"], s["Resource"]) for s in statements] == [
        ("secretsmanager:GetSecretValue", {"Ref": "ClientSecretArn"})
    ]


def _resolve(node: Any, secured: bool) -> Any:
    """``node`` as CloudFormation deploys it with ListenerSecurityProtocol SASL_SSL
    (``secured``) or PLAINTEXT: ``Fn::If`` on ``Secured`` taken, ``AWS::NoValue`` dropped."""
    if isinstance(node, dict):
        if set(node) == {"Fn::If"}:
            condition, yes, no = node["Fn::If"]
            assert condition == "Secured"
            return _resolve(yes if secured else no, secured)
        out = {k: _resolve(v, secured) for k, v in node.items()}
        return {k: v for k, v in out.items() if v != _NO_VALUE}
    if isinstance(node, list):
        return [x for x in (_resolve(v, secured) for v in node) if x != _NO_VALUE]
    return node


_NO_VALUE = {"Ref": "AWS::NoValue"}


def test_agents_listen_with_sasl_ssl_and_get_their_secrets_from_secrets_manager(
    cfn: dict[str, Any],
) -> None:
    """By default the listener is SASL_SSL with ACLs on; the certificate, key, CA and SCRAM
    password reach each agent task as environment variables from the agents' secret (never
    on the command line), under names the agent reads as the settings meant; only ECS may
    read that secret, and the scheduler and the functions read only the client secret."""
    from broker_agents.config import AgentConfig
    from sdk.config import CLIENT_SECRET_ENV

    params = cfn["Parameters"]
    assert params["ListenerSecurityProtocol"]["Default"] == "SASL_SSL"
    rule = cfn["Rules"]["SecretsWhenSecured"]
    asserted = [a["Assert"]["Fn::Not"][0]["Fn::Equals"][0] for a in rule["Assertions"]]
    assert asserted == [{"Ref": "AgentSecretArn"}, {"Ref": "ClientSecretArn"}]

    resources = cfn["Resources"]
    container = _resolve(resources["AgentTaskDefinition"]["Properties"], True)[
        "ContainerDefinitions"
    ][0]
    env = {e["Name"]: e["Value"] for e in container["Environment"]}
    secrets = {e["Name"]: e["ValueFrom"] for e in container["Secrets"]}
    settings = AgentConfig.env_values({name: "x" for name in [*env, *secrets]})
    assert {
        "listener.security.protocol", "authorizer.enable", "super.users",
        "inter.agent.sasl.username", "inter.agent.sasl.password", "ssl.check.hostname",
        "ssl.keystore.certificate.chain", "ssl.keystore.key", "ssl.truststore.certificates",
    } <= set(settings)  # fmt: skip
    assert env["STRATA_AGENT_LISTENER_SECURITY_PROTOCOL"] == {"Ref": "ListenerSecurityProtocol"}
    assert env["STRATA_AGENT_AUTHORIZER_ENABLE"] == "true"
    keys = {name: ref["Fn::Sub"] for name, ref in secrets.items()}
    assert keys == {
        "STRATA_AGENT_SSL_KEYSTORE_CERTIFICATE_CHAIN": "${AgentSecretArn}:certificate_chain::",
        "STRATA_AGENT_SSL_KEYSTORE_KEY": "${AgentSecretArn}:private_key::",
        "STRATA_AGENT_SSL_TRUSTSTORE_CERTIFICATES": "${AgentSecretArn}:ca_certificates::",
        "STRATA_AGENT_INTER_AGENT_SASL_PASSWORD": "${AgentSecretArn}:sasl_password::",
    }
    assert "Secret" not in str(container["Command"]) and "ssl" not in str(container["Command"])

    def secret_readers(secured: bool) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for name, r in resources.items():
            if r["Type"] != "AWS::IAM::Role":
                continue
            for policy in _resolve(r["Properties"], secured).get("Policies", []):
                for s in policy["PolicyDocument"]["Statement"]:
                    if "secretsmanager" in str(s["Action"]):
                        out.setdefault(name, []).append(s["Resource"])
        return out

    assert secret_readers(True) == {
        "AgentExecutionRole": [{"Ref": "AgentSecretArn"}],
        "SchedulerTaskRole": [{"Ref": "ClientSecretArn"}],
        "AdminFunctionRole": [{"Ref": "ClientSecretArn"}],
    }
    assert secret_readers(False) == {}
    # no other task is run by the role that may read the agents' secret
    runs = [
        name
        for name, r in _of_type(cfn, "AWS::ECS::TaskDefinition").items()
        if r["Properties"]["ExecutionRoleArn"] == {"Fn::GetAtt": ["AgentExecutionRole", "Arn"]}
    ]
    assert runs == ["AgentTaskDefinition"]
    # PLAINTEXT: no secrets handed out, no ACLs
    plain = _resolve(resources["AgentTaskDefinition"]["Properties"], False)
    assert "Secrets" not in plain["ContainerDefinitions"][0]
    function_env = resources["AdminFunction"]["Properties"]["Environment"]["Variables"]
    assert _resolve(function_env, True)[CLIENT_SECRET_ENV] == {"Ref": "ClientSecretArn"}
    assert _resolve(function_env, False)[CLIENT_SECRET_ENV] == ""


def test_admin_api_checks_acls_by_default_and_needs_a_super_user(cfn: dict[str, Any]) -> None:
    """The admin function runs with the ACL checks on unless the operator says 0, and the
    stack refuses to deploy with them on and no super user (nobody could grant the first
    ACL); the values the template passes are ones ``handlers.access`` reads as meant."""
    from handlers.access import AccessConfig

    params = cfn["Parameters"]
    env = cfn["Resources"]["AdminFunction"]["Properties"]["Environment"]["Variables"]
    assert env["STRATA_ADMIN_AUTHORIZER"] == {"Ref": "AdminAuthorizer"}
    assert env["STRATA_SUPER_USERS"] == {"Ref": "AdminSuperUsers"}
    assert params["AdminAuthorizer"]["Default"] == "1"
    rule = cfn["Rules"]["SuperUsersWhenAuthorizing"]
    assert rule["RuleCondition"] == {"Fn::Equals": [{"Ref": "AdminAuthorizer"}, "1"]}
    assert rule["Assertions"][0]["Assert"] == {
        "Fn::Not": [{"Fn::Equals": [{"Ref": "AdminSuperUsers"}, ""]}]
    }
    pattern = re.compile(params["AdminSuperUsers"]["AllowedPattern"])
    supers = "User:arn:aws:iam::123456789012:role/ops,User:alice"
    assert pattern.fullmatch(supers) and not pattern.fullmatch("alice")
    on = AccessConfig.from_env({"STRATA_ADMIN_AUTHORIZER": "1", "STRATA_SUPER_USERS": supers})
    assert on.enabled and "User:alice" in on.super_users
    assert not AccessConfig.from_env({"STRATA_ADMIN_AUTHORIZER": "0"}).enabled
