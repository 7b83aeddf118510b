"""Evaluating a filter: on a batch's summary (can it match? does all of it?) and on its records.

``Filter`` is a parsed expression with what evaluation needs precomputed (tag and header
values as bytes and as Arrow arrays). Two questions, asked of every batch a filtered read
passes:

* :meth:`Filter.classify` — from the batch summary (``storage.codec.summary``) alone:
  ``SKIP`` (no record can match), ``WHOLE`` (every record matches) or ``DECODE`` (the
  summary cannot tell: some records may match). Each node answers a pair (*may*: some record
  may match, *all*: every record surely matches), combined soundly: NOT swaps and negates
  them, AND/OR combine them with all()/any(). A test on what the summary does not list (a
  section left out, a version 1 batch without a summary) answers "may, not all". So SKIP and
  WHOLE are always right; DECODE only costs work.
* :meth:`Filter.mask` — over decoded records (an Arrow record batch of ``codec.SCHEMA``):
  a numpy boolean per record, computed with Arrow kernels on the flattened tag and header
  lists (``is_in``, ``equal``) and scattered to records by their list offsets; no Python code
  runs per record.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.codec.summary import Summary
from storage.filters.expr import And, Expr, HasHeader, Header, Not, Or, Tag, text


class Verdict(enum.Enum):
    SKIP = "skip"
    WHOLE = "whole"
    DECODE = "decode"


_UNKNOWN = (True, False)
_NEVER = (False, False)


def _uses_headers(e: Expr) -> bool:
    if isinstance(e, Header | HasHeader):
        return True
    if isinstance(e, Not):
        return _uses_headers(e.item)
    if isinstance(e, And | Or):
        return any(_uses_headers(i) for i in e.items)
    return False


def _children(values: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, pa.Array, int]:
    """(record index of each list element, the elements, records) of a list column."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    n = len(values)
    offsets = np.frombuffer(
        values.buffers()[1], dtype=np.int32, count=n + 1, offset=4 * values.offset
    ).astype(np.int64)
    parents = np.repeat(np.arange(n, dtype=np.int64), np.diff(offsets))
    child = values.values.slice(int(offsets[0]), int(offsets[n] - offsets[0]))
    return parents, child, n


def _scatter(parents: np.ndarray, hit: pa.Array, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=bool)
    out[parents[np.asarray(hit.to_numpy(zero_copy_only=False), dtype=bool)]] = True
    return out


SummaryTest = Callable[[Summary], tuple[bool, bool]]
MaskTest = Callable[[pa.RecordBatch], np.ndarray]


def _tag_summary(values: frozenset[bytes]) -> SummaryTest:
    def test(s: Summary) -> tuple[bool, bool]:
        if s.tags is None:
            return _NEVER if s.untagged == s.records else _UNKNOWN
        hits = [s.tags[v] for v in values if v in s.tags]
        if not hits:
            return _NEVER
        every = any(c == s.records for c in hits) or (
            s.untagged == 0 and all(t in values for t in s.tags)
        )
        return True, every

    return test


def _header_summary(key: bytes, values: frozenset[bytes] | None) -> SummaryTest:
    """``values`` None: the key is present (``HasHeader``)."""

    def test(s: Summary) -> tuple[bool, bool]:
        if s.headers is None:
            return _UNKNOWN
        ks = s.headers.get(key)
        if ks is None:
            return _NEVER
        if values is None:
            return True, ks.records == s.records
        if ks.values is None:
            return _UNKNOWN
        hits = [ks.values[v] for v in values if v in ks.values]
        if not hits:
            return _NEVER
        every = any(c == s.records for c in hits) or (
            ks.records == s.records and all(v in values for v in ks.values)
        )
        return True, every

    return test


def _tag_mask(values: pa.Array) -> MaskTest:
    def test(rb: pa.RecordBatch) -> np.ndarray:
        parents, child, n = _children(rb.column("tags"))
        return _scatter(parents, pc.is_in(child, value_set=values), n)

    return test


