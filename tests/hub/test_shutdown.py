"""Shutdown under load: every batch is either acked and on disk, or refused; never lost."""

from __future__ import annotations

import asyncio

from taproom.config import load_config
from taproom.errors import HubStopped
from taproom.hub import Hub
from taproom.journal import Journal
from taproom.records import BatchBuilder


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
