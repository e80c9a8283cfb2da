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
    lager_metric,
    register,
    rejected,
    tcp,
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
    """Robot fleets run one tap format on many robots, and robots restart. A restarted
    nasa/lager Tap has a new uuid and the same key (Tap::init), and its CHP client sends its
    registration only while its view of the map lacks its key (getUnsyncedHashmap): usually
    its snapshot already shows the key with its format and it sends none. Rows carry only the
    uuid, so a key is taken from a registration that names the uuid, never from a format that
    fits: taproom once gave such rows to whichever silent tap of that format went quiet first
    (another robot's key), or held and then refused them for good (issue 28)."""

    FMT = parse_format_xml(NASA_XML)

    def row(self, i: int) -> list[bytes]:
        row = self.FMT.encode_row({"a": i, "b": i / 2})
        return [row[:4], row[4:]]

    async def journaled(self, app: Any, producer: bytes, want: int) -> list[Any]:
        """The data rows of one uuid, once there are ``want`` of them (15 s at most)."""
        deadline = time.monotonic() + 15
        text = str(uuid.UUID(bytes=producer))
        while True:
            got = [r for r in app.hub.journal.read(0)
                   if r.content_type == "lager" and r.producer == text]  # fmt: skip
            if len(got) >= want or time.monotonic() > deadline:
                return got
            await asyncio.sleep(0.1)

    async def holder_of(self, peer: Peer, key: bytes, want: bytes | None = None) -> bytes:
        """The uuid the registrar's snapshot names for ``key`` (waits for ``want``)."""
        deadline = time.monotonic() + 15
        while True:
            held = {f[0]: f[2] for f in (await peer.snapshot())[:-1]}
            if key in held and (want is None or held[key] == want):
                return held[key]
            assert time.monotonic() < deadline, (key, held.get(key))
            await asyncio.sleep(0.05)

    async def run_tap(self, tap: NasaTap, rows: range, **start: Any) -> None:
        await tap.start(**start)
        await tap.connected()
        for i in rows:
            await tap.log(i, self.row(i))

    async def test_two_robots_one_format_robot2_restarted(self, tmp_path: Path) -> None:
        """/robot1/arm and /robot2/arm share a format; robot1 stops; robot2 restarts. Its rows
        are never journaled under robot1's key: as a restart usually goes (no registration)
        under its own uuid, unattributed; when its registration does get through (a slow
        snapshot), under its own key."""
        lager = {"takeover_after_s": 0.5, "unknown_tap_hold_s": 0.3, "hugz_interval_s": 0.2}
        keys = [b"/robot1/arm", b"/robot2/arm"]
        xml = {k: NASA_XML.replace("/Conf/Nasa/", k.decode()) for k in keys}
        async with running_app(tmp_path, enable=["lager"], lager=lager) as app:
            peer = Peer(app.addresses)
            where = (app.addresses["lager_registrar_snapshot"], app.addresses["lager_forwarder_in"])
            robot1, robot2 = (NasaTap(peer.ctx, *where, k.decode(), xml[k]) for k in keys)
            restarted = again = robot2
            try:
                for tap in (robot1, robot2):  # first starts: the keys are new, they register
                    await self.run_tap(tap, range(0), snapshot_after_s=0.0)
                    await self.holder_of(peer, tap.key, tap.uuid)
                for i in range(100):
                    await robot1.log(i, self.row(i))
                    await robot2.log(i, self.row(i))
                for tap in (robot1, robot2):
                    assert len(await self.journaled(app, tap.uuid, 100)) == 100
                    tap.close()  # robot1 stops for good, robot2 restarts
                # The usual restart: the snapshot shows /robot2/arm with this format, so the
                # client never sends a registration; 2,000 rows at once.
                restarted = NasaTap(peer.ctx, *where, "/robot2/arm", xml[b"/robot2/arm"])
                await self.run_tap(restarted, range(1000, 3000))
                unattributed = await self.journaled(app, restarted.uuid, 2000)
                assert restarted.registrations_sent == 0
                restarted.close()
                # A restart whose snapshot is slow: the key is missing from the client's view,
                # the registration goes out, names the uuid, and the key moves (its holder, the
                # first restart's predecessor, is long silent).
                again = NasaTap(peer.ctx, *where, "/robot2/arm", xml[b"/robot2/arm"])
                await self.run_tap(again, range(5000, 7000), snapshot_after_s=1.0)
                attributed = await self.journaled(app, again.uuid, 2000)
                assert again.registrations_sent >= 1
                held = {k: await self.holder_of(peer, k) for k in keys}
                again.close()
            finally:
                peer.close()
            data = [r for r in app.hub.journal.read(0) if r.content_type == "lager"]
            assert lager_metric(app, "unattributed_rows_total") == 2000
        text = {
            tap.uuid: str(uuid.UUID(bytes=tap.uuid)) for tap in (robot1, robot2, restarted, again)
        }
        by_key: dict[str, set[str]] = {}
        for record in data:
            by_key.setdefault(record.stream, set()).add(record.producer)
        assert by_key == {
            "/robot1/arm": {text[robot1.uuid]},  # 0 rows of any other tap under robot1's key
            "/robot2/arm": {text[robot2.uuid], text[again.uuid]},
            "": {text[restarted.uuid]},  # under its own uuid, the key absent
        }
        assert [r.ts_ns for r in unattributed] == list(range(1000, 3000))
        assert {r.attrs.get("unattributed") for r in unattributed} == {"true"}
        assert [r.ts_ns for r in attributed] == list(range(5000, 7000))
        assert {r.stream for r in attributed} == {"/robot2/arm"}
        assert held == {b"/robot1/arm": robot1.uuid, b"/robot2/arm": again.uuid}
        assert rejected(app, "unknown_tap") == rejected(app, "duplicate_key") == 0

    async def test_32_taps_one_format_31_silent_one_restarted(self, tmp_path: Path) -> None:
        """32 taps of one format; 31 went silent long ago; one restarts quickly (its old uuid
        still fresh) with a slow snapshot, so its registration is refused as duplicate_key and
        kept as a claim. Its rows are all stored, none refused: unattributed at first, under its
        key once the claim takes it; the link is journaled after the unattributed rows."""
        lager = {"takeover_after_s": 1.5, "unknown_tap_hold_s": 0.2, "hugz_interval_s": 0.2}
        keys = [f"/fleet/robot{n:02d}/arm" for n in range(32)]
        async with running_app(tmp_path, enable=["lager"], lager=lager) as app:
            peer = Peer(app.addresses)
            where = (app.addresses["lager_registrar_snapshot"], app.addresses["lager_forwarder_in"])
            taps = [NasaTap(peer.ctx, *where, k, NASA_XML.replace("/Conf/Nasa/", k)) for k in keys]
            restarted = taps[7]
            try:
                for tap in taps:
                    await self.run_tap(tap, range(3), snapshot_after_s=0.0)
                for tap in taps:
                    await self.holder_of(peer, tap.key, tap.uuid)
                    assert len(await self.journaled(app, tap.uuid, 3)) == 3
                for tap in taps[:7] + taps[8:]:
                    tap.close()
                await asyncio.sleep(lager["takeover_after_s"])  # the 31 are gone now
                for i in range(3, 20):  # robot07 logs on, then restarts at once
                    await taps[7].log(i, self.row(i))
                taps[7].close()
                restarted = NasaTap(
                    peer.ctx, *where, keys[7], NASA_XML.replace("/Conf/Nasa/", keys[7])
                )
                await self.run_tap(restarted, range(100, 400), snapshot_after_s=0.5)
                rows = await self.journaled(app, restarted.uuid, 300)
                await self.holder_of(peer, restarted.key, restarted.uuid)  # the claim took it
                for i in range(400, 500):
                    await restarted.log(i, self.row(i))
                rows = await self.journaled(app, restarted.uuid, 400)
                held = {f[0]: f[2] for f in (await peer.snapshot())[:-1]}
                restarted.close()
            finally:
                peer.close()
            records = list(app.hub.journal.read(0))
            metrics = {n: lager_metric(app, n) for n in ("unattributed_rows_total",
                       "attributed_rows_total", "takeovers_keys_total")}  # fmt: skip
        me = str(uuid.UUID(bytes=restarted.uuid))
        assert [r.ts_ns for r in rows] == list(range(100, 500))  # every row, in order
        assert {r.stream for r in rows} <= {"", keys[7]}  # its own key or none, never another
        unattributed = [r for r in rows if r.stream == ""]
        assert unattributed and rows[-1].stream == keys[7]
        assert rows[: len(unattributed)] == unattributed  # unattributed first, then the key
        links = [r for r in records if r.content_type == "lager-attribution"]
        mine = [r for r in links if r.producer == me]
        assert [(r.stream, r.producer, r.attrs) for r in mine] == [
            (keys[7], me, {"rows": str(len(unattributed))})
        ]
        assert mine[0].offset > unattributed[-1].offset
        # On a loaded machine a setup tap's first rows can outwait unknown_tap_hold_s before
        # its registration is read: they are stored unattributed and linked once it is. Such a
        # link must name that tap's own key, never another robot's.
        own_key = {str(uuid.UUID(bytes=t.uuid)): t.key.decode() for t in taps}
        others = [r for r in links if r.producer != me]
        assert all(r.stream == own_key[r.producer] for r in others)
        linked_elsewhere = sum(int(r.attrs["rows"]) for r in others)
        assert metrics == {
            "unattributed_rows_total": len(unattributed) + linked_elsewhere,
            "attributed_rows_total": len(unattributed) + linked_elsewhere,
            "takeovers_keys_total": 1,
        }
        assert rejected(app, "unknown_tap") == 0 and rejected(app, "duplicate_key") >= 1
        assert held == {
            k.encode(): (restarted.uuid if k == keys[7] else tap.uuid)
            for k, tap in zip(keys, taps, strict=True)
        }

    async def test_a_live_tap_keeps_its_key(self, tmp_path: Path) -> None:
        """A second tap with the same key while the first is alive is still a duplicate: its
        registration stays a claim and its rows are journaled unattributed, never refused."""
        lager = {"takeover_after_s": 0.5, "unknown_tap_hold_s": 0.3, "hugz_interval_s": 0.2}
        async with running_app(tmp_path, enable=["lager"], lager=lager) as app:
            peer = Peer(app.addresses)
            where = (app.addresses["lager_registrar_snapshot"], app.addresses["lager_forwarder_in"])
            holder = NasaTap(peer.ctx, *where, "/Conf/Nasa/", NASA_XML)
            impostor = NasaTap(peer.ctx, *where, "/Conf/Nasa/", NASA_XML)
            try:
                await peer.settle()
                await holder.register()
                await impostor.register()  # satisfied by the holder's entry, as the C++ is
                for i in range(40):  # 2 s: the holder is never silent for takeover_after_s
                    await holder.log(i, self.row(i))
                    if i < 30:
                        await impostor.log(i, self.row(i))
                    await asyncio.sleep(0.05)
                assert len(await self.journaled(app, holder.uuid, 40)) == 40
                others = await self.journaled(app, impostor.uuid, 30)
                snap = await peer.snapshot()
            finally:
                holder.close()
                impostor.close()
                peer.close()
            assert rejected(app, "duplicate_key") >= 1
        assert [(r.stream, r.ts_ns) for r in others] == [("", i) for i in range(30)]
        assert rejected(app, "unknown_tap") == 0
        assert [(f[0], f[2]) for f in snap[:-1]] == [(b"/Conf/Nasa/", holder.uuid)]

    async def test_moves_survive_a_restart_of_the_bartender(self, tmp_path: Path) -> None:
        """Keys moved by registrations are replayed from the journal; unattributed rows stay
        so (nothing in the journal names their uuid)."""
        lager = {"takeover_after_s": 0.3, "unknown_tap_hold_s": 0.2, "hugz_interval_s": 0.2}
        async with running_app(tmp_path, enable=["lager"], lager=lager) as app:
            peer = Peer(app.addresses)
            where = (app.addresses["lager_registrar_snapshot"], app.addresses["lager_forwarder_in"])
            first = NasaTap(peer.ctx, *where, "/Conf/Nasa/", NASA_XML)
            second = third = first
            try:
                await self.run_tap(first, range(10), snapshot_after_s=0.0)
                assert len(await self.journaled(app, first.uuid, 10)) == 10
                first.close()
                await asyncio.sleep(lager["takeover_after_s"])  # first is gone
                second = NasaTap(peer.ctx, *where, "/Conf/Nasa/", NASA_XML)
                await self.run_tap(second, range(10, 20), snapshot_after_s=1.0)
                await self.holder_of(peer, b"/Conf/Nasa/", second.uuid)
                assert len(await self.journaled(app, second.uuid, 10)) == 10
                second.close()
                third = NasaTap(peer.ctx, *where, "/Conf/Nasa/", NASA_XML)
                await self.run_tap(third, range(20, 30))  # the usual restart: no registration
                assert len(await self.journaled(app, third.uuid, 10)) == 10
                third.close()
            finally:
                peer.close()
            moves = [(r.producer, r.attrs.get("replaces")) for r in app.hub.journal.read(0)
                     if r.content_type == "lager-registration"]  # fmt: skip
        text = {t.uuid: str(uuid.UUID(bytes=t.uuid)) for t in (first, second, third)}
        assert moves == [(text[first.uuid], None), (text[second.uuid], text[first.uuid])]
        async with running_app(tmp_path, enable=["lager"], lager=lager) as app:
            peer = Peer(app.addresses)
            snap = await peer.snapshot()
            peer.close()
        assert [(f[0], f[2]) for f in snap[:-1]] == [(b"/Conf/Nasa/", second.uuid)]


