"""Filters over records' tags and headers: parse once, test batches by summary, records by Arrow.

``parse("tag IN ('a', 'b') AND header.region = 'eu'")`` gives a :class:`Filter`;
``parse_tags("TagA || TagB")`` reads RocketMQ's tag expressions. The grammar is in
``parser`` and ``docs/filters.md``; the AST and its canonical text in ``expr``; evaluation on
batch summaries and on decoded records in ``evaluate``; the agent's filtered pass over stored
batches in ``scan``. Pure: no I/O. Shared by the SDK (consumer, replay), the agents and Spark.
"""

from __future__ import annotations

from typing import Any

from storage.errors import InvalidFilterError
from storage.filters.evaluate import Filter, Verdict
from storage.filters.parser import MAX_LENGTH, parse_expr, parse_tags_expr
from storage.filters.scan import (
    FilterScan,
    Selection,
    classify,
    matching,
    selection_bitmap,
    selection_mask,
)


def parse(source: str) -> Filter:
    """The filter of an expression; ``InvalidFilterError`` (with ``position``) if it is wrong."""
    return Filter(parse_expr(source))


def parse_tags(source: str) -> Filter | None:
    """RocketMQ's ``"TagA || TagB"`` (None for ``"*"``: every record)."""
    expr = parse_tags_expr(source)
    return None if expr is None else Filter(expr)


def as_filter(value: Any) -> Filter | None:
    """A ``Filter`` from a ``Filter``, an expression string, or None."""
    if value is None or isinstance(value, Filter):
        return value
    if isinstance(value, str):
        return parse(value)
    raise InvalidFilterError(f"a filter is an expression string, not {type(value).__name__}")


__all__ = [
    "MAX_LENGTH",
    "Filter",
    "FilterScan",
    "InvalidFilterError",
    "Selection",
    "Verdict",
    "as_filter",
    "classify",
    "matching",
    "parse",
    "parse_tags",
    "selection_bitmap",
    "selection_mask",
]
