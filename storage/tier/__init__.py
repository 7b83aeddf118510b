"""The object tier: segment objects (layout + footer), the manifest, the S3 adapter, reads."""

from storage.tier.layout import Footer, build_footer, decode_footer, parse_key, segment_key
from storage.tier.manifest import Manifest, SegmentEntry
from storage.tier.reader import BlockCache, TierReader
from storage.tier.s3 import Backoff, ObjectStore, ObjectStoreConfig

__all__ = [
    "Backoff",
    "BlockCache",
    "Footer",
    "Manifest",
    "ObjectStore",
    "ObjectStoreConfig",
    "SegmentEntry",
    "TierReader",
    "build_footer",
    "decode_footer",
    "parse_key",
    "segment_key",
]
