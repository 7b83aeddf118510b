"""Every change to an agent's data directory goes through ``storage.wal.fileio.fs``.

The power-loss model (``storage.wal.crashfs``) and the injected disk faults sit in that seam;
a write, fsync, rename or removal that bypassed it would be invisible to them, and a power
loss test would pass while the real disk lost data. So no module of ``storage/`` or
``broker_agents/`` other than the seam itself calls the ``os``, ``shutil`` or ``pathlib``
functions that change files, or opens a file for writing.
"""

from __future__ import annotations

import ast
import gc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEAM = {ROOT / "storage/wal/fileio.py", ROOT / "storage/wal/crashfs.py"}
OS = {
    "open", "pwrite", "pwritev", "write", "writev", "ftruncate", "truncate", "fsync",
    "fdatasync", "replace", "rename", "renames", "unlink", "remove", "mkdir", "makedirs",
    "rmdir", "removedirs", "link", "symlink", "posix_fallocate",
}  # fmt: skip
SHUTIL = {"rmtree", "move", "copy", "copy2", "copyfile", "copytree"}
PATH_METHODS = {
    "unlink", "mkdir", "rmdir", "write_bytes", "write_text", "touch", "rename",
    "symlink_to", "hardlink_to",
}  # fmt: skip


def _through_the_seam(func: ast.Attribute) -> bool:
    """``fileio.fs.<op>(...)``"""
    v = func.value
    return isinstance(v, ast.Attribute) and v.attr == "fs"


def _parse(source: str) -> ast.Module:
    """``ast.parse`` with the collector off: on Python 3.11 a finalizer that runs inside it
    and formats a traceback (asyncio logging a leftover future of an earlier test in this
    worker) parses again and fails the outer parse with "AST constructor recursion depth
    mismatch" (CPython gh-106905)."""
    gc.disable()
    try:
        return ast.parse(source)
    finally:
        gc.enable()


def changes_to_files(source: str, name: str) -> list[str]:
    """``name:line: call`` of every call in ``source`` that changes files outside the seam."""
    found = []
    for node in ast.walk(_parse(source)):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        what = ""
        if isinstance(fn, ast.Attribute) and not _through_the_seam(fn):
            owner = fn.value.id if isinstance(fn.value, ast.Name) else ""
            if (owner == "os" and fn.attr in OS) or (owner == "shutil" and fn.attr in SHUTIL):
                what = f"{owner}.{fn.attr}"
            elif owner not in ("os", "shutil") and fn.attr in PATH_METHODS:
                what = f".{fn.attr}"
        elif isinstance(fn, ast.Name) and fn.id == "open":
            modes = [a for a in node.args[1:2]] + [
                k.value for k in node.keywords if k.arg == "mode"
            ]
            mode = modes[0].value if modes and isinstance(modes[0], ast.Constant) else "?"
            if not isinstance(mode, str) or set(mode) & set("wax+?"):
                what = f"open(..., {mode!r})"
        if what:
            found.append(f"{name}:{node.lineno}: {what}")
    return found


def test_only_the_seam_changes_files_under_the_data_directory() -> None:
    files = sorted((ROOT / "storage").rglob("*.py")) + sorted(
        (ROOT / "broker_agents").rglob("*.py")
    )
    assert len(files) > 20
    bypasses = [
        hit
        for f in files
        if f not in SEAM
        for hit in changes_to_files(f.read_text(), str(f.relative_to(ROOT)))
    ]
    assert bypasses == []


def test_the_check_sees_a_bypass() -> None:
    source = (
        "import os, shutil\n"
        "from pathlib import Path\n"
        "os.fsync(3)\n"
        "shutil.rmtree('x')\n"
        "Path('x').unlink()\n"
        "open('x', 'ab')\n"
        "open('x', 'rb')\n"
        "fileio.fs.unlink(Path('x'))\n"
    )
    hits = [h.split(": ", 1)[1] for h in changes_to_files(source, "sample.py")]
    assert hits == ["os.fsync", "shutil.rmtree", ".unlink", "open(..., 'ab')"]
