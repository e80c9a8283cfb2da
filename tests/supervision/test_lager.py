"""The Lager loops under supervision (taproom.supervise): a registration, snapshot request or
data row whose handling fails is refused alone (counted, logged), the rest are kept; a
committed batch whose forwarding fails costs the mugs those rows only. Also the event-time
rule for rows: a timestamp from 2^63 ns on is journaled absent, counted, forwarded as sent."""

from __future__ import annotations

import struct
import uuid
from pathlib import Path

import pytest
import zmq

from taproom.protocols.lager import chp as lager_chp
from taproom.servers.lager import forwarder as lager_forwarder
from taproom.servers.lager import registrar as lager_registrar
from taproom.servers.lager.kernel import RowKernel
from taproom.servers.zmtp import ZmtpPublisher
from tests.servers.test_lager import ROW, XML, Peer, register
from tests.supervision.support import (
    assert_supervised,
    first_call,
    inject,
    internal_errors,
    output_errors,
    until,
)
from tests.support import running_app

SETTINGS = {"hugz_interval_s": 0.2, "checkpoint_interval_s": 0.1, "unknown_tap_hold_s": 0.3}


def _row(u: bytes, ts_ns: int) -> list[bytes]:
    """A seed-framed row: uuid, version 1.0, flags, timestamp, the row."""
    return [u, b"\x01\x00", b"\x00\x00", struct.pack(">Q", ts_ns), ROW]


def _rows(app: object) -> list[object]:
    return [r for r in app.hub.journal.read(0) if r.content_type == "lager"]  # type: ignore[attr-defined]


