"""The journal's network read API over real HTTP, and its client (``HubJournal``).

What a network reader gets equals what the local reader gets, damage and all; every bad
request gets a 4xx with a JSON reason and leaves the hub serving; the network's own faults
(a flipped bit, a cut connection) are errors naming the journal and offset, never rows; slow
readers are held back by TCP, not buffered; retention keeps what registered readers have not
read, up to its cap, and then says so.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import ClientSession

from taproom.errors import CorruptTransfer, HubUnavailable, OffsetsDeleted
from taproom.journal import Journal, JournalReader
from taproom.journal.remote import HubJournal
from taproom.records import BatchBuilder, EncodedBatch
from tests.spark.generate import write_damaged_journal
from tests.support import running_app

from .proxy import FaultyProxy


def _batch(n: int, size: int = 1000, tag: str = "e") -> EncodedBatch:
    builder = BatchBuilder()
    for i in range(n):
        builder.add("test", f"{tag}{i}".encode().ljust(size, b"."), seq=i)
    return builder.build()


def _fill(path: Path, batches: int, n: int = 100, size: int = 1000) -> None:
    journal = Journal(path, fsync="off", segment_bytes=1 << 20)
    for _ in range(batches):
        journal.commit([_batch(n, size)])
    journal.close()


def _rejected(app: Any, reason: str) -> float:
    value = app.hub.metrics.registry.get_sample_value(
        "taproom_ingest_rejected_items_total", {"protocol": "journal_read", "reason": reason}
    )
    return value or 0.0


async def _get(http: ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with http.get(url) as reply:
        return reply.status, orjson.loads(await reply.read())


async def test_network_reads_equal_the_local_reader_over_damage(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    intact = write_damaged_journal(journal)
    local = list(JournalReader(journal).read_batches(0))
    assert {o for b, c, _ in local for o in range(b, b + c)} == intact
    async with running_app(tmp_path) as app:
        hub = HubJournal(app.addresses["web"])
        info = await asyncio.to_thread(hub.info)
        assert info.id == app.hub.journal.id and info.end_offset == 3200
        assert [s.sealed for s in info.segments] == [True] * (len(info.segments) - 1) + [False]
        for budget in (1 << 20, 64 << 10):  # one request per partition, or one per frame
            got = await asyncio.to_thread(
                lambda b=budget: list(hub.read_batches(0, 3200, journal_id=info.id, budget=b))
            )
            assert got == local
        # From inside a frame: the frame holding the offset comes first, as locally.
        middle = await asyncio.to_thread(lambda: list(hub.read_batches(1010, 2000)))
        assert middle == list(JournalReader(journal).read_batches(1010, 2000))
        assert app.hub.journal.damage()  # the hub quarantined what it walked past
        hub.close()


async def test_bad_requests_get_json_4xx_and_the_hub_goes_on(tmp_path: Path) -> None:
    _fill(tmp_path / "journal", 40)  # ~4 MiB: four sealed segments and an active one
    async with running_app(tmp_path, journal={"max_read_bytes": 4 << 20}) as app:
        app.hub.journal.enforce_retention(3 << 20, 0)  # the first segments are gone
        first, end = app.hub.journal.first_offset, app.hub.journal.end_offset
        assert first > 0
        base = f"http://{app.addresses['web']}/api/journal/read"
        cases = {
            "from=abc": (400, "bad_request"),
            "from=-1": (400, "bad_request"),
            "from=1e3": (400, "bad_request"),
            "": (400, "bad_request"),
            f"from={first - 1}": (410, "offsets_deleted"),
            f"from={end + 1}": (416, "beyond_end"),
            f"from={first}&budget=0": (400, "bad_request"),
            f"from={first}&budget={(1 << 30) + 1}": (400, "bad_request"),
            f"from={first}&budget=99999999999999999999999": (400, "bad_request"),
            f"from={first + 10}&to={first}": (400, "bad_request"),
        }
        async with ClientSession() as http:
            for query, (status, error) in cases.items():
                got, body = await _get(http, f"{base}?{query}")
                assert (got, body["error"]) == (status, error), query
                assert body["reason"]
            _, deleted = await _get(http, f"{base}?from=0")
            assert deleted["first_offset"] == first and deleted["requested"] == 0
            assert _rejected(app, "bad_request") == 8
            assert _rejected(app, "offsets_deleted") == 2
            async with http.get(f"http://{app.addresses['web']}/ready") as ready:
                assert ready.status == 200
        hub = HubJournal(app.addresses["web"])
        with pytest.raises(OffsetsDeleted) as lost:
            await asyncio.to_thread(lambda: list(hub.read_batches(0, end)))
        assert lost.value.first_offset == first
        batches = await asyncio.to_thread(lambda: list(hub.read_batches(first, end)))
        assert sum(c for _, c, _ in batches) == end - first


async def test_the_token_is_required_when_set(tmp_path: Path) -> None:
    _fill(tmp_path / "journal", 2)
    async with running_app(tmp_path, web={"token": "s3cret"}) as app:
        url = f"http://{app.addresses['web']}/api/journal/read?from=0"
        async with ClientSession() as http:
            status, body = await _get(http, url)
            assert status == 401 and body["error"] == "unauthorized"
        with pytest.raises(HubUnavailable, match=r"hub unavailable: .*HTTP 401"):
            await asyncio.to_thread(HubJournal(app.addresses["web"]).info)
        with_token = HubJournal(app.addresses["web"], token="s3cret")
        batches = await asyncio.to_thread(lambda: list(with_token.read_batches(0, 200)))
        assert sum(c for _, c, _ in batches) == 200


async def test_a_bit_flipped_on_the_way_fails_naming_journal_and_offset(tmp_path: Path) -> None:
    _fill(tmp_path / "journal", 20)
    async with running_app(tmp_path) as app:
        expected = list(app.hub.journal.read_batches(0))
        journal_id = app.hub.journal.id
        # Past the HTTP head, inside the first frame's body (frames are ~100 KiB).
        with FaultyProxy(app.addresses["web"], flip_at=50_000) as proxy:
            hub = HubJournal(proxy.address)
            with pytest.raises(CorruptTransfer) as failed:
                await asyncio.to_thread(lambda: list(hub.read_batches(0, 2000)))
            assert proxy.faults == 1
            assert failed.value.journal_id == journal_id and failed.value.offset == 0
            assert journal_id in str(failed.value) and "offset 0" in str(failed.value)
            # A retry (the next Spark task attempt) reads it again, clean.
            again = await asyncio.to_thread(lambda: list(hub.read_batches(0, 2000)))
            assert again == expected


async def test_a_cut_connection_is_an_error_not_an_end(tmp_path: Path) -> None:
    _fill(tmp_path / "journal", 20)
    async with running_app(tmp_path) as app:
        with FaultyProxy(app.addresses["web"], cut_at=300_000) as proxy:
            hub = HubJournal(proxy.address)
            with pytest.raises(HubUnavailable, match="cut off"):
                await asyncio.to_thread(lambda: list(hub.read_batches(0, 2000)))
            assert proxy.faults == 1
            got = await asyncio.to_thread(lambda: list(hub.read_batches(0, 2000)))
            assert sum(c for _, c, _ in got) == 2000


def _open_read(address: str, query: str) -> socket.socket:
    """A reader that asks and then takes nothing (a tiny receive buffer)."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(f"GET /api/journal/read?{query} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return sock


