"""The record-batch codec: pure functions over bytes, shared by the SDK, agents and Spark.

See ``header`` for the byte layout of a batch header and ``body`` for the columnar body.
"""

from storage.codec.batch import (
    BatchFramer,
    check_batch,
    decode_batch,
    decode_batches,
    encode_batch,
    iter_batches,
    with_producer,
)
from storage.codec.body import HEADERS_TYPE, SCHEMA, TAGS_TYPE
from storage.codec.header import (
    HEADER_SIZE,
    MAGIC,
    BatchHeader,
    Compression,
    read_header,
    stamp,
)

__all__ = [
    "HEADERS_TYPE",
    "HEADER_SIZE",
    "MAGIC",
    "SCHEMA",
    "TAGS_TYPE",
    "BatchFramer",
    "BatchHeader",
    "Compression",
    "check_batch",
    "decode_batch",
    "decode_batches",
    "encode_batch",
    "iter_batches",
    "read_header",
    "stamp",
    "with_producer",
]
