"""Manifest snapshots in the bucket: how readers without ZooKeeper find committed segments.

The authoritative manifest of a partition lives in ZooKeeper (``storage.tier.manifest``).
Clients that must not talk to ZooKeeper — the SDK's replay, Spark executors, and by default
the Spark driver — read a copy the partition leader writes to the bucket after every
successful manifest change (commit or retention trim)::

    <prefix>manifests/<topic>/<partition:010d>.json

    {"v": 1, "topic": "orders", "topic_id": "ab12...", "created_ms": ..., "partition": 3,
     "written_ms": ..., "manifest": {<the manifest's own JSON, as in ZooKeeper>}}

Theory of operation:

* A snapshot is written only after the ZooKeeper transaction that made its manifest succeeded,
  so every segment it names was committed (and its object uploaded) at that moment. It never
  names an orphan or a half-finished upload; a reader that follows it cannot see an uncommitted
  object, however many stray or duplicate objects the bucket holds.
* It can lag: the put happens after the commit and is best effort (a failed put is logged and
  the next change writes a newer one), and two leaders in quick succession may land their puts
  in the wrong order. A lagging snapshot misses the newest segments (readers see a slightly
  older committed prefix), and one older than a retention trim may name deleted objects
  (readers get ``ObjectNotFoundError`` for those). Readers that need the exact state read
  ZooKeeper (the Spark driver can, with ``manifest=zookeeper``).
* ``topic_id`` is in the snapshot because segment keys contain it, and because a topic name
  can be deleted and created again: a reader takes the snapshots of one incarnation only
  (the one it is asked for, else the newest by ``created_ms``, the topic's creation time),
  never a mix. A delete removes the snapshots (step 4) before the segment objects, so readers
  stop seeing a deleted topic first; a new leader with nothing committed yet writes an empty
  snapshot (create-only), so a topic that exists but has nothing tiered reads as empty while
  one with no snapshot at all reads as unknown.

Pure: bytes in, values out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from storage.errors import CorruptSegmentError
from storage.tier.manifest import Manifest


@dataclass(frozen=True, slots=True)
class ManifestSnapshot:
    topic: str
    topic_id: str
    partition: int
    manifest: Manifest
    written_ms: int = 0
    created_ms: int = 0  # the topic's creation time (0: written before it was recorded)

    def encode(self) -> bytes:
        inner = json.loads(self.manifest.encode())
        return json.dumps(
            {
                "v": 1,
                "topic": self.topic,
                "topic_id": self.topic_id,
                "created_ms": self.created_ms,
                "partition": self.partition,
                "written_ms": self.written_ms,
                "manifest": inner,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes, *, where: str = "manifest snapshot") -> ManifestSnapshot:
        try:
            raw: Any = json.loads(data)
            if raw.get("v") != 1:
                raise ValueError(f"unknown snapshot version {raw.get('v')!r}")
            inner = json.dumps(raw["manifest"]).encode()
            topic, topic_id = str(raw["topic"]), str(raw["topic_id"])
            partition, written = int(raw["partition"]), int(raw.get("written_ms", 0))
            created = int(raw.get("created_ms", 0))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptSegmentError(f"unreadable manifest snapshot: {exc}", path=where) from None
        manifest = Manifest.decode(inner, where=where)
        return cls(topic, topic_id, partition, manifest, written, created)


def snapshot_prefix(topic: str, prefix: str = "") -> str:
    return f"{prefix}manifests/{topic}/"


def snapshot_key(topic: str, partition: int, prefix: str = "") -> str:
    return f"{snapshot_prefix(topic, prefix)}{partition:010d}.json"


def parse_snapshot_key(key: str) -> int | None:
    """The partition of a snapshot key; None for anything else."""
    name = key.rsplit("/", 1)[-1]
    if not name.endswith(".json") or not name[:-5].isdigit():
        return None
    return int(name[:-5])
