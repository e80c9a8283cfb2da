"""clients/lager/ end to end against a real bartender: Tap, Mug, KegWriter, taproom keg."""

from __future__ import annotations

import asyncio
import csv
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from taproom.cli import main as taproom_main
from taproom.clients.lager import DuplicateTap, KegWriter, Mug, Tap
from taproom.protocols.lager.formats import parse_format_xml
from taproom.protocols.lager.keg import read_keg, sidecar_path
from tests.protocols.lager.nasa_peer import (
    NasaBartender,
    NasaMug,
    check_format_xml,
    read_keg_like_lagr2hdf5,
)
from tests.support import fuzz_examples, running_app

FORMATS = {
    "/RobotA/Motion/": (
        '<format version="BEERR01"><item name="x" type="double" size="8" offset="0"/>'
        '<item name="n" type="uint32_t" size="4" offset="8"/></format>'
    ),
    "/RobotA/Arm/": (
        '<format version="BEERR01"><item name="ok" type="bool" size="1" offset="0"/>'
        '<item name="joints" type="float32" size="12" offset="1"/>'
        '<item name="n" type="int64" size="8" offset="13"/></format>'
    ),
    "/RobotB/Status/": (
        '<format version="BEERR01"><item name="n" type="uint16" size="2" offset="8"/>'
        '<item name="state" type="string" size="8" offset="0"/></format>'
    ),
}
ROWS = 1000


def values(key: str, i: int) -> dict[str, Any]:
    if key == "/RobotA/Motion/":
        return {"x": i / 4, "n": i}
    if key == "/RobotA/Arm/":
        return {"ok": i % 2 == 0, "joints": (float(i), 0.5, -1.0), "n": -i}
    return {"n": i, "state": f"s{i}"}


def addresses(app: Any) -> dict[str, str]:
    return {
        "registrar": app.addresses["lager_registrar_snapshot"],
        "forwarder": app.addresses["lager_forwarder_in"],
    }


def run_tap_at_1khz(tap: Tap, key: str, start_ns: int, alive: list[bool]) -> None:
    """1 kHz: sample i is due at start + i ms (pacing with sleep)."""
    t0 = time.monotonic()
    for i in range(ROWS):
        due = t0 + i / 1000
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        alive.append(tap.log(ts_ns=start_ns + i, **values(key, i)))