async def test_slow_readers_get_backpressure_a_bound_and_a_timeout(tmp_path: Path) -> None:
    _fill(tmp_path / "journal", 300, n=100, size=1000)  # ~30 MiB
    config = {"max_remote_readers": 1, "remote_write_timeout_s": 3}
    async with running_app(tmp_path, journal=config) as app:
        web = app.addresses["web"]
        metrics = app.hub.metrics.registry
        stalled = _open_read(web, "from=0&budget=67108864")
        try:

            def sent() -> float:
                return metrics.get_sample_value("taproom_journal_remote_read_bytes_total") or 0.0

            deadline = time.monotonic() + 30
            while sent() == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1)
            # Held back by TCP: a few socket buffers' worth, not the 30 MiB asked for.
            assert 0 < sent() < 12 << 20
            async with ClientSession() as http:
                status, body = await _get(http, f"http://{web}/api/journal/read?from=0")
                assert status == 429 and body["error"] == "too_many_readers"
                async with http.get(f"http://{web}/health") as health:
                    assert health.status == 200  # the loop is free
            commit = await asyncio.wait_for(app.hub.ingest(_batch(10)), 10)  # and ingest too
            assert commit.count == 10
            deadline = time.monotonic() + 30
            while _rejected(app, "slow_reader") == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert _rejected(app, "slow_reader") == 1
        finally:
            stalled.close()
        # The slot is free again: a reader that reads gets everything.
        hub = HubJournal(web)
        got = await asyncio.to_thread(lambda: list(hub.read_batches(0, 30010)))
        assert sum(c for _, c, _ in got) == 30010


