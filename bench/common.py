"""What every benchmark does with its result: print it, save the JSON, rewrite its section of
the docs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "benchmarks.md"


def save_result(name: str, result: Any) -> Path:
    """``bench/results/<name>.json`` (git-ignored)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2))
    return path


def write_docs_section(marker: str, section: str) -> None:
    """Replace ``<!-- {marker}:begin ... {marker}:end -->`` in docs/benchmarks.md by ``section``."""
    text = DOC.read_text()
    pattern = re.compile(
        rf"<!-- {re.escape(marker)}:begin.*?<!-- {re.escape(marker)}:end -->", re.S
    )
    if not pattern.search(text):
        raise SystemExit(f"docs/benchmarks.md has no {marker} markers")
    DOC.write_text(pattern.sub(lambda _: section, text))


def publish(name: str, table: str, result: Any, *, write_docs: bool) -> None:
    """Print ``table``, save ``result`` as ``bench/results/<name>.json`` (keys starting with
    ``_`` left out: raw samples) and, with ``write_docs``, put ``table`` in place of the
    ``<name>-bench`` section of docs/benchmarks.md."""
    print(table)
    if isinstance(result, dict):
        result = {k: v for k, v in result.items() if not str(k).startswith("_")}
    save_result(name, result)
    if write_docs:
        write_docs_section(f"{name}-bench", table)