def collect(mug: Mug, want: int, out: list[Any], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while len(out) < want and time.monotonic() < deadline:
        sample = mug.recv(0.5)
        if sample is not None:
            out.append(sample)


class TestEndToEnd:
    async def test_three_taps_two_mugs_and_a_keg(self, tmp_path: Path) -> None:
        async with running_app(tmp_path, enable=["lager"], lager={"hugz_interval_s": 0.2}) as app:
            where = addresses(app)
            keg_path = tmp_path / "run.lgr"

            alive: list[bool] = []

            def scenario() -> tuple[list[Any], list[Any], dict[str, Tap], KegWriter]:
                taps = {k: Tap(k, xml, **where).register() for k, xml in FORMATS.items()}
                mug_all = Mug(**where)
                assert set(mug_all.sync()) == set(FORMATS)
                mug_all.subscribe(*FORMATS)
                mug_a = Mug(**where)
                assert set(mug_a.sync("/RobotA/")) == {"/RobotA/Motion/", "/RobotA/Arm/"}
                mug_a.subscribe("/RobotA/Motion/", "/RobotA/Arm/")
                keg = KegWriter(keg_path, **where, metadata={"notes": "e2e"}).start()
                got_all: list[Any] = []
                got_a: list[Any] = []
                readers = [
                    threading.Thread(target=collect, args=(mug_all, 3 * ROWS, got_all)),
                    threading.Thread(target=collect, args=(mug_a, 2 * ROWS, got_a)),
                ]
                writers = [
                    threading.Thread(
                        target=run_tap_at_1khz, args=(taps[k], k, 10**18 + j * 10**6, alive)
                    )
                    for j, k in enumerate(FORMATS)
                ]
                for t in readers + writers:
                    t.start()
                for t in readers + writers:
                    t.join()
                deadline = time.monotonic() + 10
                while keg.records < 3 * ROWS and time.monotonic() < deadline:
                    time.sleep(0.05)
                keg.stop()
                for tap in taps.values():
                    tap.close()
                mug_all.close()
                mug_a.close()
                return got_all, got_a, taps, keg

            got_all, got_a, taps, _ = await asyncio.to_thread(scenario)

        def by_key(samples: list[Any]) -> dict[str, list[tuple[int, dict[str, Any]]]]:
            out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
            for s in samples:
                out.setdefault(s.key, []).append((s.ts_ns, s.values))
            return out

        def expected(key: str, j: int) -> list[tuple[int, dict[str, Any]]]:
            return [(10**18 + j * 10**6 + i, values(key, i)) for i in range(ROWS)]

        assert alive == [True] * (3 * ROWS)  # every log() queued, bartender known alive
        seen_all, seen_a = by_key(got_all), by_key(got_a)
        for j, key in enumerate(FORMATS):
            assert seen_all[key] == expected(key, j), key  # every sample, in order, decoded
            if key.startswith("/RobotA/"):
                assert seen_a[key] == expected(key, j), key
        assert "/RobotB/Status/" not in seen_a
        keg = read_keg(keg_path)
        assert not keg.recovered_unfinished and keg.dropped_bytes == 0
        assert keg.metadata == {"notes": "e2e"} and keg.record_count == 3 * ROWS
        for j, (key, tap) in enumerate(taps.items()):
            rows = [(ts, row) for text, ts, row in keg.rows() if text == tap.uuid_str]
            assert rows == expected(key, j)
        arm = keg.table(taps["/RobotA/Arm/"].uuid_str)
        assert arm["joints"].shape == (ROWS, 3) and arm["n"][-1] == -(ROWS - 1)


class TestTap:
    async def test_no_lost_first_samples(self, tmp_path: Path) -> None:
        async with running_app(tmp_path, enable=["lager"]) as app:
            where = addresses(app)

            def scenario() -> list[int]:
                mug = Mug(**where)
                mug.sync()
                mug.subscribe(everything=True)
                firsts = []
                for n in range(15):
                    # A brand-new tap logs one sample right after register(): it must arrive.
                    # Both confirmation paths: publisher echo (watch) and snapshot (no watch).
                    tap = Tap(f"/First/T{n}/", FORMATS["/RobotA/Motion/"], watch=n % 2 == 0,
                              **where).register()  # fmt: skip
                    tap.log(ts_ns=n, x=1.0, n=n)
                    deadline = time.monotonic() + 5
                    while time.monotonic() < deadline:
                        msg = mug.recv_message(0.5)
                        if msg is not None and msg.uuid == tap.uuid:
                            firsts.append(msg.ts_ns)
                            break
                    tap.close()
                mug.close()
                return firsts

            assert await asyncio.to_thread(scenario) == list(range(15))

    async def test_registration_is_what_a_nasa_lager_mug_accepts(self, tmp_path: Path) -> None:
        """A real Mug validates each registration with data_format.xsd: the key attribute is
        required (it died with "missing required attribute 'key'" on taproom's Tap)."""
        async with running_app(tmp_path, enable=["lager"]) as app:
            where = addresses(app)

            def scenario() -> list[str]:
                for key, xml in FORMATS.items():
                    Tap(key, xml, **where).register().close()
                mug = Mug(**where)
                values = [reg.value for reg in mug.sync().values()]
                mug.close()
                return values

            published = await asyncio.to_thread(scenario)
            stored = [
                r.payload.decode()
                for r in app.hub.journal.read(0)
                if r.content_type == "lager-registration"
            ]
        assert sorted(published) == sorted(stored) and len(stored) == len(FORMATS)
        for xml in stored:
            check_format_xml(xml)
            key = parse_format_xml(xml).key
            assert key in FORMATS and parse_format_xml(xml).with_key("") == parse_format_xml(
                FORMATS[key]
            )

    async def test_duplicate_tap_refused(self, tmp_path: Path) -> None:
        async with running_app(tmp_path, enable=["lager"]) as app:
            where = addresses(app)

            def scenario() -> None:
                first = Tap("/Dup/T/", FORMATS["/RobotA/Motion/"], **where).register()
                second = Tap("/Dup/T/", FORMATS["/RobotA/Motion/"], **where)
                with pytest.raises(DuplicateTap, match=first.uuid_str):
                    second.register(timeout=5)
                # The same tap registering again (a reconnect) is fine.
                again = Tap("/Dup/T/", FORMATS["/RobotA/Motion/"], uuid=first.uuid, **where)
                again.register(timeout=5)
                for tap in (first, second, again):
                    tap.close()

            await asyncio.to_thread(scenario)

    async def test_silence_is_reported_to_taps_and_mugs(self, tmp_path: Path) -> None:
        silences: list[float] = []
        async with running_app(tmp_path, enable=["lager"], lager={"hugz_interval_s": 0.1}) as app:
            where = addresses(app)

            def setup() -> tuple[Tap, Mug]:
                tap = Tap("/Quiet/T/", FORMATS["/RobotA/Motion/"], silence_s=0.6, **where)
                tap.register()
                mug = Mug(
                    silence_s=0.6, on_silence=lambda: silences.append(time.monotonic()), **where
                )
                mug.sync()
                assert mug.recv(1.0) is None and mug.hugz >= 3 and not mug.silent
                time.sleep(0.2)
                assert tap.log(x=0.0, n=0) is True  # HUGZ heard recently: bartender alive
                return tap, mug

            tap, mug = await asyncio.to_thread(setup)
        stopped = time.monotonic()

        def after() -> None:
            assert mug.recv(2.5) is None
            assert mug.silent and len(silences) == 1 and silences[0] - stopped < 2.0
            time.sleep(0.1)
            assert tap.log(x=0.0, n=1) is False
            tap.close()
            mug.close()

        await asyncio.to_thread(after)


class TestKegCrash:
    def _record(
        self, tmp_path: Path, where: dict[str, str]
    ) -> tuple[subprocess.Popen[bytes], Path]:
        keg = tmp_path / "crash.lgr"
        ready = tmp_path / "recorder.ready"
        proc = subprocess.Popen(
            [sys.executable, "-m", "taproom", "keg", "record", str(keg), "--registrar",
             where["registrar"], "--forwarder", where["forwarder"], "--ready-file", str(ready),
             "--flush-interval", "0.05"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        return proc, ready

    async def _wait_ready(self, proc: subprocess.Popen[bytes], ready: Path) -> None:
        for _ in range(600):
            if ready.exists():
                return
            if proc.poll() is not None:
                raise AssertionError(proc.stderr.read().decode() if proc.stderr else "")
            await asyncio.sleep(0.02)
        raise AssertionError("recorder not ready")

    async def test_sigkilled_writer_leaves_a_recoverable_keg(self, tmp_path: Path) -> None:
        key = "/Crash/Tap/"
        fmt = parse_format_xml(FORMATS["/RobotA/Motion/"])
        async with running_app(tmp_path, enable=["lager"]) as app:
            where = addresses(app)
            tap = await asyncio.to_thread(lambda: Tap(key, fmt, **where).register())
            proc, ready = self._record(tmp_path, where)
            try:
                await self._wait_ready(proc, ready)
                n = 3000
                for i in range(n):
                    tap.log(ts_ns=i, x=i / 2, n=i)
                    if i % 200 == 0:
                        await asyncio.sleep(0)
                full = 10 + n * (24 + fmt.row_size)
                keg_path = tmp_path / "crash.lgr"
                for _ in range(500):  # every record flushed by the recorder
                    if keg_path.stat().st_size >= full:
                        break
                    await asyncio.sleep(0.02)
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                tap.close()
        assert Path(sidecar_path(keg_path)).exists()
        keg = read_keg(keg_path)
        assert keg.recovered_unfinished and keg.dropped_bytes == 0
        assert keg.record_count == n
        table = keg.table(tap.uuid_str)
        assert table["timestamp_ns"].tolist() == list(range(n))
        assert table["x"].tolist() == [i / 2 for i in range(n)]

    async def test_sigkill_mid_stream_keeps_every_whole_record(self, tmp_path: Path) -> None:
        fmt = parse_format_xml(FORMATS["/RobotA/Arm/"])
        async with running_app(tmp_path, enable=["lager"]) as app:
            where = addresses(app)
            for cycle in range(fuzz_examples(1, 30)):  # `make soak`: a crash loop
                cycle_dir = tmp_path / f"cycle{cycle}"
                cycle_dir.mkdir()
                key = f"/Crash/Busy{cycle}/"
                tap = await asyncio.to_thread(lambda k=key: Tap(k, fmt, **where).register())
                proc, ready = self._record(cycle_dir, where)
                try:
                    await self._wait_ready(proc, ready)
                    i = 0
                    kill_at = time.monotonic() + 0.5
                    while time.monotonic() < kill_at:
                        tap.log(ts_ns=i, ok=True, joints=(1.0, 2.0, 3.0), n=i)
                        i += 1
                        if i % 100 == 0:
                            await asyncio.sleep(0)
                    proc.send_signal(signal.SIGKILL)  # while rows are still arriving
                    proc.wait(10)
                finally:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
                    tap.close()
                keg = read_keg(cycle_dir / "crash.lgr")
                assert keg.recovered_unfinished
                assert keg.dropped_bytes < 24 + fmt.row_size
                got = keg.table(tap.uuid_str)["n"].tolist()
                assert got == list(range(len(got))) and len(got) > 0  # an in-order prefix

    async def test_keg_writer_follows_taps_registered_later(self, tmp_path: Path) -> None:
        async with running_app(tmp_path, enable=["lager"]) as app:
            where = addresses(app)

            def scenario() -> tuple[str, str]:
                outside = Tap("/Other/T/", FORMATS["/RobotA/Motion/"], **where).register()
                writer = KegWriter(tmp_path / "late.lgr", subtree="/Late/", **where).start()
                late = Tap("/Late/T/", FORMATS["/RobotB/Status/"], **where).register()
                for i in range(200):
                    late.log(ts_ns=i, n=i, state="go")
                    outside.log(ts_ns=i, x=0.0, n=i)
                deadline = time.monotonic() + 10
                while writer.records < 200 and time.monotonic() < deadline:
                    time.sleep(0.02)
                writer.stop()
                late.close()
                outside.close()
                return late.uuid_str, outside.uuid_str

            late_uuid, outside_uuid = await asyncio.to_thread(scenario)
        keg = read_keg(tmp_path / "late.lgr")
        assert keg.counts() == {late_uuid: 200}
        assert outside_uuid not in keg.formats
        assert keg.table(late_uuid)["state"].tolist() == ["go"] * 200

    async def test_recorded_keg_reads_with_lagr2hdf5_rules(self, tmp_path: Path) -> None:
        """nasa/lager's lagr2hdf5.py failed on kegs taproom recorded (TypeError: no key)."""
        path = tmp_path / "rec.lgr"
        async with running_app(tmp_path, enable=["lager"]) as app:
            where = addresses(app)

            def scenario() -> None:
                tap = Tap("/RobotA/Motion/", FORMATS["/RobotA/Motion/"], **where).register()
                writer = KegWriter(path, taps=["/RobotA/Motion/"], **where).start()
                for i in range(200):
                    tap.log(ts_ns=10_000 + i, x=i / 4, n=i)
                deadline = time.monotonic() + 10
                while writer.records < 200 and time.monotonic() < deadline:
                    time.sleep(0.02)
                writer.stop()
                tap.close()

            await asyncio.to_thread(scenario)
        columns, timestamps = read_keg_like_lagr2hdf5(path)
        assert columns == {
            "x|/RobotA/Motion/": [i / 4 for i in range(200)],
            "n|/RobotA/Motion/": list(range(200)),
        }
        assert timestamps == [10_000 + i for i in range(200)]


class TestNasaLagerBartender:
    """taproom's clients against a bartender that behaves as nasa/lager's does (no hello, no
    marks, no counted output; registrar updates as doubles; HUGZ every 10 ms)."""

    async def test_tap_through_it_to_a_nasa_lager_mug(self) -> None:
        """Was: the real Mug died on taproom's registration (no key) and on its row frames."""
        bartender = NasaBartender()
        ctx = zmq.asyncio.Context()
        fmt = parse_format_xml(FORMATS["/RobotA/Motion/"])
        mug = NasaMug(ctx, bartender.forwarder_out)
        tap = Tap("/RobotA/Motion/", fmt, registrar=bartender.registrar)  # forwarder: P + 10
        try:
            await asyncio.to_thread(tap.register)
            xml = bartender.hash_map[b"/RobotA/Motion/"]
            check_format_xml(xml)
            mug.formats[tap.uuid] = [item.size for item in fmt.items]
            while True:  # until the mug's subscription reached the forwarder (slow joiner)
                tap.log(ts_ns=0, x=0.0, n=0)
                if await mug.read(0.1) is not None:
                    break
            while await mug.read(0.3) is not None:
                pass
            mug.rows.clear()
            for i in range(1, 501):
                tap.log(ts_ns=i, x=i / 4, n=i)
            while len(mug.rows) < 500:
                assert await mug.read(5) is not None, len(mug.rows)
        finally:
            tap.close()
            mug.close()
            ctx.destroy(linger=0)
            bartender.close()
        assert mug.rows == [
            tap.uuid + i.to_bytes(8, "big") + fmt.encode_row({"x": i / 4, "n": i})
            for i in range(1, 501)
        ]

    def test_keg_record_against_it(self, tmp_path: Path) -> None:
        """Was: "forwarder did not confirm the subscription in time" (no hello there)."""
        bartender = NasaBartender()
        path, ready = tmp_path / "nasa.lgr", tmp_path / "ready"
        tap = Tap("/RobotA/Motion/", FORMATS["/RobotA/Motion/"], registrar=bartender.registrar)
        proc = None
        try:
            tap.register()
            proc = subprocess.Popen(
                [sys.executable, "-m", "taproom", "keg", "record", str(path),
                 "--registrar", bartender.registrar, "--ready-file", str(ready)],
                stderr=subprocess.PIPE,
            )  # fmt: skip
            deadline = time.monotonic() + 30
            while not ready.exists():
                assert proc.poll() is None, proc.communicate()[1]
                assert time.monotonic() < deadline
                time.sleep(0.05)
            for i in range(300):
                tap.log(ts_ns=i, x=i / 4, n=i)
            time.sleep(1.0)  # no mark to wait for: give the rows time to be written
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0, proc.communicate()[1]
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            tap.close()
            bartender.close()
        keg = read_keg(path)
        assert not keg.recovered_unfinished
        assert keg.table(tap.uuid_str)["n"].tolist() == list(range(300))


class TestKegCommand:
    def _keg(self, tmp_path: Path, finish: bool = True) -> tuple[Path, str]:
        from taproom.protocols.lager.keg import KegFileWriter

        u = str(uuid.UUID(int=5))
        fmt = parse_format_xml(FORMATS["/RobotA/Arm/"])
        path = tmp_path / "k.lgr"
        w = KegFileWriter(path, {u: fmt}, {"notes": "cli"}, fsync=False)
        for i in range(10):
            w.write(uuid.UUID(u).bytes, 100 + i, fmt.encode_row(values("/RobotA/Arm/", i)))
        if finish:
            w.close()
        else:
            w.abandon()
        return path, u

    def test_dump_and_verify(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        path, u = self._keg(tmp_path)
        assert taproom_main(["keg", "verify", str(path)]) == 0
        assert "finished; 10 records" in capsys.readouterr().out
        assert taproom_main(["keg", "dump", str(path), "--limit", "2"]) == 0
        out = capsys.readouterr().out
        assert "meta notes = cli" in out and f"{u} 101 ok=False joints=(1.0, 0.5, -1.0) n=-1" in out
        assert f"{u} 102" not in out
        unfinished, _ = self._keg(
            tmp_path / "u" if (tmp_path / "u").mkdir() is None else tmp_path, False
        )
        with open(unfinished, "ab") as f:
            f.write(b"\0" * 5)
        assert taproom_main(["keg", "verify", str(unfinished)]) == 1
        out = capsys.readouterr().out
        assert "unfinished" in out and "dropped 5 bytes" in out
        (tmp_path / "bad.lgr").write_bytes(b"xx")
        assert taproom_main(["keg", "verify", str(tmp_path / "bad.lgr")]) == 2

    def test_convert_csv_and_parquet(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        import pyarrow.parquet as pq

        path, _ = self._keg(tmp_path)
        assert taproom_main(["keg", "convert", str(path), "--to", "csv"]) == 0
        with open(tmp_path / "k.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == 10 and rows[3]["timestamp_ns"] == "103" and rows[3]["n"] == "-3"
        assert rows[3]["joints[0]"] == "3.0" and rows[3]["ok"] == "False"
        assert taproom_main(["keg", "convert", str(path), "--to", "parquet"]) == 0
        table = pq.read_table(tmp_path / "k.parquet")
        assert table.column("n").to_pylist() == [-i for i in range(10)]
        assert table.column("joints[2]").to_pylist() == [-1.0] * 10
