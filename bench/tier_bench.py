"""Object-tier benchmark: S3 requests per GB ingested, and catch-up reads vs plain boto3 GETs.

Run with ``make bench-tier`` (``python -m bench.tier_bench [--write-docs]``). Starts a real
ZooKeeper, moto in server mode and one agent process with tiering on and **default** tier and
topic settings (``segment.bytes`` 1 GiB, ``tier.multipart.part.bytes`` 64 MiB), then in the
same run:

1. **Ingest.** The SDK producer writes ``--gib`` GiB (+ a little, so the first 1 GiB segment
   rolls) of 1 KiB messages to one partition; the agent seals, uploads and commits the full
   segments. Upload requests are *counted*, not computed: moto's request log (one line per
   HTTP request it served) is parsed for every PUT/POST under the bucket during the ingest, by
   kind (PutObject, CreateMultipartUpload, UploadPart, CompleteMultipartUpload).
2. **Catch-up read** of every committed segment object, in the same run, two ways, alternated
   ``--rounds`` times, which one goes first alternating too (best of each is compared):
   * *tier*: one ``storage.tier.reader.TierReader`` for all rounds, as the agent builds it and
     keeps it (none of the segments' blocks or footers cached at the start of a round; its
     default ``tier.cache.bytes``, ``tier.read.block.bytes``, ``tier.readahead.blocks``, an
     ``ObjectStore`` with the agent's worker count), read sequentially from the manifest's
     start with the consumer's default ``max.partition.fetch.bytes`` (1 MiB) per call, the
     next segment named for read-ahead — every batch CRC-checked, as a Fetch would;
   * *plain*: one boto3 ``get_object`` per object, the body streamed in 1 MiB chunks.
   The ratio is tier MB/s ÷ plain MB/s (target >= 0.8), measured twice: against moto, the S3
   the agent uploaded the objects to (the issue's comparison), and against a loopback endpoint
   serving the same objects with ``sendfile`` (no S3 work at all: the reader's CPU cost).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.server
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config as BotoConfig
from kazoo.client import KazooClient

from bench.common import publish
from broker_agents.config import AgentConfig
from infra.agents import start_agent
from infra.moto_s3 import start_moto
from infra.zookeeper import start_zookeeper
from sdk import Producer
from storage.codec import iter_batches
from storage.metadata import AsyncZooKeeper, MetadataStore, TopicSpec
from storage.tier import Manifest, ObjectStore, ObjectStoreConfig, TierReader
from storage.tier.layout import TRAILER_SIZE

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "tierbench"
BUCKET = "strata-tier-bench"
REGION = "us-east-1"
GiB = 1 << 30
_REQUEST = re.compile(r'"(PUT|POST|GET|DELETE|HEAD) (/[^ ]*) HTTP/1\.[01]" (\d{3})')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # werkzeug colours some log lines


async def _create_topic(zk_connect: str) -> str:
    zk = AsyncZooKeeper(zk_connect)
    await zk.start()
    try:
        topic_id = uuid.uuid4().hex
        spec = TopicSpec.build(
            name=TOPIC,
            partitions=1,
            replication_factor=1,
            config={},
            topic_id=topic_id,
            created_ms=int(time.time() * 1000),
        )
        await MetadataStore(zk).create_topic(spec)
        return topic_id
    finally:
        await zk.stop()


async def _ingest(bootstrap: str, total: int, size: int) -> float:
    values = [os.urandom(size)] * 1000
    config = {
        "bootstrap.servers": bootstrap,
        "acks": 1,
        "linger.ms": 5,
        "batch.size": 1 << 20,
        "buffer.memory": 256 << 20,
    }
    start = time.perf_counter()
    async with Producer(config) as producer:
        for _ in range(total // (size * 1000) + 1):
            await producer.send_batch(TOPIC, values, partition=0)
        await producer.flush()
    return time.perf_counter() - start


def _classify(method: str, target: str) -> str | None:
    if not target.startswith(f"/{BUCKET}/"):
        return None
    query = target.partition("?")[2]
    if method == "PUT":
        return "UploadPart" if "partNumber=" in query else "PutObject"
    if method == "POST":
        if "uploads" in query.split("&"):
            return "CreateMultipartUpload"
        if "uploadId=" in query:
            return "CompleteMultipartUpload"
        return "Post"
    return None


def count_writes(log_text: str) -> dict[str, int]:
    """PUT/POST requests moto answered under the bucket, by S3 operation."""
    counts: dict[str, int] = {}
    for method, target, _status in _REQUEST.findall(_ANSI.sub("", log_text)):
        kind = _classify(method, target)
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def _manifest(zk: KazooClient) -> Manifest:
    try:
        data, _ = zk.get(f"/topics/{TOPIC}/partitions/0/segments")
    except Exception:
        return Manifest()
    return Manifest.decode(data)


def agent_defaults(**overrides: Any) -> AgentConfig:
    """The agent's configuration with its defaults (and ``overrides``) for everything else."""
    return AgentConfig.model_validate(
        {"agent.id": 0, "zookeeper.connect": "unused:2181", "data.dir": "unused", **overrides}
    )


