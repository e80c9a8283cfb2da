"""servers/lager/ against what nasa/lager's programs do (test peers in
tests/protocols/lager/nasa_peer.py): the forwarder's output as a real Mug reads it, and a
restarted real Tap that comes back under a new uuid."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from taproom.protocols.lager.formats import parse_format_xml
from tests.protocols.lager.nasa_peer import NasaMug, NasaTap
from tests.servers.test_lager import (
    NASA_XML,
    Peer,
    register,
    rejected,
    tcp,
    until_rejected,
)
from tests.support import running_app

# Every test on taproom.zmqburst's compiled path and on its pure-Python twin.
pytestmark = pytest.mark.usefixtures("zmq_path")


class TestWireConformance:
    """What a SUB subscribed to everything sees on the forwarder's output (F+1) is what
    nasa/lager's forwarder would carry: data messages only, one frame per item."""

    async def test_only_data_messages_under_load_and_hugz(self, tmp_path: Path) -> None:
        async with running_app(
            tmp_path, enable=["lager"], lager={"hugz_interval_s": 0.05, "mark_repeat": 5}
        ) as app:
            peer = Peer(app.addresses)
            registrar = app.addresses["lager_registrar_snapshot"]
            fwd_in = app.addresses["lager_forwarder_in"]
            nasa = NasaTap(peer.ctx, registrar, fwd_in, "/Conf/Nasa/", NASA_XML)
            seed_u = uuid.uuid4().bytes
            fmt = parse_format_xml(NASA_XML)
            sizes = [item.size for item in fmt.items]
            mug = NasaMug(peer.ctx, tcp(app.addresses["lager_forwarder_out"]),
                          {nasa.uuid: sizes, seed_u: sizes})  # fmt: skip
            n = 2000
            try:
                await peer.settle()
                await nasa.register()
                await register(peer, "/Conf/Seed/", seed_u, NASA_XML)
                while await mug.read(0.2) is None:  # the mug's subscription is in place
                    await nasa.log(0, [fmt.encode_row({"a": 0, "b": 0.0})[:4], bytes(8)])
                while await mug.read(0.3) is not None:
                    pass
                mug.rows.clear()
                await peer.subscribe_data(b"")  # a taproom mug on F+2: hellos, marks flow

                def row(i: int) -> bytes:
                    return fmt.encode_row({"a": i, "b": i / 2})

                async def send() -> None:
                    for i in range(1, n + 1):
                        await nasa.log(i, [row(i)[:4], row(i)[4:]])
                        await peer.data_in.send_multipart(
                            [seed_u, b"\x01\x00", b"\x00\x00", i.to_bytes(8, "big"), row(i)]
                        )
                        if i % 500 == 0:
                            await peer.subscribe_data(uuid.uuid4().bytes)  # a hello mid-stream
                            await asyncio.sleep(0.06)  # HUGZ rounds (and mark repeats) too

                async def receive() -> None:
                    while len(mug.rows) < 2 * n:
                        assert await mug.read(10) is not None, len(mug.rows)

                await asyncio.gather(send(), receive())
                await asyncio.sleep(0.3)  # a HUGZ round with marks after the last row
                assert await mug.read(0.2) is None
            finally:
                mug.close()
                nasa.close()
                peer.close()
        by_tap: dict[bytes, list[bytes]] = {nasa.uuid: [], seed_u: []}
        for keg_row in mug.rows:
            by_tap[keg_row[:16]].append(keg_row[16:])
        for rows in by_tap.values():  # both taps, every row, in order, values exact
            assert rows == [i.to_bytes(8, "big") + row(i) for i in range(1, n + 1)]


