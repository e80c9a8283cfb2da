"""Issue 24: every window a real Filebeat sends is taken, and no part of a refused one is stored
twice.

The sender here behaves as go-lumber's client/v2 (Filebeat): ``W n`` then one zlib ``C`` frame
of ``J`` frames numbered from 1, then it reads acks until the sequence reaches ``n``; a lower
sequence is a partial ack, and when the connection ends first it sends the rest again (with
sequence numbers from 1 again) on a new connection. Every event carries its ``id``; the tests
count the ids in the journal.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import random
import socket
import struct
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from taproom.app import App
from taproom.protocols.lumberjack import CompressedFrame, JsonFrame, WindowSizeFrame
from tests.support import running_app

MiB = 1 << 20
_WORDS = [f"w{i:x}" for i in range(64)] + ["GET", "POST", "/api/v1", "200", "500", "user=", "at"]


def text(size: int, seed: int) -> str:
    """Log-like text (compresses about 4:1 at zlib 3, like the issue's 40 KiB events)."""
    rng = random.Random(seed)
    words = rng.choices(_WORDS, k=size // 3)
    return " ".join(words)[:size]


def incompressible(size: int) -> str:
    """Printable and JSON-safe, compresses only to ~82% (base85 of random bytes)."""
    return base64.b85encode(os.urandom(size * 4 // 5)).decode()[:size]


def event(i: int, message: str) -> bytes:
    return orjson.dumps({"id": i, "message": message, "fields": {"app": "big"}})


def window(payloads: list[bytes], level: int = 3) -> bytes:
    """Filebeat's window: W n, one C frame of J frames numbered 1..n."""
    frames = b"".join(JsonFrame(seq, p).serialize() for seq, p in enumerate(payloads, 1))
    return WindowSizeFrame(len(payloads)).serialize() + CompressedFrame.compress(frames, level)


@dataclass
class Try:
    acked: int  # the highest sequence acknowledged on this connection (0: none)
    closed: bool  # the hub closed the connection before acking the whole window
    acks: list[int] = field(default_factory=list)


def send_window(address: tuple[str, int], data: bytes, count: int, *, cut: int = 0) -> Try:
    """One try: send ``data`` (only its first ``cut`` bytes if given, then stop sending), read
    acks until ``count`` is acknowledged or the connection ends."""
    acks: list[int] = []
    with socket.create_connection(address, timeout=120) as sock:
        with contextlib.suppress(OSError):  # the hub may close while we still send
            sock.sendall(data[:cut] if cut else data)
        if cut:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
        buf = b""
        while not acks or acks[-1] < count:
            try:
                chunk = sock.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            while len(buf) >= 6:
                version, kind, seq = struct.unpack(">BBI", buf[:6])
                assert (version, kind) == (0x32, 0x41), buf[:6]
                buf = buf[6:]
                if seq:  # 0 is a keepalive
                    acks.append(seq)
    acked = max(acks, default=0)
    return Try(acked, acked < count, acks)


def stored_ids(app: App) -> Counter[int]:
    return Counter(
        orjson.loads(r.payload)["id"] for r in app.hub.journal.read(0) if r.protocol == "lumberjack"
    )


def address(app: App) -> tuple[str, int]:
    host, port = app.addresses["lumberjack"].rsplit(":", 1)
    return host, int(port)


def rejected(app: App, reason: str) -> float:
    value = app.hub.metrics.registry.get_sample_value(
        "taproom_ingest_rejected_items_total", {"protocol": "lumberjack", "reason": reason}
    )
    return value or 0.0


async def test_2048_events_of_40_kib_in_one_window_acked_in_full_stored_once(
    tmp_path: Path,
) -> None:
    # 85 MB inflated: refused as decompressed_too_large after ~1,400 events were committed,
    # which every resend stored again.
    base = text(80 * 1024, 24)
    payloads = [event(i, base[i % 997 : i % 997 + 40 * 1024]) for i in range(2048)]
    data = window(payloads)
    async with running_app(tmp_path, enable=["lumberjack"]) as app:
        outcome = await asyncio.to_thread(send_window, address(app), data, 2048)
        assert outcome.acked == 2048 and not outcome.closed
        assert outcome.acks == sorted(outcome.acks)  # partial acks, then the whole window
        ids = stored_ids(app)
    assert sorted(ids) == list(range(2048)) and set(ids.values()) == {1}


async def test_two_events_of_nearly_10_mib_at_zlib_3_acked_and_stored(tmp_path: Path) -> None:
    # Under Filebeat's 10 MiB max_bytes each, 17 MB compressed: over the old 16 MiB frame bound
    # (the connection was reset on every try).
    payloads = [event(i, incompressible(int(9.9 * MiB))) for i in range(2)]
    data = window(payloads)
    assert len(data) > 16 * MiB
    async with running_app(tmp_path, enable=["lumberjack"]) as app:
        outcome = await asyncio.to_thread(send_window, address(app), data, 2)
        assert outcome.acked == 2
        records = [r for r in app.hub.journal.read(0) if r.protocol == "lumberjack"]
    assert [r.payload for r in records] == payloads


async def test_a_window_cut_off_halfway_then_resent_whole_stores_every_event_once(
    tmp_path: Path,
) -> None:
    # A shipper that dies halfway through its compressed frame never saw an ack for what the
    # hub committed of it, and sends the whole window again.
    payloads = [event(i, incompressible(5 * MiB)) for i in range(4)]
    data = window(payloads)
    assert len(data) > 16 * MiB  # the old frame bound refused the resend every time
    async with running_app(tmp_path, enable=["lumberjack"]) as app:
        first = await asyncio.to_thread(send_window, address(app), data, 4, cut=len(data) // 2)
        assert first.closed
        second = await asyncio.to_thread(send_window, address(app), data, 4)
        assert second.acked == 4 and not second.closed
        ids = stored_ids(app)
    assert ids == Counter({0: 1, 1: 1, 2: 1, 3: 1})


async def test_a_malformed_event_gets_the_events_before_it_acked_once(tmp_path: Path) -> None:
    # The 1,500th of 2,048 events is not JSON: the first 1,499 are committed and acknowledged
    # (a partial ack, before the close); the rest, sent again, is stored once; the bad one is
    # refused on each try and counted.
    base = text(64 * 1024, 15)
    good = [event(i, base[i % 991 : i % 991 + 8 * 1024]) for i in range(2048)]
    bad = b'{"id": 1499, "message": not json}'
    payloads = [*good[:1499], bad, *good[1500:]]
    async with running_app(tmp_path, enable=["lumberjack"]) as app:
        first = await asyncio.to_thread(send_window, address(app), window(payloads), 2048)
        assert first.closed and first.acked == 1499
        assert rejected(app, "bad_json") == 1
        rest = payloads[1499:]
        for attempt in range(2, 4):  # the shipper retries the rest, bad event first
            again = await asyncio.to_thread(send_window, address(app), window(rest), len(rest))
            assert again.closed and again.acked == 0
            assert rejected(app, "bad_json") == attempt
        # ... until it drops the bad event (Filebeat's drop after max_retries)
        rest = rest[1:]
        last = await asyncio.to_thread(send_window, address(app), window(rest), len(rest))
        assert last.acked == len(rest) and not last.closed
        ids = stored_ids(app)
    assert sorted(ids) == [i for i in range(2048) if i != 1499] and set(ids.values()) == {1}


async def test_the_same_refused_windows_resent_whole_three_times_store_each_event_once(
    tmp_path: Path,
) -> None:
    # A shipper that ignores partial acks (or never got them) resends whole windows: what a
    # refused window left committed is recognised in the resend and not stored again.
    base = text(64 * 1024, 7)
    good = [event(i, base[i % 983 : i % 983 + 8 * 1024]) for i in range(2000)]
    malformed = [*good[:1500], b"[1, 2", *good[1500:]]
    oversized = [*good[:1200], event(-1, "x" * (13 * MiB)), *good[1200:]]  # over max_event
    too_many = WindowSizeFrame(20_000).serialize()  # over max_window: refused at W
    async with running_app(tmp_path, enable=["lumberjack"]) as app:
        for _ in range(3):
            for payloads in (malformed, oversized):
                outcome = await asyncio.to_thread(
                    send_window, address(app), window(payloads), len(payloads)
                )
                assert outcome.closed
            outcome = await asyncio.to_thread(send_window, address(app), too_many, 1)
            assert outcome.closed and outcome.acked == 0
        ids = stored_ids(app)
        assert rejected(app, "bad_json") == 3
        assert rejected(app, "frame_too_large") == 3
        assert rejected(app, "window_too_large") == 3
    assert all(count == 1 for count in ids.values()), [i for i, n in ids.items() if n > 1]
    assert set(range(1500)) <= set(ids)  # what came before the bad event: stored, once


def test_helpers_build_what_filebeat_sends() -> None:
    payloads = [event(i, "m") for i in range(3)]
    data = window(payloads, level=1)
    assert data[:6] == b"2W\x00\x00\x00\x03" and data[6:8] == b"2C"
    inner = zlib.decompress(data[12:])
    assert inner == b"".join(JsonFrame(s, p).serialize() for s, p in enumerate(payloads, 1))