def tier_store(endpoint: str, defaults: AgentConfig) -> ObjectStore:
    """An ``ObjectStore`` configured as the agent builds its own."""
    return ObjectStore(
        ObjectStoreConfig(
            bucket=BUCKET,
            endpoint_url=endpoint,
            region=REGION,
            request_timeout=defaults.s3_request_timeout_ms / 1000,
            max_attempts=defaults.s3_max_attempts,
            max_workers=defaults.tier_upload_concurrency + 8,
        )
    )


async def warm(store: ObjectStore, key: str) -> None:
    """One request, untimed: botocore loads its service model and endpoint rules on a client's
    first call (about 0.2 s here), a once-per-agent cost the plain client has paid as well."""
    await store.get_range(key, -TRAILER_SIZE, 0)


def agent_reader(store: ObjectStore, defaults: AgentConfig) -> TierReader:
    """A ``TierReader`` configured as the agent builds its own."""
    return TierReader(
        store,
        cache_bytes=defaults.tier_cache_bytes,
        block_bytes=defaults.tier_read_block_bytes,
        readahead_blocks=defaults.tier_readahead_blocks,
    )


async def read_tier(
    reader: TierReader, keys: list[str], manifest: Manifest, fetch_bytes: int
) -> tuple[int, float]:
    """Read every committed segment sequentially, none of its blocks cached at the start."""
    for key in keys:
        reader.forget(key)
    total = 0
    segs = manifest.segments
    start = time.perf_counter()
    for i, entry in enumerate(segs):
        following = (keys[i + 1], segs[i + 1]) if i + 1 < len(segs) else None
        offset = entry.base_offset
        while offset < entry.next_offset:
            data = await reader.read(keys[i], entry, offset, fetch_bytes, following)
            total += len(data)
            # the next offset: the last batch's base + its count (header fields)
            offset = _next_offset(data)
    return total, time.perf_counter() - start


async def tier_rounds(
    store: ObjectStore,
    keys: list[str],
    manifest: Manifest,
    defaults: AgentConfig,
    plain: Any,
    rounds: int,
) -> tuple[int, list[float], list[float]]:
    """``rounds`` pairs of a plain read and a tier read through one long-lived reader (as in an
    agent: its cache arena is mapped once; each round starts with none of the segments'
    blocks cached). One untimed read of each kind comes first, and which one goes first
    alternates: the first transfer of a run is consistently the fastest (moto's first GET
    after the upload), and giving that turn to one side would bias best-of-rounds toward it."""
    reader = agent_reader(store, defaults)
    tier_runs, plain_runs = [], []
    nbytes = 0
    try:
        plain()
        await read_tier(reader, keys, manifest, 1 << 20)
        for r in range(rounds):
            for side in ("plain", "tier") if r % 2 == 0 else ("tier", "plain"):
                if side == "plain":
                    n, s = plain()
                    plain_runs.append(n / 1e6 / s)
                else:
                    nbytes, s = await read_tier(reader, keys, manifest, 1 << 20)
                    tier_runs.append(nbytes / 1e6 / s)
    finally:
        await reader.close()
    return nbytes, tier_runs, plain_runs


