"""Build the Lambda functions' code directory, the way ``sam build`` asks for it.

``template.yaml`` declares the functions with ``BuildMethod: makefile``: ``sam build`` runs
``make build-<Function>`` with ``ARTIFACTS_DIR`` set, and that target runs this module. It
puts into ``ARTIFACTS_DIR``:

* the packages the handlers import — ``handlers``, ``sdk``, ``storage`` (not the agents, the
  CLI, Spark or the benchmarks);
* their third-party dependencies (``REQUIREMENTS``) at the versions of the lock
  (``constraints.txt``), as wheels for the functions' platform (``arm64``, CPython 3.12,
  ``--only-binary=:all:``), so the package is the same whatever machine builds it;
* minus what the handlers never load and Lambda's 250 MB (unzipped) limit cannot afford
  (``PRUNE``: pyarrow's tests, headers, Arrow Flight and the copies of versioned libraries).

Why Python 3.12 on Lambda while the project targets 3.11: the lock's pyarrow ships Linux
wheels for glibc 2.28 and later; Lambda's ``python3.11`` runtime runs on Amazon Linux 2
(glibc 2.26), ``python3.12`` on Amazon Linux 2023 (glibc 2.34).

``tests/test_deploy_package.py`` builds it and checks what it would ship, without an aarch64
machine: every module the handlers import is there, every native library is for aarch64 and
finds each library it links against in the package or in the runtime's base system
(``native_problems``), and the whole fits in 250 MB.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("handlers", "sdk", "storage")
"""First-party packages the functions need (``handlers`` imports only ``sdk`` and ``storage``)."""
REQUIREMENTS = (
    "pydantic",
    "kazoo",
    "pyarrow",
    "numpy",
    "google-crc32c",
    "python-json-logger",
    "scramp",  # the admin API's /users route salts SCRAM credentials (and its asn1crypto)
)
"""Third-party distributions the handlers import (versions from ``constraints.txt``)."""
PLATFORMS = ("manylinux2014_aarch64", "manylinux_2_28_aarch64")
PYTHON_VERSION = "3.12"
LAMBDA_UNZIPPED_LIMIT = 250 * 1000 * 1000
PRUNE = (
    "bin",
    "pyarrow/tests",
    "pyarrow/include",
    "pyarrow/src",
    "pyarrow/_flight.*.so",
    "pyarrow/flight.py",
    "pyarrow/libarrow_flight.so*",
    "pyarrow/libarrow_python_flight.so*",
    "pyarrow/_pyarrow_cpp_tests.*.so",
    "pyarrow/libarrow_python.so",
    "pyarrow/libarrow_python.so.*.*.*",
    "pyarrow/libarrow_python_parquet_encryption.so",
    "pyarrow/libarrow_python_parquet_encryption.so.*.*.*",
    "numpy/_core/tests",
    "numpy/tests",
)
"""Globs (under the artifacts directory) removed after the install."""
SYSTEM_LIBRARIES = frozenset(
    {
        "libc.so.6", "libm.so.6", "libdl.so.2", "librt.so.1", "libpthread.so.0",
        "libstdc++.so.6", "libgcc_s.so.1", "ld-linux-aarch64.so.1", "libutil.so.1", "libz.so.1",
    }
)  # fmt: skip
"""What Amazon Linux 2023 (the python3.12 runtime) provides to native extensions."""
EM_AARCH64 = 183


def build(artifacts: Path) -> None:
    artifacts.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--target",
            str(artifacts),
            *platforms,
            "--implementation",
            "cp",
            "--python-version",
            PYTHON_VERSION,
            "--only-binary=:all:",
            "--upgrade",
            "-c",
            str(ROOT / "constraints.txt"),
            *REQUIREMENTS,
        ],
        check=True,
        timeout=900,
    )
    for pattern in PRUNE:
        for path in artifacts.glob(pattern):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    for cache in list(artifacts.rglob("__pycache__")):
        shutil.rmtree(cache, ignore_errors=True)
    for name in PACKAGES:
        target = artifacts / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(ROOT / name, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def elf_info(path: Path) -> tuple[int, list[str]]:
    """(machine, NEEDED libraries) of a 64-bit little-endian ELF shared object."""
    data = path.read_bytes()
    if data[:6] != b"\x7fELF\x02\x01":
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    machine = int.from_bytes(data[18:20], "little")
    shoff = int.from_bytes(data[40:48], "little")
    shentsize = int.from_bytes(data[58:60], "little")
    shnum = int.from_bytes(data[60:62], "little")
    sections = []
    for i in range(shnum):
        h = data[shoff + i * shentsize : shoff + (i + 1) * shentsize]
        kind = int.from_bytes(h[4:8], "little")
        offset, size = int.from_bytes(h[24:32], "little"), int.from_bytes(h[32:40], "little")
        link = int.from_bytes(h[40:44], "little")
        sections.append((kind, offset, size, link))
    needed: list[str] = []
    for kind, offset, size, link in sections:
        if kind != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link][1]
        for pos in range(offset, offset + size, 16):
            tag = int.from_bytes(data[pos : pos + 8], "little")
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                at = strtab + int.from_bytes(data[pos + 8 : pos + 16], "little")
                needed.append(data[at : data.index(b"\0", at)].decode())
    return machine, needed


def native_problems(artifacts: Path) -> list[str]:
    """What would fail to load on the functions' platform: a native library built for another
    machine, or one that links against a library neither in the package nor in the base
    system."""
    libraries = [p for p in artifacts.rglob("*.so*") if p.is_file() and ".so" in p.name]
    names = {p.name for p in libraries}
    problems = []
    for lib in libraries:
        machine, needed = elf_info(lib)
        if machine != EM_AARCH64:
            problems.append(f"{lib.relative_to(artifacts)}: built for machine {machine}")
        for name in needed:
            if name not in names and name not in SYSTEM_LIBRARIES:
                problems.append(f"{lib.relative_to(artifacts)}: needs {name}, not packaged")
    return problems


def package_bytes(artifacts: Path) -> int:
    return sum(p.stat().st_size for p in artifacts.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the Lambda functions' code directory")
    parser.add_argument("artifacts", type=Path, help="sam build's ARTIFACTS_DIR")
    args = parser.parse_args(argv)
    build(args.artifacts)
    problems = native_problems(args.artifacts)
    size = package_bytes(args.artifacts)
    if size > LAMBDA_UNZIPPED_LIMIT:
        problems.append(f"{size:,} bytes unzipped, over Lambda's {LAMBDA_UNZIPPED_LIMIT:,}")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
