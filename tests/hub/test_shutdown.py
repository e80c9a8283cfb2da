"""Shutdown under load: every batch is either acked and on disk, or refused; never lost."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import orjson

from taproom.config import load_config
from taproom.errors import HubStopped
from taproom.hub import Hub
from taproom.journal import Journal
from taproom.records import BatchBuilder
from tests.support import HubProcess, fill, needs_mount, small_tmpfs, write_config


async def test_stop_under_load_loses_no_acked_event(tmp_path):
    config = load_config(text=f'[journal]\ndir = "{tmp_path / "j"}"\n', env={})
    hub = await Hub(config).start()
    acked: list[tuple[int, bytes]] = []
    refused = 0

    async def producer(k: int) -> None:
        nonlocal refused
        i = 0
        while True:
            b = BatchBuilder()
            payload = f"{k}:{i}".encode()
            b.add("t", payload)
            try:
                commit = await hub.ingest(b.build())
            except HubStopped:
                refused += 1
                return
            acked.append((commit.first_offset, payload))
            i += 1

    tasks = [asyncio.create_task(producer(k)) for k in range(8)]
    await asyncio.sleep(0.3)
    await hub.stop()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert refused == 8 and len(acked) > 100
    journal = Journal(tmp_path / "j")
    stored = {r.offset: r.payload for r in journal.read(0)}
    assert all(stored[offset] == payload for offset, payload in acked)
    assert len(stored) == len(acked)  # nothing committed that was not acked either


@needs_mount
def test_stop_with_the_disk_full_exits_0_with_one_line(tmp_path):
    """Issue 25, also: SIGTERM while the disk is full and a Lumberjack window waits unacked.
    It exited 1 after the grace period (and could print "Future exception was never retrieved
    ... HubStopped"); the window was never acknowledged, so its sender resends it: one line
    saying so, exit 0, within the grace period."""
    with small_tmpfs(tmp_path / "mnt", "2m") as mnt:
        config = write_config(
            tmp_path,
            enable=["lumberjack"],
            journal={"dir": str(mnt / "journal")},
            hub={"grace_period_s": 3.0},
        )
        hub = HubProcess(config).start()
        try:
            filler = fill(mnt)
            window = b"2W" + struct.pack(">I", 3)
            for seq in (1, 2, 3):  # more than the partly used last page of the segment holds
                payload = orjson.dumps({"message": "x" * 4000, "seq": seq})
                window += b"2J" + struct.pack(">II", seq, len(payload)) + payload
            with socket.create_connection(hub.address("lumberjack")) as sock:
                sock.sendall(window)
                deadline = time.monotonic() + 30
                while "commit failed" not in hub.log():
                    assert time.monotonic() < deadline, "the commit never met the full disk"
                    time.sleep(0.05)
                started = time.monotonic()
                assert hub.terminate(timeout=30) == 0
                assert time.monotonic() - started < 10
            log = hub.log()
            assert "Traceback" not in log and "never retrieved" not in log
            (line,) = [line for line in log.splitlines() if "stopped;" in line]
            assert "3 events (batches: 1) were not written" in line and "resend" in line
            filler.unlink()
        finally:
            hub.kill()