async def _wait(condition: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.1)


async def test_retention_keeps_what_registered_readers_have_not_read(tmp_path: Path) -> None:
    journal = {
        "segment_bytes": 1 << 20,
        "retention_bytes": 2 << 20,
        "retain_unread": True,
        "retain_unread_max_bytes": 6 << 20,
    }
    async with running_app(tmp_path, journal=journal) as app:
        base = f"http://{app.addresses['web']}/api/journal"
        hub = HubJournal(app.addresses["web"])
        assert (await asyncio.to_thread(hub.report_cursor, "spark-requests", 0))["lag"] == 0
        for _ in range(45):  # ~4.5 MiB: over retention_bytes, under the cap
            await app.hub.ingest(_batch(100))
        await asyncio.sleep(3)  # housekeeping runs within a second or two of idle
        assert app.hub.journal.first_offset == 0  # kept: the reader has not passed it
        # The reader commits up to 3000: segments it passed may go now.
        await asyncio.to_thread(hub.report_cursor, "spark-requests", 3000)
        await _wait(lambda: app.hub.journal.first_offset > 0)
        assert app.hub.journal.first_offset <= 3000
        async with ClientSession() as http:
            _, listing = await _get(http, f"{base}/cursors")
        assert listing["retain_unread"] is True
        assert listing["cursors"] == [
            {"name": "spark-requests", "offset": 3000, "lag": 1500, "lost": 0}
        ]
        # Then the reader stops for good: the cap makes the oldest go anyway, and it hears so.
        for _ in range(70):  # ~7 MiB more: over the 6 MiB cap
            await app.hub.ingest(_batch(100))
        # Retention deletes a segment at a time, in passes that may run while the batches
        # still arrive: the cap holds once a pass has run after the last of them.
        await _wait(lambda: app.hub.journal.total_bytes <= 6 << 20, timeout=60)
        assert app.hub.journal.first_offset > 3000
        lost = app.hub.journal.first_offset - 3000
        assert (
            app.hub.metrics.registry.get_sample_value("taproom_journal_unread_deleted_events_total")
            == lost
        )
        with pytest.raises(OffsetsDeleted):
            await asyncio.to_thread(lambda: list(hub.read_batches(3000, 4000)))
        with pytest.raises(OffsetsDeleted, match="deleted by retention"):
            await asyncio.to_thread(hub.report_cursor, "spark-requests", 3000)
        async with ClientSession() as http:
            _, listing = await _get(http, f"{base}/cursors")
            assert listing["cursors"][0]["lost"] == lost
            async with http.delete(f"{base}/cursors/spark-requests") as gone:
                assert gone.status == 200
            async with http.put(f"{base}/cursors/bad%20name?offset=1") as bad:
                assert bad.status == 400
            async with http.put(f"{base}/cursors/x?offset=99999999") as beyond:
                assert beyond.status == 416
            _, listing = await _get(http, f"{base}/cursors")
            assert listing["cursors"] == []