def _next_offset(data: Any) -> int:
    nxt = -1
    for h, _ in iter_batches(data):
        nxt = h.next_offset
    return nxt


def read_plain(client: Any, keys: list[str], sizes: list[int]) -> tuple[int, float]:
    total = 0
    start = time.perf_counter()
    for key, size in zip(keys, sizes, strict=True):
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"]
        got = 0
        while chunk := body.read(1 << 20):
            got += len(chunk)
        if got != size:
            raise SystemExit(f"GET {key} returned {got} of {size} bytes")
        total += got
    return total, time.perf_counter() - start


class _ObjectHandler(http.server.BaseHTTPRequestHandler):
    """GET (with ``Range``) of files under ``root`` as ``/<bucket>/<key>``: S3's read path only."""

    protocol_version = "HTTP/1.1"
    root: Path
    # S3 endpoints answer without Nagle's delay: headers and a short body would otherwise
    # wait for the client's delayed ACK (40 ms on Linux) on every small ranged GET
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        path = self.root / urllib.parse.unquote(self.path.split("?", 1)[0]).lstrip("/")
        if not path.is_file():
            self.send_error(404)
            return
        size = path.stat().st_size
        start, end, status = 0, size - 1, 200
        rng = self.headers.get("Range")
        if rng:
            first, _, last = rng.removeprefix("bytes=").partition("-")
            if first:
                start, end = int(first), min(size - 1, int(last) if last else size - 1)
            else:
                start = max(0, size - int(last))
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("ETag", '"bench"')
        self.send_header("Last-Modified", self.date_time_string())
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        with open(path, "rb") as f:
            left = end - start + 1
            while left > 0:
                sent = os.sendfile(self.wfile.fileno(), f.fileno(), start, left)
                if sent == 0:
                    break
                start += sent
                left -= sent

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_objects(root: Path) -> None:
    """Serve ``root`` until killed; prints the port on the first line of stdout."""
    handler = type("Handler", (_ObjectHandler,), {"root": root})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


