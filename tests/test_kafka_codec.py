"""The Kafka codec (storage/kafka), pure: schemas, frames, record batch v2 <-> Strata batch.

Decoders are tested whole, one byte at a time (every prefix of a valid input is an error, never
an IndexError or struct.error) and with trailing garbage; golden vectors are frames and batches
encoded by an independent implementation (aiokafka's record builder, kafka-python's request
classes); Hypothesis round-trips records through both conversions.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.codec import (
    Compression,
    check_batch,
    decode_batch,
    encode_batch,
    kafka_body,
    read_header,
    stamp,
)
from storage.crc import crc32c
from storage.errors import (
    CorruptBatchError,
    InvalidRequestError,
    MalformedFrameError,
    StrataError,
    UnsupportedVersionError,
)
from storage.kafka import batch as kb
from storage.kafka import frames as kf
from storage.kafka.compression import Codec
from storage.kafka.messages import SERVED, ApiKey
from storage.kafka.records import (
    TAG_HEADER,
    _records_columnar,
    _records_one_by_one,
    build_kafka_batch,
    check_kafka_batch,
    kafka_to_strata,
    strata_batches_to_kafka,
)

# ---- golden vectors ---------------------------------------------------------------------------
#: kafka-python 3.0.12's encoding (``MetadataRequest(version=1, topics=[t]).with_header(
#: correlation_id=7, client_id="kp").encode(header=True, framed=True)``)
GOLDEN_METADATA_V1 = bytes.fromhex("00000013000300010000000700026b7000000001000174")
#: the same library's ApiVersions v3 (flexible: compact strings, tagged fields), client id
#: "rdkafka", software "x" "1"
GOLDEN_API_VERSIONS_V3 = bytes.fromhex("000000170012000300000001000772646b61666b61000278023100")


def _aiokafka_batch(
    records: list[tuple[bytes | None, bytes | None, list[Any], int]], codec: int
) -> bytes:
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=codec,
        is_transactional=False,
        producer_id=42,
        producer_epoch=3,
        base_sequence=7,
        batch_size=1 << 30,
    )
    for i, (key, value, headers, ts) in enumerate(records):
        builder.append(i, timestamp=ts, key=key, value=value, headers=headers)
    return bytes(builder.build())


def test_golden_requests_decode() -> None:
    for frame in (GOLDEN_METADATA_V1, GOLDEN_API_VERSIONS_V3):
        assert kf.read_size(frame[:4], 1 << 20) == len(frame) - 4
    header, body = kf.parse_request(GOLDEN_METADATA_V1[4:])
    assert (header.api_key, header.api_version, header.correlation_id, header.client_id) == (
        ApiKey.METADATA,
        1,
        7,
        "kp",
    )
    assert kf.decode_body(header, body)["topics"] == [{"name": "t"}]
    header, body = kf.parse_request(GOLDEN_API_VERSIONS_V3[4:])
    assert header.client_id == "rdkafka"
    assert kf.decode_body(header, body) == {
        "client_software_name": "x",
        "client_software_version": "1",
    }
    # and our encoder writes the same bytes
    assert kf.encode_request(ApiKey.METADATA, 1, 7, "kp", {"topics": [{"name": "t"}]}) == (
        GOLDEN_METADATA_V1
    )


def test_requests_round_trip_and_every_prefix_or_suffix_is_refused() -> None:
    frame = kf.encode_request(
        ApiKey.PRODUCE,
        7,
        99,
        "client",
        {
            "transactional_id": None,
            "acks": -1,
            "timeout_ms": 3000,
            "topic_data": [
                {"name": "t", "partition_data": [{"index": 2, "records": b"\x01\x02\x03"}]}
            ],
        },
    )
    header, body = kf.parse_request(frame[4:])
    req = kf.decode_body(header, body)
    assert (
        req["acks"] == -1
        and bytes(req["topic_data"][0]["partition_data"][0]["records"]) == b"\x01\x02\x03"
    )
    for cut in range(4, len(frame) - 1):
        try:
            h, b = kf.parse_request(frame[4:cut])
            kf.decode_body(h, b)
        except MalformedFrameError:
            continue
        pytest.fail(f"a request cut at {cut} bytes decoded")
    with pytest.raises(MalformedFrameError):
        h, b = kf.parse_request(frame[4:] + b"\x00garbage")
        kf.decode_body(h, b)


def test_every_served_schema_encodes_and_decodes_its_defaults_at_every_version() -> None:
    for api in SERVED.values():
        for v in range(api.min_version, api.max_version + 1):
            for schema in (api.request, api.response):
                data = b"".join(bytes(p) for p in schema.encode({}, v))
                assert isinstance(schema.decode(data, v), dict)


def test_unsupported_api_and_version_get_unsupported_version() -> None:
    frame = struct.pack(">hhi", 9999, 0, 5) + b"\x00\x00"
    header, _ = kf.parse_request(frame)
    assert header.api is None
    parts = kf.unsupported_response(header.api_key, header.correlation_id)
    data = b"".join(bytes(p) for p in parts)
    assert struct.unpack(">iih", data[:10]) == (6, 5, 35)
    # ApiVersions at a version past ours: a v0 answer with the code and our versions
    parts = kf.unsupported_response(ApiKey.API_VERSIONS, 6)
    _, body = kf.parse_response(b"".join(bytes(p) for p in parts)[4:], ApiKey.API_VERSIONS, 0)
    assert body["error_code"] == 35 and {a["api_key"] for a in body["api_keys"]} == set(SERVED)


# ---- record batches ---------------------------------------------------------------------------
RECORDS = [
    (None, b"v0", [], 1000),
    (b"k1", None, [("h", b"x"), ("h", b"")], 1001),
    (b"k2", b"", [(TAG_HEADER, b"red"), ("trace", b"\x00\xff")], 999),
    (b"", b"v3" * 300, [], 5000),
]


@pytest.mark.parametrize("codec", list(Codec))
def test_batches_of_an_independent_encoder_convert_with_every_codec(codec: Codec) -> None:
    kafka = _aiokafka_batch(RECORDS, codec)
    strata = kafka_to_strata(kafka)
    rows = decode_batch(strata).to_pylist()
    assert [r["key"] for r in rows] == [k for k, *_ in RECORDS]
    assert [r["value"] for r in rows] == [v for _, v, *_ in RECORDS]
    assert [round(r["timestamp"].timestamp() * 1000) for r in rows] == [ts for *_, ts in RECORDS]
    assert rows[1]["headers"] == [{"key": "h", "value": b"x"}, {"key": "h", "value": b""}]
    assert rows[2]["tags"] == ["red"] and rows[2]["headers"] == [
        {"key": "trace", "value": b"\x00\xff"}
    ]
    # and back: what a Kafka client reads (aiokafka's reader, CRC checked)
    back = b"".join(bytes(p) for p in strata_batches_to_kafka(strata))
    batch = DefaultRecordBatch(back)
    assert batch.validate_crc()
    assert (batch.producer_id, batch.producer_epoch, batch.base_sequence) == (42, 3, 7)
    got = [(r.key, r.value, list(r.headers), r.timestamp) for r in batch]
    want = [
        (b"k2", b"", [("trace", b"\x00\xff"), (TAG_HEADER, b"red")], 999)
        if k == b"k2"
        else (k, v, list(h), ts)
        for k, v, h, ts in RECORDS
    ]
    assert got == want


def test_a_kafka_batch_decodes_whole_only() -> None:
    kafka = build_kafka_batch([(b"k", b"v", [("a", b"b")])] * 3, base_timestamp=10)
    for cut in range(len(kafka)):
        with pytest.raises((CorruptBatchError, UnsupportedVersionError)):
            kafka_to_strata(kafka[:cut])
    with pytest.raises(CorruptBatchError):
        kafka_to_strata(kafka + b"\x00")
    damaged = bytearray(kafka)
    damaged[-1] ^= 1
    with pytest.raises(CorruptBatchError, match="CRC"):
        kafka_to_strata(bytes(damaged))


def test_bad_records_under_a_good_crc_are_refused() -> None:
    """Records whose fields lie about their sizes, with the CRC recomputed over them."""
    good = build_kafka_batch([(b"k", b"value", [])] * 2, base_timestamp=10)
    header, body = good[:61], bytearray(good[61:])
    for i in range(len(body)):
        for flip in (0x01, 0x40, 0x80):
            bad = bytearray(body)
            bad[i] ^= flip
            fixed = bytearray(header + bytes(bad))
            from storage.crc import crc32c

            struct.pack_into(">I", fixed, 17, crc32c(bytes(fixed[21:])))
            try:
                kafka_to_strata(bytes(fixed))
            except StrataError:
                continue  # refused with a typed error: fine; a changed value is fine too


def test_magic_other_than_2_and_control_batches_are_refused_transactional_kept() -> None:
    kafka = bytearray(build_kafka_batch([(None, b"v", [])], base_timestamp=0))
    kafka[16] = 1
    with pytest.raises(UnsupportedVersionError):
        kafka_to_strata(bytes(kafka))
    from storage.crc import crc32c

    def with_attributes(attributes: int) -> bytes:
        batch = bytearray(_aiokafka_batch([(b"k", b"v", [], 5)], 0))
        struct.pack_into(">h", batch, 21, attributes)
        struct.pack_into(">I", batch, 17, crc32c(bytes(batch[21:])))
        return bytes(batch)

    # a transactional producer's batch: stored as one, with its producer's id and epoch
    stored = kafka_to_strata(with_attributes(0x10))
    h = check_batch(stored)
    assert h.is_transactional and not h.is_control
    assert (h.producer_id, h.producer_epoch, h.base_sequence) == (42, 3, 7)
    rows = decode_batch(stored).to_pylist()
    assert [(r["key"], r["value"]) for r in rows] == [(b"k", b"v")]
    # a control batch (a marker) comes only from the coordinator, never from a producer
    for attributes in (0x20, 0x30):
        with pytest.raises(InvalidRequestError, match="control"):
            kafka_to_strata(with_attributes(attributes))


_record = st.tuples(
    st.one_of(st.none(), st.binary(max_size=40)),
    st.one_of(st.none(), st.binary(max_size=300)),
    st.lists(st.tuples(st.text(max_size=10), st.binary(max_size=20)), max_size=3),
    st.integers(min_value=0, max_value=1 << 42),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_record, min_size=1, max_size=40), st.sampled_from(list(Codec)))
def test_round_trip_kafka_strata_kafka(records: list[Any], codec: Codec) -> None:
    kafka = _aiokafka_batch(records, codec)
    strata = kafka_to_strata(kafka)
    kept = codec == Codec.NONE and not any(h for _, _, h, _ in records)
    assert (read_header(strata).compression == Compression.KAFKA) == kept
    check_batch(strata, deep=True)
    back = b"".join(bytes(p) for p in strata_batches_to_kafka(strata))
    check_kafka_batch(back)
    if kept:  # byte for byte what the producer sent, from its magic on
        assert back[16:] == kafka[16:]
    got = [(r.key, r.value, list(r.headers), r.timestamp) for r in DefaultRecordBatch(back)]
    want = []
    for k, v, h, ts in records:
        plain = [(hk, hv) for hk, hv in h if hk != TAG_HEADER]
        tags = [(hk, hv) for hk, hv in h if hk == TAG_HEADER]
        want.append((k, v, plain + tags, ts))
    assert got == want


_record = st.tuples(
    st.none() | st.binary(max_size=12),
    st.none() | st.binary(max_size=40),
    st.lists(st.tuples(st.text("abc", min_size=1, max_size=3), st.binary(max_size=4)), max_size=2),
    st.lists(st.text("xyz", min_size=1, max_size=3), max_size=2),
    st.integers(0, 10_000),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_record, min_size=1, max_size=300))
def test_small_and_large_batches_convert_to_the_same_kafka_records(records: list[Any]) -> None:
    """Up to ``SMALL_BATCH`` records are encoded one by one, more by the columnar path: both
    give the same bytes, and an independent reader (aiokafka's) reads them back."""
    strata = encode_batch(
        [v for _, v, *_ in records],
        keys=[k for k, *_ in records],
        headers=[h for _, _, h, _, _ in records],
        tags=[t for *_, t, _ in records],
        timestamps=[1_000 + ts for *_, ts in records],
    )
    header = check_batch(strata, 0, exact=False)
    rb = decode_batch(strata)
    one_by_one = _records_one_by_one(rb, header.first_timestamp)
    columnar = _records_columnar(rb, len(records), header.first_timestamp).to_pybytes()
    assert one_by_one == columnar
    batch = DefaultRecordBatch(b"".join(bytes(p) for p in strata_batches_to_kafka(strata)))
    assert batch.validate_crc()
    got = [(r.key, r.value, r.timestamp) for r in batch]
    assert got == [(k, v, 1_000 + ts) for k, v, _, _, ts in records]


@pytest.mark.parametrize("commit", [True, False])
def test_a_transaction_marker_reaches_kafka_clients_as_their_control_batch(commit: bool) -> None:
    """A Strata marker becomes Kafka's control batch (control and transactional bits, the
    producer's id and epoch, one control record: big-endian version and type 1 commit or 0
    abort, then the coordinator epoch), and a transactional data batch keeps its bit: what a
    read_committed Kafka client skips and drops by."""
    from storage.codec.control import encode_marker

    marker = encode_marker(77, 4, commit=commit, coordinator_epoch=9, timestamp_ms=1_000)
    batch = DefaultRecordBatch(b"".join(bytes(p) for p in strata_batches_to_kafka(marker)))
    assert batch.validate_crc()
    assert batch.is_control_batch and batch.is_transactional
    assert (batch.producer_id, batch.producer_epoch) == (77, 4)
    (record,) = list(batch)
    assert struct.unpack(">hh", record.key) == (0, 1 if commit else 0)
    assert struct.unpack(">hi", record.value) == (0, 9)
    data = encode_batch([b"v"], producer_id=77, producer_epoch=4, transactional=True)
    converted = DefaultRecordBatch(b"".join(bytes(p) for p in strata_batches_to_kafka(data)))
    assert converted.is_transactional and not converted.is_control_batch
    assert [r.value for r in converted] == [b"v"]
    plain = DefaultRecordBatch(
        b"".join(bytes(p) for p in strata_batches_to_kafka(encode_batch([b"v"])))
    )
    assert not plain.is_transactional and not plain.is_control_batch


# ---- Kafka batches kept as they came (storage/codec/kafka_body.py) ---------------------------
PLAIN = [
    (None, b"v0", [], 1000),
    (b"k1", None, [], 1001),
    (b"", b"v2" * 1500, [], 999),
    (b"k3", b"", [], 5000),
    (b"k4", b"x" * 20_000, [], 1002),  # a length prefix of three bytes
]


def _kafka_crc(batch: bytearray) -> bytes:
    struct.pack_into(">I", batch, 17, crc32c(bytes(batch[21:])))
    return bytes(batch)


def test_a_plain_kafka_batch_is_kept_as_it_came_and_every_reader_reads_it() -> None:
    """Uncompressed, create time, no record headers: the Strata batch's body is the Kafka
    batch byte for byte; its header says what the records say; a Strata reader decodes the
    records, and a Kafka fetch answers the producer's bytes with the leader's offset and
    epoch."""
    kafka = _aiokafka_batch(PLAIN, Codec.NONE)
    strata = kafka_to_strata(kafka)
    h = check_batch(strata, deep=True)
    assert h.compression == Compression.KAFKA and not h.is_transactional
    assert (h.record_count, h.first_timestamp, h.max_timestamp) == (5, 1000, 5000)
    assert (h.producer_id, h.producer_epoch, h.base_sequence) == (42, 3, 7)
    assert strata[72 : 72 + len(kafka)] == kafka
    stored = stamp(500, len(strata) - 12, 9) + strata[16:]  # what the leader's append does
    rows = decode_batch(stored).to_pylist()
    assert [r["offset"] for r in rows] == [500, 501, 502, 503, 504]
    assert [(r["key"], r["value"]) for r in rows] == [(k, v) for k, v, _, _ in PLAIN]
    assert [round(r["timestamp"].timestamp() * 1000) for r in rows] == [ts for *_, ts in PLAIN]
    assert all(r["headers"] == [] and r["tags"] == [] for r in rows)
    back = b"".join(bytes(p) for p in strata_batches_to_kafka(stored))
    assert back == struct.pack(">qii", 500, len(kafka) - 12, 9) + kafka[16:]
    batch = DefaultRecordBatch(back)
    assert batch.validate_crc() and batch.base_offset == 500
    assert [r.offset for r in batch] == [500, 501, 502, 503, 504]


def test_a_fetch_never_seals_corruption_under_a_crc_of_its_own() -> None:
    """A corrupt stored batch never reaches a Kafka client with a CRC that vouches for it. A
    batch the fetch builds (a new Kafka CRC) is refused on its Strata CRC. A batch kept as it
    came goes back under its producer's CRC, which a record byte changed in the store breaks
    for the client (``check.crcs``), and whose broken framing is refused here."""
    columnar = bytearray(encode_batch([b"value-%d" % i for i in range(5)]))
    columnar[100] ^= 0x01
    with pytest.raises(CorruptBatchError, match="CRC"):
        strata_batches_to_kafka(bytes(columnar))
    kafka = _aiokafka_batch(PLAIN, Codec.NONE)
    kept = bytearray(kafka_to_strata(kafka))
    kept[72 + len(kafka) - 3] ^= 0x01  # a byte of the last record's value
    batch = DefaultRecordBatch(b"".join(bytes(p) for p in strata_batches_to_kafka(bytes(kept))))
    assert not batch.validate_crc()
    framing = bytearray(kafka_to_strata(kafka))
    struct.pack_into(">i", framing, 72 + 8, len(kafka) - 13)  # the Kafka batch's length
    with pytest.raises(CorruptBatchError, match="stored Kafka batch"):
        strata_batches_to_kafka(bytes(framing))
    with pytest.raises(CorruptBatchError, match="truncated"):
        strata_batches_to_kafka(kafka_to_strata(kafka)[:-8])


def test_a_plain_kafka_batch_is_converted_when_the_topic_says_columnar() -> None:
    kafka = _aiokafka_batch(PLAIN, Codec.NONE)
    strata = kafka_to_strata(kafka, keep=False)
    assert check_batch(strata, deep=True).compression == Compression.NONE
    assert decode_batch(strata).to_pylist() == decode_batch(kafka_to_strata(kafka)).to_pylist()


def test_a_kafka_batch_whose_header_lies_about_its_largest_timestamp_is_converted() -> None:
    lying = bytearray(_aiokafka_batch(PLAIN, Codec.NONE))
    struct.pack_into(">q", lying, 35, 4000)
    strata = kafka_to_strata(_kafka_crc(lying))
    h = check_batch(strata, deep=True)
    assert h.compression == Compression.NONE and h.max_timestamp == 5000


def _forgeries() -> dict[str, bytes]:
    """Batches with a Kafka body that lie in one way each, every CRC right."""
    kafka = _aiokafka_batch(PLAIN, Codec.NONE)
    kh = kb.read_header(kafka)
    out = {}
    with_headers = _aiokafka_batch([(b"k", b"v", [("h", b"x")], 1000)], Codec.NONE)
    out["records-with-headers"] = kafka_body.frame(
        with_headers, kb.read_header(with_headers), 1000, 1000
    )
    out["strata-timestamps"] = kafka_body.frame(kafka, kh, 1000, 6000)
    inner_max = bytearray(kafka)
    struct.pack_into(">q", inner_max, 35, 4000)
    out["kafka-largest-timestamp"] = kafka_body.frame(_kafka_crc(inner_max), kh, 1000, 5000)
    flipped = bytearray(kafka)
    flipped[-1] ^= 1
    out["kafka-crc"] = kafka_body.frame(bytes(flipped), kh, 1000, 5000)
    delta = bytearray(kafka)
    first = kb.HEADER_SIZE + 1  # past the first record's one-byte length: attributes
    delta[first] = 1  # record attributes must be zero
    out["record-attributes"] = kafka_body.frame(_kafka_crc(delta), kh, 1000, 5000)
    count = bytearray(kafka)
    struct.pack_into(">i", count, 57, 3)
    out["record-count"] = kafka_body.frame(_kafka_crc(count), kh, 1000, 5000)
    pid = bytearray(kafka)
    struct.pack_into(">q", pid, 43, 41)
    out["producer-id"] = kafka_body.frame(_kafka_crc(pid), kh, 1000, 5000)
    compressed = bytearray(kafka)
    struct.pack_into(">h", compressed, 21, 1)
    out["kafka-codec"] = kafka_body.frame(_kafka_crc(compressed), kh, 1000, 5000)
    return out


@pytest.mark.parametrize("name", list(_forgeries()))
def test_a_kafka_body_that_lies_is_refused_by_the_leaders_check(name: str) -> None:
    bad = _forgeries()[name]
    check_batch(bad)  # the Strata CRC and framing hold: only the deep check can tell
    with pytest.raises(CorruptBatchError):
        check_batch(bad, deep=True)


def test_a_kafka_body_cut_or_mislabelled_is_corrupt_for_every_reader() -> None:
    kafka = _aiokafka_batch(PLAIN, Codec.NONE)
    good = kafka_body.frame(kafka, kb.read_header(kafka), 1000, 5000)
    short = bytearray(kafka)
    struct.pack_into(">i", short, 8, len(kafka) - 12 - 8)  # the Kafka batch claims less
    bad = kafka_body.frame(_kafka_crc(short), kb.read_header(kafka), 1000, 5000)
    for fn in (check_batch, decode_batch):
        fn(good)
        with pytest.raises(CorruptBatchError):
            fn(bad)
