"""`taproom serve` starts over a journal with a corrupt sealed segment, and serves.

End to end, with real clients and a real hub process: LogTK, Event BUS and Lager write their
records, the hub is SIGKILLed (no checkpoint covers them, so every start-up rebuild reads the
journal), one frame in the middle of the sealed first segment is corrupted, and the hub is
started again. It must start, skip the damaged frame (counted, shown on /ready), and rebuild
each service's state from every intact record, including those after the damage.
"""

from __future__ import annotations

import asyncio
import urllib.request

import orjson

from taproom.clients.eventbus import EventBusClient
from taproom.clients.lager import Mug, Tap
from taproom.journal import JournalReader
from taproom.journal.segments import FRAME, scan_segment, segment_name
from taproom.protocols.logtk import Ack, Data, FrameDecoder, Init, encode_frame
from taproom.servers.logtk import hash_token
from tests.support import HubProcess, write_config

TOKEN = bytes(range(64))
INIT = encode_frame(Init("json", 0x285DB4AD, None, False))
FORMAT = '<format version="BEERR01"><item name="a" type="uint32_t" size="4" offset="0"/></format>'
FILLER = b"f" * 150_000  # six of these fill most of a 1 MiB segment


async def logtk_send_acked(hub: HubProcess, idem: int) -> None:
    """One LogTK event over raw TCP with idempotency token ``idem``; returns once acked."""
    reader, writer = await asyncio.open_connection(*hub.address("logtk_tcp"))
    writer.write(b"\x01\x01" + TOKEN + b"\x00" + INIT + encode_frame(Data(b'{"n":1}', idem)))
    decoder = FrameDecoder()
    seen: list[object] = []
    try:
        while Ack(idem) not in seen:
            chunk = await asyncio.wait_for(reader.read(4096), 10)
            assert chunk, "closed before the ack"
            seen += decoder.feed(chunk)
    finally:
        writer.close()


def lager_where(hub: HubProcess) -> dict[str, str]:
    return {
        "registrar": hub.addresses["lager_registrar_snapshot"],
        "forwarder": hub.addresses["lager_forwarder_in"],
    }


async def publish(bus: EventBusClient, topic: str, data: object) -> None:
    await asyncio.wait_for(await bus.publish(topic, data), 10)


async def write_everything(hub: HubProcess) -> None:
    url = "tcp://" + hub.addresses["eventbus_snapshot"]
    async with EventBusClient([url]) as bus:
        for part in ("a", "b"):
            for i in range(3):
                await publish(bus, f"/{part}/{i}", i)
            tap = Tap(f"/Keep/{part.upper()}/", FORMAT, **lager_where(hub))
            await asyncio.to_thread(tap.register)
            tap.close()
            await logtk_send_acked(hub, 4000 + ord(part))
            for i in range(6):  # "a" fills: the damage goes here; "b" fills roll the segment
                await publish(bus, f"/fill-{part}/{i}", FILLER)
        await publish(bus, "/c/0", 0)


def corrupt_a_frame_of_the_first_segment(journal: str) -> None:
    seg = f"{journal}/{segment_name(0)}"
    positions = dict(scan_segment(seg).index)
    sealed_end = sorted(JournalReader(journal).segment_bases())[1]
    damaged = None
    for base, _count, body in JournalReader(journal).read_batches(0, sealed_end):
        if b"/fill-a/2" in body:
            damaged = base
    assert damaged is not None
    after = list(JournalReader(journal).read(damaged + 1, sealed_end))
    assert "/b/0" in {r.topic for r in after}  # intact records follow it in the same segment
    assert "/Keep/B/" in {r.stream for r in after}
    with open(seg, "r+b") as f:
        f.seek(positions[damaged] + FRAME.size + 5_000)
        f.write(b"\x00\xff\x00\xff")


def test_serve_starts_over_a_corrupt_sealed_segment_and_rebuilds_from_intact_records(tmp_path):
    journal = str(tmp_path / "journal")
    config = write_config(
        tmp_path,
        enable=["logtk", "eventbus", "lager"],
        journal={"segment_bytes": 1024 * 1024},
        logtk={"apps": {"myapp": {"token_sha256": hash_token(TOKEN)}}},
        eventbus={"checkpoint_interval_s": 0},
        lager={"checkpoint_interval_s": 3600},
    )
    hub = HubProcess(config).start()
    try:
        asyncio.run(write_everything(hub))
        hub.kill()
        assert len(JournalReader(journal).segment_bases()) >= 2
        corrupt_a_frame_of_the_first_segment(journal)
        hub.start()  # before the fix: "CRC mismatch" and the process exits

        async def state_after() -> tuple[set[str], set[str]]:
            url = "tcp://" + hub.addresses["eventbus_snapshot"]
            async with EventBusClient([url]) as bus:
                topics = set(bus.state)
            mug = Mug(**lager_where(hub))
            try:
                taps = set(await asyncio.to_thread(mug.sync))
            finally:
                mug.close()
            for part in ("a", "b"):  # already in the rebuilt idempotency index: not stored again
                await logtk_send_acked(hub, 4000 + ord(part))
            return topics, taps

        topics, taps = asyncio.run(state_after())
        fill_a = {f"/fill-a/{i}" for i in range(6)}
        assert topics == {"/a/0", "/a/1", "/a/2", "/b/0", "/b/1", "/b/2", "/c/0"} | (
            fill_a - {"/fill-a/2"}
        ) | {f"/fill-b/{i}" for i in range(6)}
        assert taps == {"/Keep/A/", "/Keep/B/"}
        web = hub.addresses["web"]
        with urllib.request.urlopen(f"http://{web}/ready", timeout=10) as response:
            ready = orjson.loads(response.read())
        assert ready["ready"] is True
        assert any("lost" in line for line in ready["degraded"])
        with urllib.request.urlopen(f"http://{web}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert 'taproom_journal_lost_events_total{reason="crc_mismatch"} 1.0' in metrics
        assert "taproom_logtk_duplicates_events_total 2.0" in metrics
    finally:
        hub.kill()
    logtk = [r for r in JournalReader(journal).read(0) if r.protocol == "logtk"]
    assert len(logtk) == 2