def _header_mask(key: str, values: pa.Array | None) -> MaskTest:
    def test(rb: pa.RecordBatch) -> np.ndarray:
        parents, pairs, n = _children(rb.column("headers"))
        hit = pc.equal(pairs.field("key"), key)
        if values is not None:
            hit = pc.and_(hit, pc.is_in(pairs.field("value"), value_set=values))
        return _scatter(parents, hit, n)

    return test


def _compile(e: Expr) -> tuple[SummaryTest, MaskTest]:
    if isinstance(e, Tag):
        return (
            _tag_summary(frozenset(v.encode() for v in e.values)),
            _tag_mask(pa.array(sorted(e.values), pa.string())),
        )
    if isinstance(e, Header | HasHeader):
        values = None if isinstance(e, HasHeader) else sorted(e.values)
        return (
            _header_summary(
                e.key.encode(), None if values is None else frozenset(v.encode() for v in values)
            ),
            _header_mask(
                e.key,
                None if values is None else pa.array([v.encode() for v in values], pa.binary()),
            ),
        )
    if isinstance(e, Not):
        inner_s, inner_m = _compile(e.item)

        def not_summary(s: Summary) -> tuple[bool, bool]:
            may, every = inner_s(s)
            return not every, not may

        return not_summary, lambda rb: ~inner_m(rb)
    parts = [_compile(i) for i in e.items]
    tests = [p[0] for p in parts]
    masks = [p[1] for p in parts]
    if isinstance(e, And):

        def and_summary(s: Summary) -> tuple[bool, bool]:
            may = every = True
            for t in tests:
                m, a = t(s)
                if not m:
                    return _NEVER
                every = every and a
            return may, every

        def and_mask(rb: pa.RecordBatch) -> np.ndarray:
            out = masks[0](rb)
            for m in masks[1:]:
                out &= m(rb)
            return out

        return and_summary, and_mask

    def or_summary(s: Summary) -> tuple[bool, bool]:
        may = False
        for t in tests:
            m, a = t(s)
            if a:
                return True, True
            may = may or m
        return may, False

    def or_mask(rb: pa.RecordBatch) -> np.ndarray:
        out = masks[0](rb)
        for m in masks[1:]:
            out |= m(rb)
        return out

    return or_summary, or_mask


@dataclass(frozen=True, eq=False)
class Filter:
    """A parsed filter (``storage.filters.parse``); equal when their canonical texts are."""

    expr: Expr
    text: str = field(init=False)
    uses_headers: bool = field(init=False)
    _summary: SummaryTest = field(init=False, repr=False)
    _mask: MaskTest = field(init=False, repr=False)

    def __post_init__(self) -> None:
        s, m = _compile(self.expr)
        object.__setattr__(self, "text", text(self.expr))
        object.__setattr__(self, "uses_headers", _uses_headers(self.expr))
        object.__setattr__(self, "_summary", s)
        object.__setattr__(self, "_mask", m)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Filter) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __str__(self) -> str:
        return self.text

    def __reduce__(self) -> tuple[type[Filter], tuple[Expr]]:
        return Filter, (self.expr,)  # the compiled closures are rebuilt, not pickled

    def classify(self, summary: Summary | None) -> Verdict:
        """What the summary says of the batch (None, a batch without one: ``DECODE``)."""
        if summary is None:
            return Verdict.DECODE
        may, every = self._summary(summary)
        if not may:
            return Verdict.SKIP
        return Verdict.WHOLE if every else Verdict.DECODE

    def mask(self, records: pa.RecordBatch) -> np.ndarray:
        """One boolean per record of ``records`` (``codec.SCHEMA``): does it match?"""
        out = self._mask(records)
        return out if out.flags.writeable else out.copy()

    def filter(self, records: pa.RecordBatch) -> pa.RecordBatch:
        """The matching records of ``records``."""
        return records.filter(pa.array(self.mask(records)))
