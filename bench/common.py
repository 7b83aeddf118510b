"""What every benchmark does with its result: save the JSON, rewrite its section of the docs."""

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
