"""/metrics, /health and /ready over real HTTP, the web listener's bounds, and the disk-full
path seen through /ready."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
import urllib.request

import orjson
import pytest

from taproom.records import BatchBuilder
from tests.support import (
    HubProcess,
    fill,
    needs_mount,
    queued_connects,
    running_app,
    small_tmpfs,
    write_config,
)


async def http(address: str, request: bytes) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def get(address: str, path: str) -> tuple[int, bytes]:
    return await http(address, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())


async def test_health_ready_metrics(tmp_path):
    async with running_app(tmp_path) as app:
        web = app.addresses["web"]
        assert await get(web, "/health") == (200, b'{"status":"alive"}\n')
        status, body = await get(web, "/ready")
        assert status == 200 and orjson.loads(body) == {
            "ready": True,
            "reasons": [],
            "degraded": [],
        }
        b = BatchBuilder()
        b.add("test", b"x")
        await app.hub.ingest(b.build())
        status, body = await get(web, "/metrics")
        assert status == 200
        assert b"taproom_journal_appended_events_total 1.0" in body
        assert b"# TYPE taproom_hub_commit_latency_seconds histogram" in body


async def test_bad_requests_get_4xx_and_are_counted(tmp_path):
    async with running_app(tmp_path) as app:
        web = app.addresses["web"]
        assert (await get(web, "/nope"))[0] == 404
        # HTTP/1.1 requires Host; the first server took a request without one, aiohttp says 400.
        assert (await http(web, b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n"))[0] == 405
        assert (await http(web, b"garbage\r\n\r\n"))[0] == 400
        assert (await http(web, b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n"))[0] == 431
        _, body = await get(web, "/metrics")
        assert b'taproom_web_requests_calls_total{reason="not_found"} 1.0' in body
        assert b'taproom_web_requests_calls_total{reason="method_not_allowed"} 1.0' in body
        assert b'taproom_web_requests_calls_total{reason="bad_request"} 1.0' in body
        assert b'taproom_web_requests_calls_total{reason="head_too_large"} 1.0' in body


async def test_head_has_no_body(tmp_path):
    """Issue 19 item 13: HEAD answered with the GET's headers and no body."""
    async with running_app(tmp_path) as app:
        host, port = app.addresses["web"].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert b"Content-Length: 19" in head and body == b""


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 65536 + b"\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Many: y\r\n" * 200 + b"\r\n",
    ],
    ids=["64KiB-field", "9000-byte-field", "200-fields"],
)
async def test_large_heads_get_431(tmp_path, request_bytes):
    """Issue 19 item 13: a header of 64 KiB or more got 400; any oversized head is 431."""
    async with running_app(tmp_path) as app:
        assert (await http(app.addresses["web"], request_bytes))[0] == 431


async def test_head_timeout_closes_slow_heads(tmp_path):
    async with running_app(tmp_path, web={"head_timeout_s": 0.5}) as app:
        host, port = app.addresses["web"].rsplit(":", 1)
        held = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
        for _, writer in held:
            writer.write(b"GET /heal")  # an unfinished head: the slow-loris shape
            await writer.drain()
        for reader, writer in held:
            with contextlib.suppress(ConnectionError):
                assert await asyncio.wait_for(reader.read(), 10) == b""
            writer.close()
        sample = "taproom_web_requests_calls_total"
        assert app.hub.metrics.registry.get_sample_value(sample, {"reason": "timeout"}) == 2


async def test_connections_without_a_request_make_room_for_a_client(tmp_path):
    """At max_connections, idle connections (a connect flood) must not lock out a client:
    the client is served and the oldest connection without a request is evicted."""
    async with running_app(
        tmp_path, web={"max_connections": 2, "accept_batch": 10, "head_timeout_s": 60}
    ) as app:
        host, port = app.addresses["web"].rsplit(":", 1)
        held = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
        for _, writer in held:
            writer.write(b"GET /heal")
            await writer.drain()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /api/overview HTTP/1.1\r\nHost: x\r\n\r\n")  # then kept alive
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")  # served, over the limit for a moment
        held.append((reader, writer))
        first_reader, _ = held[0]
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(first_reader.read(), 10) == b""  # the oldest went
        sample = "taproom_web_requests_calls_total"
        assert app.hub.metrics.registry.get_sample_value(sample, {"reason": "evicted"}) == 1
        for _, writer in held:
            writer.close()


