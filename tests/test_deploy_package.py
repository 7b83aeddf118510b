"""What `sam build` would ship for the Lambda functions, and the agent image (#25).

The Lambda package is built as ``sam build`` builds it (``make build-AdminFunction`` →
``infra/lambda_package.py``, real wheels from the registry for arm64 / CPython 3.12) and then
read: every module the admin handler imports on this machine is in it, every native library is
for aarch64 and finds what it links against, and it fits Lambda's unzipped limit. The agent
image is built when a container builder answers here, and its Dockerfile linted (hadolint)
either way.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infra.lambda_package import (
    LAMBDA_UNZIPPED_LIMIT,
    ROOT,
    build,
    native_problems,
    package_bytes,
)

pytestmark = pytest.mark.slow

DOCKERFILE = ROOT / "infra" / "docker" / "Dockerfile"


def _imported_top_level(module: str) -> set[str]:
    """Top-level third-party and project modules importing ``module`` loads (not stdlib)."""
    code = (
        "import json, sys; before = set(sys.modules); import " + module + "; "
        "print(json.dumps(sorted({m.split('.')[0] for m in set(sys.modules) - before})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    loaded = set(json.loads(out))
    return {
        m
        for m in loaded
        if m not in sys.stdlib_module_names and not m.startswith("_") and m != "cython_runtime"
    }


def test_the_lambda_package_holds_what_the_handler_imports_for_arm64_within_the_limit(
    tmp_path: Path,
) -> None:
    artifacts = tmp_path / "AdminFunction"
    build(artifacts)
    shipped = {p.name.removesuffix(".py") for p in artifacts.iterdir()}
    wanted = _imported_top_level("handlers.admin")
    assert {"handlers", "sdk", "storage", "pyarrow", "pydantic", "kazoo"} <= wanted
    assert wanted <= shipped, f"missing from the package: {sorted(wanted - shipped)}"
    assert not {"broker_agents", "infra", "spark", "bench", "tests"} & shipped
    assert native_problems(artifacts) == []
    size = package_bytes(artifacts)
    print(f"Lambda package: {size / 1e6:.0f} MB unzipped")
    assert size <= LAMBDA_UNZIPPED_LIMIT


def _container_builder() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    try:
        return subprocess.run([docker, "info"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def test_the_agent_image_dockerfile_lints_clean_and_builds_where_a_builder_runs() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    lint = subprocess.run(
        [str(hadolint), str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    if _container_builder():
        built = subprocess.run(
            ["docker", "build", "-f", str(DOCKERFILE), "-t", "strata-agent:test", str(ROOT)],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert built.returncode == 0, built.stderr[-3000:]
