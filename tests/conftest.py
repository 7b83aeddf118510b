"""Session-wide checks and fixtures shared by every test module."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import google_crc32c
import pytest
from kazoo.client import KazooClient

import storage.crc
from infra.moto_s3 import MotoServer, start_moto
from infra.zookeeper import ZooKeeperEnsemble, ZooKeeperServer, start_ensemble, start_zookeeper
from tests.harness import (
    ProcessGroup,
    S3Target,
    ZooKeeperChroot,
    close_client,
    create_chroot,
    delete_chroot,
    give_kazoo_its_own_random,
    kazoo_client,
    new_s3_target,
    restore_ensemble,
)


@pytest.fixture(scope="session", autouse=True)
def _c_accelerated_crc32c() -> None:
    """Every produce and fetch runs CRC32C; on the pure-Python fallback it is ~1000x slower."""
    assert google_crc32c.implementation == "c", "google-crc32c runs without its C extension"
    assert storage.crc.IMPLEMENTATION == "c", "storage.crc is not on the C implementation"


# ---------------------------------------------------------------- real servers (tests/harness.py)


def pytest_configure(config: pytest.Config) -> None:
    give_kazoo_its_own_random()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    """Keep each phase's report on the item, so fixtures can tell whether the test failed."""
    report = yield
    setattr(item, f"_report_{report.when}", report)
    return report


def _failed(request: pytest.FixtureRequest) -> bool:
    return any(
        getattr(getattr(request.node, f"_report_{when}", None), "failed", False)
        for when in ("setup", "call")
    )


@pytest.fixture(scope="session")
def zk_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperServer]:
    """One real ZooKeeper server (pyspark's jars, the machine's Java) for the whole session."""
    with start_zookeeper(tmp_path_factory.mktemp("zookeeper")) as server:
        yield server


@pytest.fixture
def zk_chroot(
    zk_server: ZooKeeperServer, request: pytest.FixtureRequest
) -> Iterator[ZooKeeperChroot]:
    """This test's own chroot (created empty, deleted recursively afterwards).

    ``.connect_string`` is ``host:port/strata-test/<test>-<hex>``. The admin client that
    creates and deletes it lives only as long as the test (no kazoo thread between tests).
    """
    admin = kazoo_client(zk_server.connect_string)
    try:
        chroot = create_chroot(admin, zk_server.connect_string, request.node.name)
        yield chroot
        # the test's processes stop before their chroot goes: fixtures are torn down in the
        # reverse order of their setup, and a fixture that asks for ``processes`` before
        # ``zk_chroot`` would leave live agents adding nodes under a chroot being deleted
        group = request.node.funcargs.get("processes")
        if isinstance(group, ProcessGroup):
            group.close()
        delete_chroot(admin, chroot)
    finally:
        close_client(admin)


@pytest.fixture
def zk_client(zk_chroot: ZooKeeperChroot) -> Iterator[KazooClient]:
    """A connected kazoo client on this test's chroot; stopped (session closed) afterwards."""
    client = kazoo_client(zk_chroot.connect_string)
    yield client
    close_client(client)


@pytest.fixture(scope="module")
def zk_ensemble(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperEnsemble]:
    """Three ZooKeeper servers forming a quorum, fresh for each module that asks for them
    (tests kill, stop and restart members; see ``zk_ensemble_chroot``)."""
    with start_ensemble(tmp_path_factory.mktemp("zk-ensemble")) as ensemble:
        yield ensemble


@pytest.fixture
def zk_ensemble_chroot(
    zk_ensemble: ZooKeeperEnsemble, request: pytest.FixtureRequest
) -> Iterator[ZooKeeperChroot]:
    """This test's own chroot on the ensemble, whose three members all serve when the test
    starts (whatever an earlier test of the module left down is restarted).

    ``.connect_string`` lists the three members: ``h:p1,h:p2,h:p3/strata-test/<test>-<hex>``.
    """
    restore_ensemble(zk_ensemble)
    admin = kazoo_client(zk_ensemble.connect_string)
    try:
        chroot = create_chroot(admin, zk_ensemble.connect_string, request.node.name)
    finally:
        close_client(admin)  # its session would not outlive the test's faults
    yield chroot
    restore_ensemble(zk_ensemble)
    admin = kazoo_client(zk_ensemble.connect_string)
    try:
        delete_chroot(admin, chroot)
    finally:
        close_client(admin)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto server (a separate process) for the whole session."""
    with start_moto(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture
def s3(s3_server: MotoServer, request: pytest.FixtureRequest) -> Iterator[S3Target]:
    """moto emptied, then a fresh bucket for this test; ``.client`` is a boto3 S3 client."""
    s3_server.reset()
    target = new_s3_target(s3_server.endpoint_url, request.node.name)
    yield target
    target.client.close()


@pytest.fixture
def s3_credentials(s3: S3Target, monkeypatch: pytest.MonkeyPatch) -> S3Target:
    """The test bucket's AWS credentials and region in this process's environment (an
    ``ObjectStore`` built in the test finds them there); the endpoint is left to the test."""
    for k, v in s3.env().items():
        if k.startswith("AWS_") and "ENDPOINT" not in k:
            monkeypatch.setenv(k, v)
    return s3


@pytest.fixture
def processes(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ProcessGroup]:
    """Child processes of this test (logs in ``tmp_path/processes``); all stopped afterwards.

    On failure the children's log tails are printed (shown in the test's teardown output).
    """
    group = ProcessGroup(tmp_path / "processes")
    try:
        yield group
    finally:
        if _failed(request) and list(group):
            print(group.describe(), file=sys.stderr)
        group.close()