@contextlib.contextmanager
def range_server(root: Path) -> Iterator[str]:
    """A threaded HTTP server in its own process answering S3 GETs (ranged or whole) from
    files with ``sendfile``: O(range) per request, as S3 is (moto copies the whole object)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.tier_bench", "--serve-objects", str(root)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def _download(client: Any, keys: list[str], root: Path) -> None:
    for key in keys:
        path = root / BUCKET / key
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            body = client.get_object(Bucket=BUCKET, Key=key)["Body"]
            while chunk := body.read(8 << 20):
                f.write(chunk)


def _runs(runs: list[float]) -> str:
    return ", ".join(f"{x:.0f}" for x in runs)


def render(r: dict[str, Any]) -> str:
    ing, rd = r["ingest"], r["read"]
    lb = rd["loopback"]
    puts_ok = "met" if ing["puts_per_gb"] <= 20 else "**missed**"
    ratio_ok = "met" if rd["ratio"] >= 0.8 else "**missed**"
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(ing["requests"].items()))
    return "\n".join(
        [
            "<!-- tier-bench:begin (generated by `make bench-tier`; do not edit by hand) -->",
            f"Measured {r['date']} on {r['machine']} with `{r['command']}`: one agent process"
            " with tiering on and default settings (`segment.bytes` 1 GiB,"
            " `tier.multipart.part.bytes` 64 MiB), moto in server mode on loopback as S3.",
            "",
            "| measurement | result |",
            "|---|---|",
            f"| ingested (SDK producer, 1 KiB values, acks=1) | {ing['bytes'] / 1e9:.2f} GB in"
            f" {ing['seconds']:.1f} s; committed to the tier: {ing['committed_bytes'] / 1e9:.3f} GB"
            f" in {ing['segments']} segment object(s), manifest end reached"
            f" {ing['upload_wait_s']:.1f} s after the last ack |",
            f"| write requests moto served for the bucket (counted from its request log) | {kinds}"
            f" = {ing['write_requests']} |",
            f"| **S3 write requests per GB committed** | **{ing['puts_per_gb']:.1f}** |",
            f"| catch-up read through `TierReader` (agent defaults: {rd['block_bytes'] >> 20} MiB"
            f" blocks, {rd['readahead_blocks']} blocks of read-ahead, 1 MiB per read, CRC per"
            f" batch) from moto | {rd['bytes'] / 1e9:.3f} GB, best"
            f" **{rd['tier_mb_s']:.0f} MB/s** (runs: {_runs(rd['tier_runs'])}) |",
            f"| plain boto3 `get_object` of the same objects from moto, streamed | best"
            f" **{rd['plain_mb_s']:.0f} MB/s** (runs: {_runs(rd['plain_runs'])}) |",
            f"| GET requests per catch-up read of the {rd['bytes'] / 1e9:.2f} GB (footers"
            f" included) | {rd['gets_per_run']:.0f} |",
            f"| **tier ÷ plain, against moto** | **{rd['ratio']:.2f}** |",
            f"| the same two reads against a loopback `sendfile` endpoint: tier, plain | best"
            f" {lb['tier_mb_s']:.0f} MB/s (runs: {_runs(lb['tier_runs'])}); best"
            f" {lb['plain_mb_s']:.0f} MB/s (runs: {_runs(lb['plain_runs'])}) |",
            f"| tier ÷ plain, against the loopback endpoint (the reader's CPU cost) |"
            f" {lb['ratio']:.2f} |",
            "",
            f"Each read is done {rd['rounds']} times, alternating with the other, after one"
            " untimed read of each, and which one goes first alternates too: the first transfer"
            " of a run is consistently the fastest (moto's first GET after the upload: 1,310 to"
            " 1,350 MB/s against about 1,210 after, whichever reader makes it), and giving that"
            " turn always to the plain read, as this benchmark did until 2026-11-24, cost the"
            " tier ratio about 0.1.",
            "",
            "What the two comparisons measure. Against moto, the S3 the agent uploaded the"
            " objects to (the issue's comparison: the same objects, the same endpoint, the same"
            " client library), every GET costs the endpoint real work: for the 1 GiB object"
            " moto spends about 660 ms before the first byte (it copies the object) and then"
            " sends the body at about 5 GB/s. Both readers pay the first part once per object,"
            " and the ratio shows what the reader adds on top: requests (each one costs moto"
            " another copy of the object) and its slower body phase. Against the loopback"
            " endpoint (a separate process"
            " answering GETs from files with `sendfile`) the server does almost nothing: the"
            " plain read alone keeps both cores busy (about 130 ms of server CPU and 140 ms of"
            " client kernel copy per GiB, in 140 ms), so every cycle the reader spends on top"
            " — CRC32C of every batch, its per-read Python, the GIL passed between the"
            " receiving thread and the event loop — comes straight off the ratio. That figure"
            " is the reader's CPU cost on this 2-core machine, and it stays well below 0.8.",
            "",
            "What was done. On 2026-11-24: (1) a catch-up read cost two GETs per segment"
            " object — the footer first (to find where an offset starts), then a ranged GET for"
            " the data — and moto answers every ranged GET by copying the whole object, so the"
            " footer cost as much as the data (0.36 against moto). Now a read from a segment's"
            " first offset starts at position 0 without the footer, each read remembers where"
            " the next offset starts (a bounded map), so a sequential reader never needs the"
            " index, and a stream from a segment's first block asks for the whole object"
            " without a range (its length checked against the manifest) and hands the footer"
            " to the reader at its end, kept for random reads and timestamp lookups:"
            f" {rd['gets_per_run']:.0f} GET(s) for the whole read. On real S3 that saves one"
            " request's latency per segment, which matters most for the small segments"
            " `segment.ms` seals on quiet partitions. (2) The CRC32C of every batch was"
            " computed on the event loop at read time, from memory the block had left the"
            " cache for, holding the GIL (google-crc32c does not release it) while the"
            " receiving thread waited for it: 26 % of the GIL samples, 85 ms per GiB. The"
            " receiving thread now runs each block it fills through a `CrcVerifier` (length"
            " field and CRC of each batch, none of it buffered) while the block is in cache,"
            " and a read of batches that stream verified, in blocks it filled, checks nothing"
            " again; anything else is checked at read time as before. Loopback ratio in paired"
            " runs: 0.60 and 0.62 with it, 0.48 and 0.44 without; event-loop CPU per GiB 160"
            " -> 68 ms. Earlier: (3) the read-ahead issued a GET per run of blocks (33 per GiB,"
            " about 3 ms each here); each sequential reader now has one *stream* per segment"
            " object, fed cache slots as the reader makes room. (4) Every block was a fresh"
            " `bytes` (fresh pages faulted in and zeroed, 4 KiB TLB entries): blocks live in"
            " one arena of reused slots (a private mapping advised for huge pages), received"
            " straight into (`recv_into`). (5) A read that straddled two blocks copied into a"
            " zeroed `bytearray` and every read returned a copy: a read inside one block is a"
            ' view of the slot, a straddling read one `b"".join`.',
            "",
            "What the loopback figure still pays for, per GiB (process CPU with `getrusage`,"
            " 2026-11-24): the client uses about 280 ms of CPU against the plain read's 140 —"
            " the receiving thread about 210 (the kernel's copy into the arena, colder than"
            " the plain read's one reused 1 MiB buffer, and the CRC pass) and the event loop"
            " about 70 (per-read Python: header walks, the read-ahead window, straddling"
            " reads' joins) — while the endpoint takes about 130 of the two cores: about 410"
            " ms of CPU for a read the plain client does in 140 ms of wall time, so about 0.7"
            " is this machine's ceiling for a reader that checks every CRC, whatever else it"
            " saves. Against moto the body phase is the same shape (about 370 ms against the"
            " plain read's 215 after the same 660 ms before moto's first byte). Tried and not"
            " kept: a shorter GIL switch interval (within the run-to-run spread), yielding the"
            " GIL after every read (no change), a receive low-water mark (`SO_RCVLOWAT`: stalls"
            " on a fresh connection's small window), the `crc32c` package (releases the GIL; no"
            " change against moto), scan-resistant slot reuse and smaller read-ahead to keep"
            " blocks in the 32 MiB L3 (no change), smaller blocks (worse: 0.31 at 1 MiB), a"
            " `pyarrow.fs` (AWS C++ SDK) reader (1.4 to 2.2 GB/s at more CPU).",
            "",
            f"Against the targets: ≤ 20 S3 PUTs per GB ingested: {puts_ok}"
            f" ({ing['puts_per_gb']:.1f}: one CreateMultipartUpload, 16 parts and one"
            " CompleteMultipartUpload per 1 GiB segment; every write request counted, manifest"
            f" snapshots included if any); catch-up read ≥ 0.8 of plain GETs of the same objects:"
            f" {ratio_ok} ({rd['ratio']:.2f} against moto; {lb['ratio']:.2f} against the"
            " loopback endpoint, which measures CPU, not S3). Bytes that have not filled a segment yet (the"
            f" {(ing['bytes'] - ing['committed_bytes']) / 1e6:.0f} MB tail here) wait on the"
            " agent's disk until `segment.bytes` or `segment.ms` seals them.",
            "<!-- tier-bench:end -->",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Strata object-tier benchmark")
    parser.add_argument("--gib", type=int, default=1, help="full 1 GiB segments to commit")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=ROOT / "var" / "bench")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--serve-objects", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_objects is not None:
        serve_objects(args.serve_objects)
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.dir))
    zk = start_zookeeper(work / "zookeeper")
    moto = start_moto(work / "moto")
    agent = None
    kz: KazooClient | None = None
    creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    env = {
        "AWS_ENDPOINT_URL": moto.endpoint_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "STRATA_BUCKET": BUCKET,
    }
    os.environ.update({k: v for k, v in env.items() if k != "AWS_ENDPOINT_URL"})
    client = boto3.session.Session(region_name=REGION, **creds).client(
        "s3",
        endpoint_url=moto.endpoint_url,
        config=BotoConfig(read_timeout=120, s3={"addressing_style": "path"}),
    )
    try:
        client.create_bucket(Bucket=BUCKET)
        connect = f"{zk.connect_string}/bench"
        agent = start_agent(1, connect, work / "agent-1", env=env)
        topic_id = asyncio.run(_create_topic(connect))
        kz = KazooClient(hosts=connect)
        kz.start(timeout=15)
        log_before = len(moto.log_path.read_bytes())
        target = args.gib * GiB
        ingest_s = asyncio.run(_ingest(agent.address, target + 64 * (1 << 20), args.size))
        acked_at = time.monotonic()
        deadline = acked_at + 600
        while len(_manifest(kz).segments) < args.gib:
            if time.monotonic() > deadline:
                raise SystemExit("the agent did not commit the ingested segments in 600 s")
            time.sleep(0.2)
        upload_wait = time.monotonic() - acked_at
        manifest = _manifest(kz)
        log_text = moto.log_path.read_bytes()[log_before:].decode("utf-8", "replace")
        writes = count_writes(log_text)
        committed = sum(s.data_length for s in manifest.segments)
        keys = [s.key(TOPIC, topic_id, 0) for s in manifest.segments]
        sizes = [s.size for s in manifest.segments]
        ingested = (target // (args.size * 1000) + 1) * args.size * 1000
        # committed GB by object bytes (what was PUT); data_length differs by the footer only
        puts_per_gb = sum(writes.values()) / (sum(sizes) / 1e9)

        defaults = agent_defaults()

        def compare(endpoint: str) -> dict[str, Any]:
            """Tier vs plain reads of the committed objects at ``endpoint``."""
            plain_client = boto3.session.Session(region_name=REGION, **creds).client(
                "s3",
                endpoint_url=endpoint,
                config=BotoConfig(read_timeout=120, s3={"addressing_style": "path"}),
            )
            store = tier_store(endpoint, defaults)

            async def measured() -> tuple[int, list[float], list[float]]:
                # one event loop for the store's whole life (its aioboto3 client lives on it)
                try:
                    await warm(store, keys[0])
                    return await tier_rounds(
                        store,
                        keys,
                        manifest,
                        defaults,
                        lambda: read_plain(plain_client, keys, sizes),
                        args.rounds,
                    )
                finally:
                    await store.close()

            try:
                nbytes, tier_runs, plain_runs = asyncio.run(measured())
                if nbytes != committed:
                    raise SystemExit(f"tier read returned {nbytes} bytes, {committed} committed")
                return {
                    "bytes": nbytes,
                    # every read but the one-request warm-up: the untimed one and the rounds
                    "gets_per_run": (store.requests.get("GET", 0) - 1) / (args.rounds + 1),
                    "tier_runs": tier_runs,
                    "plain_runs": plain_runs,
                    "tier_mb_s": max(tier_runs),
                    "plain_mb_s": max(plain_runs),
                    "ratio": max(tier_runs) / max(plain_runs),
                }
            finally:
                plain_client.close()

        on_moto = compare(moto.endpoint_url)
        objects = work / "objects"
        _download(client, keys, objects)
        with range_server(objects) as endpoint:
            on_loopback = compare(endpoint)
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
            "command": "make bench-tier",
            "ingest": {
                "bytes": ingested,
                "seconds": ingest_s,
                "committed_bytes": committed,
                "object_bytes": sum(sizes),
                "segments": len(manifest.segments),
                "upload_wait_s": upload_wait,
                "requests": writes,
                "write_requests": sum(writes.values()),
                "puts_per_gb": puts_per_gb,
            },
            "read": {
                "block_bytes": defaults.tier_read_block_bytes,
                "readahead_blocks": defaults.tier_readahead_blocks,
                "rounds": args.rounds,
                **on_moto,
                "loopback": on_loopback,
            },
        }
    finally:
        client.close()
        if kz is not None:
            kz.stop()
            kz.close()
        if agent is not None:
            agent.stop()
        moto.stop()
        zk.stop()
        shutil.rmtree(work, ignore_errors=True)
    table = render(result)
    publish("tier", table, result, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
