"""The record-batch codec: pure functions over bytes, shared by the SDK, agents and Spark.

See ``header`` for the byte layout of a batch header and ``body`` for the columnar body.
"""

# pyarrow's ``pa.array`` checks for numpy masked arrays and so imports ``numpy.ma`` on its
# first call with a numpy array (8 ms on a quiet machine, about 60 ms on a loaded one): at
# start-up here, not on every process's first fetch (a consumer's first records were late).
import numpy.ma  # noqa: F401

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