class TestLagerLoops:
    async def test_registrar_collector(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        raised = inject(
            monkeypatch,
            lager_registrar,
            "parse_registration",
            lambda frames, **_: frames[0] == b"/Poison/",
        )
        async with running_app(tmp_path, enable=["lager"], lager=SETTINGS) as app:
            peer = Peer(app.addresses)
            try:
                await peer.settle()
                await peer.collector.send_multipart(
                    lager_chp.registration_frames("/Poison/", uuid.uuid4().bytes, XML)
                )
                frames = await register(peer, "/Good/", uuid.uuid4().bytes)
                assert frames[0] == b"/Good/" and raised[0] >= 1
                assert internal_errors(app, "lager") == raised[0]
                assert_supervised(app, "lager.registrar.collector", caplog)
            finally:
                peer.close()

    async def test_registrar_snapshot(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        raised = inject(
            monkeypatch,
            lager_registrar,
            "parse_snapshot_request",
            lambda request, **_: request[-1] == b"/Poison/",
        )
        async with running_app(tmp_path, enable=["lager"], lager=SETTINGS) as app:
            peer = Peer(app.addresses)
            try:
                dealer = peer._sock(zmq.DEALER, "lager_registrar_snapshot")
                await dealer.send_multipart([b"ICANHAZ?", b"/Poison/"])
                await dealer.send_multipart([b"ICANHAZ?", b"/Good/"])
                assert await dealer.poll(20_000)
                reply = await dealer.recv_multipart()
                assert reply[0] == b"KTHXBAI"  # the valid request's answer, the only one
                assert raised == [1] and internal_errors(app, "lager") == 1
                assert_supervised(app, "lager.registrar.snapshot", caplog)
            finally:
                peer.close()

    # The per-row Python path (the row kernel's twin: on the compiled path the kernel takes a
    # known tap's rows without DataRecords.parts; its own failure is the next test's).
    @pytest.mark.parametrize("zmq_path", ["py"], indirect=True)
    @pytest.mark.usefixtures("zmq_path")
    async def test_forwarder_data(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        poison = struct.pack(">Q", 1_700_000_000_000_000_777)
        raised = inject(
            monkeypatch,
            lager_forwarder.DataRecords,
            "parts",
            lambda _self, _received, ts_be, _payload: ts_be == poison,
        )
        async with running_app(tmp_path, enable=["lager"], lager=SETTINGS) as app:
            peer = Peer(app.addresses)
            try:
                await peer.settle()
                u = uuid.uuid4().bytes
                await register(peer, "/Robot/", u)
                for ts in (1_700_000_000_000_000_001, 1_700_000_000_000_000_777, 2):
                    await peer.data_in.send_multipart(_row(u, ts))
                await until(lambda: len(_rows(app)) == 2, 20, "the two valid rows")
                stored = [r.ts_ns for r in _rows(app)]  # type: ignore[attr-defined]
                assert stored == [1_700_000_000_000_000_001, 2] and raised == [1]
                assert internal_errors(app, "lager") == 1
                assert_supervised(app, "lager.forwarder.data", caplog)
            finally:
                peer.close()

    @pytest.mark.parametrize("zmq_path", ["ext"], indirect=True)
    @pytest.mark.usefixtures("zmq_path")
    async def test_forwarder_row_kernel(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A failing row kernel call (a bug) costs no row: the rest of its burst goes through
        the Python path; the failure is counted and logged, the loop goes on."""
        raised = inject(monkeypatch, RowKernel, "run", first_call())
        async with running_app(tmp_path, enable=["lager"], lager=SETTINGS) as app:
            peer = Peer(app.addresses)
            try:
                await peer.settle()
                u = uuid.uuid4().bytes
                await register(peer, "/Robot/", u)
                for ts in (1, 2, 3):
                    await peer.data_in.send_multipart(_row(u, ts))
                await until(lambda: len(_rows(app)) == 3, 20, "the three rows")
                for ts in (4, 5):  # later bursts: the kernel's again
                    await peer.data_in.send_multipart(_row(u, ts))
                await until(lambda: len(_rows(app)) == 5, 20, "the five rows")
                assert [r.ts_ns for r in _rows(app)] == [1, 2, 3, 4, 5]  # type: ignore[attr-defined]
                assert raised == [1]
                assert internal_errors(app, "lager") == 1
                assert_supervised(app, "lager.forwarder.data", caplog)
            finally:
                peer.close()

    async def test_forwarder_forward(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        first = first_call()

        def rows_to_mugs(publisher, burst) -> bool:  # the first batch of rows, not a mark
            data = publisher.name == "lager_forwarder_counted" and burst.topics[0][:1] != b"\x00"
            return data and first()

        # rows go out as bursts (laid out by the row kernel, or encoded from the Python path's)
        raised = inject(monkeypatch, ZmtpPublisher, "publish", rows_to_mugs)
        async with running_app(tmp_path, enable=["lager"], lager=SETTINGS) as app:
            peer = Peer(app.addresses)
            try:
                await peer.settle()
                u = uuid.uuid4().bytes
                await register(peer, "/Robot/", u)
                await peer.subscribe_data(u)
                await peer.data_in.send_multipart(_row(u, 1))  # its forward fails
                await until(lambda: raised == [1], 20, "the poisoned forward")
                assert output_errors(app, "lager_forwarder") == 1
                await peer.data_in.send_multipart(_row(u, 2))  # the next batch goes out
                assert await peer.data_out.poll(20_000)
                assert (await peer.data_out.recv_multipart())[3] == struct.pack(">Q", 2)
                assert [r.ts_ns for r in _rows(app)] == [1, 2]  # type: ignore[attr-defined]
                assert_supervised(app, "lager.forwarder.forward", caplog)
            finally:
                peer.close()

    async def test_a_row_time_the_journal_cannot_hold_is_absent_counted_and_forwarded(
        self, tmp_path: Path
    ) -> None:
        """The seed's timestamp is a u64: from 2^63 ns on it was refused (bad_timestamp);
        now the row is journaled without a time, counted, and forwarded exactly as sent."""
        async with running_app(tmp_path, enable=["lager"], lager=SETTINGS) as app:
            peer = Peer(app.addresses)
            try:
                await peer.settle()
                u = uuid.uuid4().bytes
                await register(peer, "/Robot/", u)
                await peer.subscribe_data(u)
                far = (1 << 64) - 1
                await peer.data_in.send_multipart(_row(u, far))
                await until(lambda: len(_rows(app)) == 1, 20, "the row")
                assert _rows(app)[0].ts_ns == 0  # type: ignore[attr-defined]
                assert await peer.data_out.poll(20_000)
                forwarded = await peer.data_out.recv_multipart()
                assert forwarded[3] == struct.pack(">Q", far)
                labels = {"protocol": "lager", "reason": "time_out_of_range"}
                value = app.hub.metrics.registry.get_sample_value(
                    "taproom_ingest_odd_events_total", labels
                )
                assert value == 1
            finally:
                peer.close()
