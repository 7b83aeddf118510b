"""The agent's settings from its command line and from ``STRATA_AGENT_*`` variables.

Secrets (``inter.agent.sasl.password``) must be able to stay off the command line, which any
process on the host can read (``/proc/<pid>/cmdline``): the environment gives them, a flag
overrides a variable, and a flag's default never hides a variable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from broker_agents.main import parse_args

ROOT = Path(__file__).resolve().parent.parent


def test_the_environment_gives_settings_and_the_command_line_overrides_them(
    tmp_path: Path,
) -> None:
    env = {
        "STRATA_AGENT_ZOOKEEPER_CONNECT": "zk1:2181/strata",
        "STRATA_AGENT_DATA_DIR": str(tmp_path / "env"),
        "STRATA_AGENT_INTER_AGENT_SASL_USERNAME": "agents",
        "STRATA_AGENT_INTER_AGENT_SASL_PASSWORD": "s3cret",
        "STRATA_AGENT_ZOOKEEPER_SESSION_TIMEOUT_MS": "9000",
        "STRATA_AGENT_LISTEN_PORT": "9092",
        "STRATA_AGENT_AUTO_REBALANCE_ENABLE": "true",
        "UNRELATED": "x",
    }
    cfg = parse_args([], env)
    assert cfg.zookeeper == "zk1:2181/strata"
    assert cfg.data_dir == tmp_path / "env"
    assert cfg.inter_agent_sasl_username == "agents"
    assert cfg.inter_agent_sasl_password is not None
    assert cfg.inter_agent_sasl_password.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(cfg)
    # flags not given keep the variables' values, not their own defaults
    assert cfg.session_timeout_ms == 9000
    assert cfg.listen_port == 9092
    assert cfg.auto_rebalance_enable is True

    over = parse_args(
        [
            "--zookeeper",
            "zk2:2181",
            "--data-dir",
            str(tmp_path / "flag"),
            "--session-timeout-ms",
            "4000",
            "--listen",
            "0.0.0.0:9093",
            "--config",
            "inter.agent.sasl.username=other",
        ],
        env,
    )
    assert over.zookeeper == "zk2:2181"
    assert over.data_dir == tmp_path / "flag"
    assert over.session_timeout_ms == 4000
    assert (over.listen_host, over.listen_port) == ("0.0.0.0", 9093)
    assert over.inter_agent_sasl_username == "other"
    assert over.inter_agent_sasl_password is not None  # still from the environment

    plain = parse_args(["--zookeeper", "zk:2181", "--data-dir", str(tmp_path)], {})
    assert (plain.listen_host, plain.listen_port, plain.agent_id) == ("127.0.0.1", 0, -1)
    assert plain.session_timeout_ms == 6000


def test_a_missing_zookeeper_or_data_dir_or_a_bad_listen_address_is_a_usage_error(
    tmp_path: Path,
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--data-dir", str(tmp_path)], {})
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        parse_args([], {"STRATA_AGENT_ZOOKEEPER_CONNECT": "zk:2181"})
    with pytest.raises(SystemExit) as exc:
        parse_args(["--zookeeper", "zk:2181", "--data-dir", str(tmp_path), "--listen", "h:x"], {})
    assert exc.value.code == 2


def test_a_bad_value_from_the_environment_is_refused_with_its_name(tmp_path: Path) -> None:
    """Through the real entry point: the process exits with the setting named, before it
    touches ZooKeeper or the disk."""
    env = {
        **os.environ,
        "STRATA_AGENT_ZOOKEEPER_CONNECT": "127.0.0.1:1",
        "STRATA_AGENT_DATA_DIR": str(tmp_path / "data"),
        "STRATA_AGENT_ZOOKEEPER_SESSION_TIMEOUT_MS": "soon",
    }
    run = subprocess.run(
        [sys.executable, "-m", "broker_agents.main"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "bad settings" in run.stderr and "zookeeper.session.timeout.ms" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "data").exists()