class TestRealChpClientStart:
    async def test_abandoned_snapshot_answers_are_not_refusals(self, tmp_path: Path) -> None:
        """nasa/lager's CHP client sends ICANHAZ? again after each message it reads and closes
        at KTHXBAI: answers to the rest go to a socket that is gone. That is every real Tap's
        and Mug's start: counted as snapshots_abandoned, never as a rejection."""
        async with running_app(tmp_path, enable=["lager"], lager={"hugz_interval_s": 0.2}) as app:
            peer = Peer(app.addresses)
            where = (app.addresses["lager_registrar_snapshot"], app.addresses["lager_forwarder_in"])
            taps = [NasaTap(peer.ctx, *where, f"/Start/{n}/", NASA_XML.replace("/Conf/Nasa/",
                    f"/Start/{n}/")) for n in range(20)]  # fmt: skip
            try:
                for tap in taps:
                    await tap.register()
                deadline = time.monotonic() + 30
                starts = 0
                while lager_metric(app, "snapshots_abandoned_requests_total") == 0:
                    assert time.monotonic() < deadline, "no answer was ever abandoned"
                    client = NasaTap(peer.ctx, *where, "/Start/0/", NASA_XML)
                    await client.start()
                    await client._snapshot_done.wait()
                    client.close()
                    starts += 1
                    await asyncio.sleep(0.05)
                assert client.chp.hash_map == {t.key: t.xml for t in taps}
            finally:
                for tap in taps:
                    tap.close()
                peer.close()
            assert rejected(app, "snapshot_undeliverable") == 0
            total = sum(
                s.value
                for metric in app.hub.metrics.registry.collect()
                for s in metric.samples
                if s.name == "taproom_ingest_rejected_items_total"
            )
            assert total == 0, starts