async def test_accept_queue_holds_a_burst(tmp_path):
    """listen_backlog is the kernel's accept queue: 300 connects while the loop accepts none
    all complete (with 100, SYNs past it were dropped: /health retried after 1 s)."""
    async with running_app(tmp_path) as app:
        host, port = app.addresses["web"].rsplit(":", 1)
        assert queued_connects((host, int(port)), 300) == 300


async def test_connections_reach_the_loop_with_their_first_bytes(tmp_path):
    """TCP_DEFER_ACCEPT: a connection that sent nothing yet (a connect/RST flood's) costs the
    loop nothing; one that sends its request is served at once."""
    async with running_app(tmp_path) as app:
        host, port = app.addresses["web"].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        await asyncio.sleep(0.5)
        assert app._web.open_connections == 0  # connected, silent: not accepted yet
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        writer.close()


async def test_hard_connection_limit(tmp_path):
    """max_connections + accept_batch connections that all sent requests: one more is
    closed at once."""
    async with running_app(tmp_path, web={"max_connections": 1, "accept_batch": 1}) as app:
        host, port = app.addresses["web"].rsplit(":", 1)
        kept = []
        for _ in range(2):  # keep-alive connections that were answered stay open
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /api/overview HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(
                b"HTTP/1.1 200"
            )
            kept.append(writer)
        reader, writer = await asyncio.open_connection(host, int(port))
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        sample = "taproom_web_requests_calls_total"
        registry = app.hub.metrics.registry
        assert registry.get_sample_value(sample, {"reason": "too_many_connections"}) == 1
        assert registry.get_sample_value(sample, {"reason": "evicted"}) is None
        for writer in kept:
            writer.close()


def test_health_answers_through_a_connect_reset_flood(tmp_path):
    """3,000 connect/RST cycles against a hub process: every /health asked meanwhile, and
    one after, is answered (issue 13 with edge's probe: a flood must not lock clients out)."""
    with HubProcess(write_config(tmp_path)) as hub:
        host, port = hub.address("web")
        done = threading.Event()

        def flood() -> None:
            for _ in range(3000):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                with contextlib.suppress(OSError):
                    sock.connect((host, port))
                sock.close()
            done.set()

        thread = threading.Thread(target=flood)
        thread.start()
        answers = []
        while not done.is_set():
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=10) as r:
                answers.append(r.status)
            time.sleep(0.02)
        thread.join()
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=10) as r:
            answers.append(r.status)
        assert answers and set(answers) == {200}


@needs_mount
async def test_disk_full_pauses_acks_reports_not_ready_and_recovers(tmp_path):
    with small_tmpfs(tmp_path / "mnt", "2m") as mnt:
        async with running_app(tmp_path, journal={"dir": str(mnt / "journal")}) as app:
            web = app.addresses["web"]
            first = BatchBuilder()
            first.add("test", b"before")
            await app.hub.ingest(first.build())
            filler = fill(mnt)
            b = BatchBuilder()
            b.add("test", b"y" * 200_000)
            future = app.hub.submit(b.build())
            for _ in range(100):
                status, body = await get(web, "/ready")
                if status == 503:
                    break
                await asyncio.sleep(0.05)
            assert status == 503 and b"no space" in body
            assert not future.done()  # never acked while it is not on disk
            filler.unlink()
            commit = await asyncio.wait_for(future, 10)
            assert commit.first_offset == 1
            assert (await get(web, "/ready"))[0] == 200
            assert [r.payload[:6] for r in app.hub.journal.read(0)] == [b"before", b"yyyyyy"]
            failures = app.hub.metrics.registry.get_sample_value(
                "taproom_hub_commit_failures_events_total", {"reason": "disk_full"}
            )
            assert failures and failures >= 1