class TestRestartedTap:
    """A restarted nasa/lager Tap comes back under a new uuid with the same key, and its client
    takes the registrar's entry (same key, same format) as its own: taproom refused all its rows
    as unknown_tap. Now the key moves to the new uuid once the old one is gone."""

    LAGER = {"takeover_after_s": 0.5, "unknown_tap_hold_s": 8.0, "hugz_interval_s": 0.2}
    FMT = parse_format_xml(NASA_XML)

    def row(self, i: int) -> list[bytes]:
        row = self.FMT.encode_row({"a": i, "b": i / 2})
        return [row[:4], row[4:]]

    async def journaled(self, app: Any, producer: bytes, want: int) -> list[int]:
        deadline = time.monotonic() + 15
        text = str(uuid.UUID(bytes=producer))
        while True:
            got = [r.ts_ns for r in app.hub.journal.read(0)
                   if r.content_type == "lager" and r.producer == text]  # fmt: skip
            if len(got) >= want or time.monotonic() > deadline:
                return got
            await asyncio.sleep(0.1)

    async def test_restarted_taps_keep_every_row(self, tmp_path: Path) -> None:
        async with running_app(tmp_path, enable=["lager"], lager=self.LAGER) as app:
            peer = Peer(app.addresses)
            where = (app.addresses["lager_registrar_snapshot"], app.addresses["lager_forwarder_in"])
            first = NasaTap(peer.ctx, *where, "/Conf/Nasa/", NASA_XML)
            try:
                await peer.settle()
                await first.register()
                for i in range(20):
                    await first.log(i, self.row(i))
                assert len(await self.journaled(app, first.uuid, 20)) == 20
                first.close()
                # Restart 1: its registration reaches the registrar (refused while the old
                # uuid is fresh, then it takes the key); it logs at once.
                second = NasaTap(peer.ctx, *where, "/Conf/Nasa/", NASA_XML)
                await second.register()  # satisfied by the holder's echo, as the C++ is
                for i in range(100, 150):
                    await second.log(i, self.row(i))
                assert await self.journaled(app, second.uuid, 50) == list(range(100, 150))
                second.close()
                # Restart 2: no registration gets through at all, only rows.
                third = NasaTap(peer.ctx, *where, "/Conf/Nasa/", NASA_XML)
                await peer.settle()
                for i in range(200, 250):
                    await third.log(i, self.row(i))
                assert await self.journaled(app, third.uuid, 50) == list(range(200, 250))
                snap = await peer.snapshot()
                third.close()
            finally:
                peer.close()
            moves = [(r.producer, r.attrs.get("replaces")) for r in app.hub.journal.read(0)
                     if r.content_type == "lager-registration"]  # fmt: skip
        text = {t.uuid: str(uuid.UUID(bytes=t.uuid)) for t in (first, second, third)}
        assert [(f[0], f[2]) for f in snap[:-1]] == [(b"/Conf/Nasa/", third.uuid)]
        assert moves == [
            (text[first.uuid], None),
            (text[second.uuid], text[first.uuid]),
            (text[third.uuid], text[second.uuid]),
        ]
        assert rejected(app, "unknown_tap") == 0
        async with running_app(tmp_path, enable=["lager"], lager=self.LAGER) as app:
            peer = Peer(app.addresses)  # the journal replays the moves
            snap = await peer.snapshot()
            peer.close()
        assert [(f[0], f[2]) for f in snap[:-1]] == [(b"/Conf/Nasa/", third.uuid)]

    async def test_a_live_tap_keeps_its_key(self, tmp_path: Path) -> None:
        """A second tap with the same key while the first is alive is still a duplicate."""
        async with running_app(
            tmp_path, enable=["lager"], lager={**self.LAGER, "unknown_tap_hold_s": 1.5}
        ) as app:
            peer = Peer(app.addresses)
            where = (app.addresses["lager_registrar_snapshot"], app.addresses["lager_forwarder_in"])
            holder = NasaTap(peer.ctx, *where, "/Conf/Nasa/", NASA_XML)
            impostor = NasaTap(peer.ctx, *where, "/Conf/Nasa/", NASA_XML)
            try:
                await peer.settle()
                await holder.register()
                await impostor.register()
                for i in range(80):  # 4 s: the holder is never silent for takeover_after_s
                    await holder.log(i, self.row(i))
                    if i < 30:  # the impostor's rows wait 1.5 s for a key, then are refused
                        await impostor.log(i, self.row(i))
                    await asyncio.sleep(0.05)
                await until_rejected(app, "unknown_tap", 30)
                assert len(await self.journaled(app, holder.uuid, 80)) == 80
                snap = await peer.snapshot()
            finally:
                holder.close()
                impostor.close()
                peer.close()
            assert rejected(app, "unknown_tap") == 30 and rejected(app, "duplicate_key") >= 1
            assert not await self.journaled(app, impostor.uuid, 0)
        assert [(f[0], f[2]) for f in snap[:-1]] == [(b"/Conf/Nasa/", holder.uuid)]

    async def test_taps_of_one_format_restarted_together(self, tmp_path: Path) -> None:
        """Two taps share a format (a robot's two wheels) and restart together. With their
        registrations (refused while the old uuids are fresh, remembered as claims) each new
        uuid gets its own key; with rows only, nothing tells them apart: no key is guessed and
        the rows are refused when the hold ends."""
        lager = {**self.LAGER, "unknown_tap_hold_s": 3.0}
        keys = ["/Robot/WheelL/", "/Robot/WheelR/"]
        xml = {key: NASA_XML.replace("/Conf/Nasa/", key) for key in keys}
        async with running_app(tmp_path, enable=["lager"], lager=lager) as app:
            peer = Peer(app.addresses)
            where = (app.addresses["lager_registrar_snapshot"], app.addresses["lager_forwarder_in"])
            try:
                await peer.settle()
                old = [NasaTap(peer.ctx, *where, key, xml[key]) for key in keys]
                for tap in old:
                    await tap.register()
                    await tap.log(1, self.row(1))
                    tap.close()
                new = [NasaTap(peer.ctx, *where, key, xml[key]) for key in keys]
                for tap in new:
                    await tap.register()  # refused (the old uuid is fresh): a claim
                for i in range(10, 20):
                    for tap in new:
                        await tap.log(i, self.row(i))
                for tap in new:
                    assert await self.journaled(app, tap.uuid, 10) == list(range(10, 20))
                    tap.close()
                third = [NasaTap(peer.ctx, *where, key, xml[key]) for key in keys]
                await peer.settle()
                for i in range(30, 40):
                    for tap in third:
                        await tap.log(i, self.row(i))
                await until_rejected(app, "unknown_tap", 20)
                snap = await peer.snapshot()
                for tap in third:
                    tap.close()
            finally:
                peer.close()
            assert rejected(app, "unknown_tap") == 20
        assert [(f[0], f[2]) for f in snap[:-1]] == [
            (key.encode(), tap.uuid) for key, tap in zip(keys, new, strict=True)
        ]
