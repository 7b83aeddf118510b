"""Overload load generator: many connections pipelining one pre-encoded produce request.

``python -m bench.overload flood HOST:PORT TOPIC PARTITIONS SECONDS CONNECTIONS`` opens
``CONNECTIONS`` connections and on each writes produce requests (acks=1, one batch of 1,000
values of 1 KiB, encoded once) back to back for ``SECONDS``, as fast as TCP takes them, reading
the answers on the side; it prints one JSON line (bytes and requests written, answers, errors).
Encoding once and replaying bytes is what lets one Python process offer far more than an agent
can take: the SDK producer spends its CPU encoding.

``python -m bench.overload sink`` is a discard server (prints its port, reads and drops
frames): pointed at it, the generator shows how much it can *offer*, its capacity, measured in
the same run as the overload itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from typing import Any

from storage.codec import encode_batch
from storage.protocol import encode_request, parse_response, read_size
from storage.protocol import messages as m

RECORDS = 1000
SIZE = 1024


def frames(topic: str, partitions: int) -> list[bytes]:
    batch = encode_batch([os.urandom(SIZE)] * RECORDS)
    out = []
    for p in range(partitions):
        request = m.ProduceRequest(
            1, 30_000, [m.ProduceTopic(topic, [m.ProducePartition(p, batch)])]
        )
        out.append(
            b"".join(bytes(x) for x in encode_request(m.ApiKey.PRODUCE, 0, "flood", request))
        )
    return out


def flood(address: str, topic: str, partitions: int, seconds: float, conns: int) -> dict[str, Any]:
    """Blocking sockets, two threads per connection (``sendall`` and ``recv`` release the GIL,
    so one process offers close to what loopback carries)."""
    host, _, port = address.rpartition(":")
    payloads = frames(topic, partitions)
    lock = threading.Lock()
    totals = {"bytes": 0, "requests": 0, "answers": 0, "errors": 0}
    stop = threading.Event()

    def answers(sock: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError), sock.makefile("rb", buffering=1 << 16) as f:
            while head := f.read(4):
                if len(head) < 4:
                    break
                frame = f.read(read_size(head, 1 << 20))
                resp = parse_response(frame)
                failed = resp.error() is not None
                if not failed:
                    body = m.APIS[m.ApiKey.PRODUCE].response.decode(resp.body)
                    failed = any(p.error_code for t in body.topics for p in t.partitions)
                with lock:
                    totals["answers"] += 1
                    totals["errors"] += failed

    def one(i: int) -> None:
        # every send and receive has a deadline: a peer that stops reading for 30 s ends
        # this connection's run instead of hanging it
        sock = socket.create_connection((host, int(port)), timeout=30)
        reader = threading.Thread(target=answers, args=(sock,), daemon=True)
        reader.start()
        n, sent, requests = i, 0, 0
        try:
            while not stop.is_set():
                frame = payloads[n % len(payloads)]
                sock.sendall(frame)  # blocks while the peer does not read: TCP backpressure
                n += 1
                sent += len(frame)
                requests += 1
        except OSError:
            pass
        finally:
            with lock:
                totals["bytes"] += sent
                totals["requests"] += requests
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(conns)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    stop.wait(seconds)  # the run's length
    stop.set()
    elapsed = time.perf_counter() - start
    for t in threads:
        t.join(timeout=60)  # a sender blocked in sendall returns within its socket timeout
    return totals | {"seconds": elapsed, "connections": conns}


def sink() -> None:
    """Accept connections and drop what they send (``recv_into`` one buffer per thread)."""
    server = socket.create_server(("127.0.0.1", 0))
    print(server.getsockname()[1], flush=True)

    def drop(conn: socket.socket) -> None:
        buf = bytearray(1 << 20)
        conn.settimeout(60)  # a generator that went away without closing: give up on it
        with contextlib.suppress(OSError), conn:
            while conn.recv_into(buf):
                pass

    while True:
        conn, _ = server.accept()
        threading.Thread(target=drop, args=(conn,), daemon=True).start()


def main(argv: list[str]) -> int:
    if argv[:1] == ["sink"]:
        sink()
        return 0
    if argv[:1] == ["flood"] and len(argv) == 6:
        address, topic, parts, seconds, conns = argv[1:]
        result = flood(address, topic, int(parts), float(seconds), int(conns))
        print(json.dumps(result), flush=True)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
