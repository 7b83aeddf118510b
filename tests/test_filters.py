"""The filter language (storage/filters): parsing, canonical text, evaluation on batch
summaries and on decoded records, and the agent's filtered pass over stored batches.

Evaluation is checked against a reference written here record by record in plain Python
(``matches``), over batches built by the real encoder, with and without summaries."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage.codec import decode_batch, encode_batch, iter_batches, read_header
from storage.codec.summary import MAX_TAGS
from storage.errors import CorruptBatchError, InvalidFilterError
from storage.filters import (
    Filter,
    FilterScan,
    Verdict,
    as_filter,
    classify,
    matching,
    parse,
    parse_tags,
    selection_mask,
)
from storage.filters.expr import And, Expr, HasHeader, Header, Not, Or, Tag, text
from storage.filters.parser import MAX_DEPTH, MAX_LENGTH

# ---- a reference evaluator, one record at a time ---------------------------------------------

Record = dict[str, Any]  # {"tags": [str], "headers": [(str, bytes)]}


def matches(e: Expr, r: Record) -> bool:
    if isinstance(e, Tag):
        return any(t in e.values for t in r["tags"])
    if isinstance(e, Header):
        return any(k == e.key and v in {x.encode() for x in e.values} for k, v in r["headers"])
    if isinstance(e, HasHeader):
        return any(k == e.key for k, _ in r["headers"])
    if isinstance(e, Not):
        return not matches(e.item, r)
    if isinstance(e, And):
        return all(matches(i, r) for i in e.items)
    return any(matches(i, r) for i in e.items)


TAGS = ["a", "b", "c", "d'q", "é"]
KEYS = ["region", "x-id", "k.v"]
VALUES = ["eu", "us", "", "ü"]

tags_st = st.lists(st.sampled_from(TAGS), max_size=3)
headers_st = st.lists(
    st.tuples(st.sampled_from(KEYS), st.sampled_from(VALUES).map(str.encode)), max_size=3
)
records_st = st.lists(
    st.fixed_dictionaries({"tags": tags_st, "headers": headers_st}), min_size=1, max_size=20
)


def leaves() -> st.SearchStrategy[Expr]:
    values = st.frozensets(st.sampled_from([*TAGS, "zz"]), min_size=1, max_size=3)
    return st.one_of(
        values.map(Tag),
        st.builds(
            Header,
            st.sampled_from([*KEYS, "missing"]),
            st.frozensets(st.sampled_from([*VALUES, "no"]), min_size=1, max_size=3),
        ),
        st.sampled_from([*KEYS, "missing"]).map(HasHeader),
    )


exprs: st.SearchStrategy[Expr] = st.recursive(
    leaves(),
    lambda inner: st.one_of(
        inner.map(Not),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: And(tuple(xs))),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: Or(tuple(xs))),
    ),
    max_leaves=8,
)


def batch_of(records: list[Record], *, summary: bool = True, **kw: Any) -> bytes:
    return encode_batch(
        [b"v%d" % i for i in range(len(records))],
        tags=[r["tags"] for r in records],
        headers=[r["headers"] for r in records],
        summary=summary,
        **kw,
    )


# ---- parsing ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source,canonical",
    [
        ("tag = 'a'", "tag = 'a'"),
        ("TAG='a'", "tag = 'a'"),
        ("tag IN ('b', 'a')", "tag IN ('a', 'b')"),
        ("tag = 'a' OR tag = 'b'", "tag IN ('a', 'b')"),
        ("tag != 'a'", "NOT (tag = 'a')"),
        ("tag <> 'a'", "NOT (tag = 'a')"),
        ("tag not in ('a','b')", "NOT (tag IN ('a', 'b'))"),
        ("NOT NOT tag = 'a'", "tag = 'a'"),
        ("header.region = 'eu'", "header.region = 'eu'"),
        ("header.region = 'eu' or header.region = 'us'", "header.region IN ('eu', 'us')"),
        ('header."x y" IS NOT NULL', 'header."x y" IS NOT NULL'),
        ("header.k.v IS NULL", "NOT (header.k.v IS NOT NULL)"),
        ("tag = 'it''s'", "tag = 'it''s'"),
        ("(tag = 'a' AND tag = 'b') AND tag = 'c'", "tag = 'a' AND tag = 'b' AND tag = 'c'"),
        (
            "tag = 'a' AND (tag = 'b' OR header.r = 'x')",
            "tag = 'a' AND (tag = 'b' OR header.r = 'x')",
        ),
        ("tag = 'a' OR tag = 'b' AND tag = 'c'", "tag = 'a' OR (tag = 'b' AND tag = 'c')"),
        ("  tag\t=\n'a'  ", "tag = 'a'"),
        ("tag = ''", "tag = ''"),
    ],
)
def test_parse_gives_the_canonical_text(source: str, canonical: str) -> None:
    f = parse(source)
    assert f.text == canonical
    assert parse(canonical) == f and parse(canonical).expr == f.expr


def test_rocketmq_tag_expressions_are_tag_in() -> None:
    f = parse_tags("TagA || TagB")
    assert f is not None
    assert f == parse("tag IN ('TagA', 'TagB')") == parse("tag = 'TagB' OR tag = 'TagA'")
    assert parse_tags(" TagA ") == parse("tag = 'TagA'")
    assert parse_tags("*") is None and parse_tags("") is None and parse_tags("  ") is None
    assert parse_tags("with space || x") == parse("tag IN ('with space', 'x')")


@pytest.mark.parametrize(
    "source,position,says",
    [
        ("", 0, "expected a test"),
        ("tag", 3, "expected =, !=, <>, IN or NOT IN"),
        ("tag = a", 6, "expected a string in 'quotes'"),
        ("tag IN ('a' 'b')", 12, "expected ',' or ')'"),
        ("tag IN 'a'", 7, "expected '(' after IN"),
        ("tag NOT 'a'", 8, "expected IN"),
        ("tag = 'a' AND", 13, "expected a test"),
        ("tag = 'a' OR OR tag = 'b'", 13, "expected a test"),
        ("(tag = 'a'", 10, "expected ')'"),
        ("tag = 'a')", 9, "expected AND, OR or the end"),
        ("tag = 'open", 6, "a string without its closing '"),
        ("tags = 'a'", 0, "expected a test"),
        ("header region = 'x'", 7, "expected '.'"),
        ("header. = 'x'", 7, "expected a header key"),
        ("header.\"open = 'x'", 7, 'a header key without its closing "'),
        ("header.r IS 'x'", 12, "expected NULL"),
        ("header.r ~ 'x'", 9, "expected =, !=, <>, IN or NOT IN"),
        ("tag = 'a' && tag = 'b'", 10, "expected AND, OR or the end"),
    ],
)
def test_malformed_expressions_are_refused_with_the_position(
    source: str, position: int, says: str
) -> None:
    with pytest.raises(InvalidFilterError) as err:
        parse(source)
    assert err.value.position == position
    assert says in str(err.value) and f"at position {position}" in str(err.value)
    assert not err.value.retriable and err.value.code == InvalidFilterError.code


@pytest.mark.parametrize(
    "source,position,says",
    [
        ("A || || B", 5, "an empty tag name"),
        ("A ||", 4, "an empty tag name"),
        ("A | B", 2, "a lone '|'"),
        ("* || A", 0, "'*' mixed with tags"),
    ],
)
def test_malformed_tag_expressions_are_refused_with_the_position(
    source: str, position: int, says: str
) -> None:
    with pytest.raises(InvalidFilterError) as err:
        parse_tags(source)
    assert err.value.position == position and says in str(err.value)


def test_expressions_are_bounded() -> None:
    with pytest.raises(InvalidFilterError) as err:
        parse("tag = '" + "x" * MAX_LENGTH + "'")
    assert err.value.position == MAX_LENGTH
    deep = "(" * (MAX_DEPTH + 1) + "tag = 'a'" + ")" * (MAX_DEPTH + 1)
    with pytest.raises(InvalidFilterError, match="nested"):
        parse(deep)
    assert parse("(" * MAX_DEPTH + "tag = 'a'" + ")" * MAX_DEPTH) == parse("tag = 'a'")
    many = "tag IN (" + ", ".join(f"'{i}'" for i in range(700)) + ")"  # IN lists: by length
    with pytest.raises(InvalidFilterError, match="at most 4096 characters"):
        parse(many)
    with pytest.raises(InvalidFilterError, match="at most 4096 characters"):
        parse_tags(" || ".join(str(i) for i in range(1000)))
    with pytest.raises(InvalidFilterError):
        as_filter(42)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("tagheadrINOTNULS.=!<>()',\" |x-é")), max_size=40))
def test_any_text_parses_or_raises_invalid_filter(source: str) -> None:
    try:
        f = parse(source)
    except InvalidFilterError as exc:
        assert exc.position is not None and 0 <= exc.position <= len(source)
    else:
        assert parse(f.text) == f


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exprs, records_st)
def test_canonical_text_round_trips_and_keeps_the_meaning(e: Expr, records: list[Record]) -> None:
    f = parse(text(e))
    assert parse(f.text) == f and parse(f.text).expr == f.expr
    assert pickle.loads(pickle.dumps(f)) == f
    rb = decode_batch(batch_of(records))
    want = [matches(e, r) for r in records]
    assert f.mask(rb).tolist() == want
    assert Filter(e).mask(rb).tolist() == want


# ---- evaluation -------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exprs, records_st, st.booleans())
def test_summary_verdicts_are_sound_and_masks_exact(
    e: Expr, records: list[Record], summary: bool
) -> None:
    f = Filter(e)
    batch = batch_of(records, summary=summary)
    h = read_header(batch)
    want = [matches(e, r) for r in records]
    verdict = classify(f, batch, 0, h)
    if not summary:
        assert verdict is Verdict.DECODE
    if verdict is Verdict.SKIP:
        assert not any(want)
    if verdict is Verdict.WHOLE:
        assert all(want)
    assert f.mask(decode_batch(batch)).tolist() == want
    got = matching(f, batch, 0, h)
    assert ([] if got is None else got.column("value").to_pylist()) == [
        b"v%d" % i for i, w in enumerate(want) if w
    ]


def test_batches_of_one_tag_are_decided_by_their_summary() -> None:
    """What clustered tags give: a batch is skipped or taken whole without decoding."""
    only_a = batch_of([{"tags": ["a"], "headers": [("region", b"eu")]}] * 5)
    only_b = batch_of([{"tags": ["b", "c"], "headers": []}] * 5)
    untagged = batch_of([{"tags": [], "headers": []}] * 5)
    cases = {
        "tag = 'a'": (Verdict.WHOLE, Verdict.SKIP, Verdict.SKIP),
        "tag IN ('a', 'b')": (Verdict.WHOLE, Verdict.WHOLE, Verdict.SKIP),
        "tag != 'a'": (Verdict.SKIP, Verdict.WHOLE, Verdict.WHOLE),
        "header.region = 'eu'": (Verdict.WHOLE, Verdict.SKIP, Verdict.SKIP),
        "header.region IS NULL": (Verdict.SKIP, Verdict.WHOLE, Verdict.WHOLE),
        "tag = 'a' AND header.region = 'us'": (Verdict.SKIP, Verdict.SKIP, Verdict.SKIP),
        "tag = 'b' OR header.region = 'eu'": (Verdict.WHOLE, Verdict.WHOLE, Verdict.SKIP),
    }
    for source, verdicts in cases.items():
        f = parse(source)
        got = tuple(classify(f, b, 0, read_header(b)) for b in (only_a, only_b, untagged))
        assert got == verdicts, source


def test_a_batch_whose_tags_are_not_listed_is_decoded() -> None:
    records = [{"tags": [f"t{i}"], "headers": []} for i in range(MAX_TAGS + 1)]
    batch = batch_of(records)
    f = parse("tag = 't3'")
    assert classify(f, batch, 0, read_header(batch)) is Verdict.DECODE
    got = matching(f, batch, 0, read_header(batch))
    assert got is not None and got.column("value").to_pylist() == [b"v3"]


def test_masks_work_on_sliced_record_batches() -> None:
    records = [{"tags": [t], "headers": [("region", t.encode())]} for t in "abcabc"]
    rb = decode_batch(batch_of(records)).slice(2, 3)
    assert parse("tag = 'a'").mask(rb).tolist() == [False, True, False]
    assert parse("header.region = 'c'").mask(rb).tolist() == [True, False, False]


# ---- the filtered pass ------------------------------------------------------------------------


def _log(batches: list[bytes]) -> tuple[bytes, list[int]]:
    """Batches laid end to end with consecutive offsets (as a leader stamps them)."""
    out, bases, offset = [], [], 0
    for b in batches:
        h = read_header(b)
        out.append(offset.to_bytes(8, "little", signed=True) + b[8:])
        bases.append(offset)
        offset += h.record_count
    return b"".join(out), bases


def _received(scan: FilterScan) -> list[int]:
    """The offsets a consumer gets from what the scan sends, selections applied."""
    chosen = {s.base_offset: s.bitmap for s in scan.selections}
    out: list[int] = []
    for part in scan.parts:
        for h, pos in iter_batches(part):
            rb = decode_batch(part, pos)
            offsets = np.asarray(rb.column("offset"))
            if h.base_offset in chosen:
                offsets = offsets[selection_mask(chosen[h.base_offset], h.record_count)]
            out += [o for o in offsets.tolist() if o >= scan.start_offset]
    return out


def _records(tags: list[str]) -> list[Record]:
    return [{"tags": [t], "headers": []} for t in tags]


def test_the_scan_skips_sends_whole_and_selects() -> None:
    data, _bases = _log(
        [
            batch_of(_records(["a"] * 4)),  # whole
            batch_of(_records(["b"] * 4)),  # skipped by its summary
            batch_of(_records(["a", "b", "a", "b"])),  # mixed: a selection
            batch_of(_records(["b", "b"]), summary=False),  # old format, decoded, none match
            batch_of(_records(["a", "a"]), summary=False),  # old format, all match: whole
            batch_of(_records(["c"] * 3)),  # skipped
        ]
    )
    scan = FilterScan(parse("tag = 'a'"), 0, 1 << 20, 1 << 20)
    scan.feed(data)
    assert _received(scan) == [0, 1, 2, 3, 8, 10, 14, 15]
    assert [s.base_offset for s in scan.selections] == [8]
    assert selection_mask(scan.selections[0].bitmap, 4).tolist() == [True, False, True, False]
    assert (scan.whole_batches, scan.skipped_batches, scan.decoded_batches) == (2, 3, 3)
    assert scan.next_offset == 19 and not scan.done
    assert scan.scanned == len(data)
    assert all(part.obj is data for part in scan.parts)  # views of the stored bytes, no copies


def test_the_scan_from_the_middle_of_a_batch_selects_nothing_below_the_offset() -> None:
    data, _ = _log([batch_of(_records(["a", "b", "a", "a"])), batch_of(_records(["a"]))])
    scan = FilterScan(parse("tag = 'a'"), 1, 1 << 20, 1 << 20)
    scan.feed(data)
    assert _received(scan) == [2, 3, 4]
    assert selection_mask(scan.selections[0].bitmap, 4).tolist() == [False, False, True, True]


def test_the_scan_stops_at_max_bytes_but_sends_the_first_batch_whatever_its_size() -> None:
    big = [batch_of(_records(["a"] * 50)) for _ in range(3)]
    data, bases = _log(big)
    scan = FilterScan(parse("tag = 'a'"), 0, 10, 1 << 20)
    scan.feed(data)
    assert len(scan.parts) == 1 and scan.full and scan.done
    assert scan.next_offset == bases[1]  # the batch that did not fit is the next fetch's
    assert scan.scanned == len(big[0])


def test_the_scan_stops_after_max_scan_bytes_and_says_how_far_it_got() -> None:
    batches = [batch_of(_records(["b"] * 10)) for _ in range(10)]
    data, bases = _log(batches)
    size = len(batches[0])
    scan = FilterScan(parse("tag = 'a'"), 0, 1 << 20, 3 * size + 1)
    scan.feed(data)
    assert scan.parts == [] and scan.done and not scan.full
    assert scan.next_offset == bases[4] and scan.scanned == 4 * size
    # the next fetch starts there: it never looks at the same batches again
    again = FilterScan(parse("tag = 'a'"), scan.next_offset, 1 << 20, 1 << 30)
    again.feed(data)
    assert again.scanned == 6 * size and again.next_offset == 100


def test_the_scan_sends_control_batches_and_passes_over_what_it_has_seen() -> None:
    data, _ = _log(
        [
            batch_of(_records(["b"])),
            batch_of(_records(["b"]), control=True),
            batch_of(_records(["b"])),
        ]
    )
    scan = FilterScan(parse("tag = 'a'"), 0, 1 << 20, 1 << 20)
    scan.feed(data)
    assert [read_header(p).base_offset for p in scan.parts] == [1]
    assert scan.next_offset == 3
    scan.feed(data)  # the same batches again: nothing changes
    assert scan.next_offset == 3 and len(scan.parts) == 1


def test_a_selection_must_fit_its_batch() -> None:
    with pytest.raises(CorruptBatchError):
        selection_mask(b"\x01\x02", 3)
    assert selection_mask(b"\x05", 3).tolist() == [True, False, True]


def test_the_scan_also_stops_after_max_batches() -> None:
    """Tiny batches cost Python work per batch whatever their bytes: a count bounds it too."""
    data, bases = _log([batch_of(_records(["b"])) for _ in range(10)])
    scan = FilterScan(parse("tag = 'a'"), 0, 1 << 20, 1 << 30, max_batches=3)
    scan.feed(data)
    assert scan.done and scan.looked == 3 and scan.next_offset == bases[3]
