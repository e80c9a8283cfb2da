"""The sans-I/O Lumberjack core: framing, windows and acks, mapping, malformed input, fuzz."""

from __future__ import annotations

import functools
import struct
import subprocess
import sys
import zlib

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taproom.protocols.lumberjack import (
    STALL_INFLATE,
    STALL_ROOM,
    AckFrame,
    ClientSession,
    CompressedFrame,
    DataFrame,
    JsonFrame,
    Limits,
    LumberjackError,
    LumberjackLimit,
    ServerConnection,
    Version,
    Window,
    WindowSizeFrame,
    encode_ack,
    next_seq,
    seq_after,
)
from taproom.records import BatchBuilder, decode_batch
from taproom.servers.lumberjack.kernel import WindowKernels
from tests.support import fuzz_examples

V1, V2 = Version.V1, Version.V2
_ServerConnection = ServerConnection


@pytest.fixture
def decoder_path(zmq_path: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the compiled window kernel and with the Python decoder alone: this
    module's ServerConnection gets the kernels a server gives it on that path (issue 32)."""
    kernels = WindowKernels.create()
    assert (kernels is None) == (zmq_path == "py")
    patched = functools.partial(_ServerConnection, kernels=kernels)
    monkeypatch.setattr(sys.modules[__name__], "ServerConnection", patched)
    return zmq_path


def W(size: int, v: Version = V2) -> bytes:
    return WindowSizeFrame(size, v).serialize()


def J(seq: int, obj: object, v: Version = V2) -> bytes:
    return JsonFrame(seq, orjson.dumps(obj), v).serialize()


def D(seq: int, pairs: dict[str, str], v: Version = V1) -> bytes:
    return DataFrame.from_mapping(seq, pairs, v).serialize()


def C(frames: bytes, v: Version = V2, level: int = 6) -> bytes:
    return CompressedFrame.compress(frames, level, v)


def receive_all(conn: ServerConnection, data: bytes, now_ns: int = 7) -> list[Window]:
    """``receive_data`` and then the rest it left buffered (one ``C`` frame per call), until
    it has parsed everything or stalls for room."""
    out = conn.receive_data(data, now_ns)
    while conn.more_buffered and not conn.stalled:
        out += conn.receive_data(b"", now_ns)
    return out


def feed(conn: ServerConnection, data: bytes, chunks: list[int] | None = None) -> list[Window]:
    if chunks is None:
        return receive_all(conn, data)
    out: list[Window] = []
    pos = 0
    for size in chunks:
        out += receive_all(conn, data[pos : pos + size])
        pos += size
    out += receive_all(conn, data[pos:])
    return out


def summary(windows: list[Window]) -> list[tuple[int | None, int, list[tuple[int, bytes, str]]]]:
    return [
        (
            w.ack_seq,
            w.version,
            [(r.seq, r.payload, r.content_type) for r in decode_batch(w.batch.body, 0)],
        )
        for w in windows
    ]


MIXED = b"".join(
    [
        W(2, V1),
        D(1, {"line": "a", "type": "syslog"}),
        D(2, {"line": "b\u00e9"}),
        W(3),
        J(7, {"message": "x", "fields": {"app": "web"}}),
        C(J(8, {"m": 1}) + C(J(9, {"m": [1, 2]}))),  # nested C
        W(0),
        W(1, V1),
        C(D(5, {"k": "v"}, V1), V1),
    ]
)


@pytest.mark.usefixtures("decoder_path")
class TestFraming:
    """Seed "Framing": the same windows whatever the TCP segmentation."""

    def test_whole(self) -> None:
        got = summary(feed(ServerConnection("p"), MIXED))
        assert [(a, v, [s for s, _, _ in recs]) for a, v, recs in got] == [
            (2, V1, [1, 2]),
            (9, V2, [7, 8, 9]),
            (0, V2, []),
            (5, V1, [5]),
        ]
        assert got[0][2][1] == (2, orjson.dumps({"line": "b\u00e9"}), "kv")
        assert got[1][2][2] == (9, b'{"m":[1,2]}', "json")

    def test_every_split_point(self) -> None:
        expected = summary(feed(ServerConnection("p"), MIXED))
        for cut in range(1, len(MIXED)):
            assert summary(feed(ServerConnection("p"), MIXED, [cut])) == expected, cut

    def test_byte_by_byte(self) -> None:
        expected = summary(feed(ServerConnection("p"), MIXED))
        conn = ServerConnection("p")
        got: list[Window] = []
        for i in range(len(MIXED)):
            got += conn.receive_data(MIXED[i : i + 1], 7)
        assert summary(got) == expected
        assert conn.buffered_bytes == 0

    @given(st.lists(st.integers(1, 64), max_size=40))
    @settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
    def test_random_segmentation(self, chunks: list[int]) -> None:
        expected = summary(feed(ServerConnection("p"), MIXED))
        assert summary(feed(ServerConnection("p"), MIXED, chunks)) == expected


@pytest.mark.usefixtures("decoder_path")
class TestRecords:
    """Data frames become journal records identical to what BatchBuilder would encode."""

    def test_bytes_match_batchbuilder(self) -> None:
        payload = orjson.dumps({"message": "m", "fields": {"app": "shop"}, "type": "access"})
        conn = ServerConnection("10.0.0.1:5000")
        (window,) = conn.receive_data(W(1) + JsonFrame(42, payload).serialize(), 123)
        ref = BatchBuilder(received_ns=123)
        ref.add(
            "lumberjack",
            payload,
            stream="shop",
            topic="access",
            producer="10.0.0.1:5000",
            seq=42,
            content_type="json",
            attrs={"v": "2"},
        )
        assert window.batch == ref.build()

    def test_kv_mapping(self) -> None:
        conn = ServerConnection("cn=x", stream_fields=("app",), topic_fields=("type",))
        (window,) = conn.receive_data(
            W(1, V1) + D(3, {"app": "billing", "type": "syslog", "line": "hi"}), 5
        )
        (rec,) = decode_batch(window.batch.body, 10)
        assert (rec.stream, rec.topic, rec.producer, rec.seq) == ("billing", "syslog", "cn=x", 3)
        assert (rec.content_type, rec.attrs, rec.received_ns) == ("kv", {"v": "1"}, 5)
        assert orjson.loads(rec.payload) == {"app": "billing", "type": "syslog", "line": "hi"}

    @pytest.mark.parametrize(
        ("doc", "stream", "topic"),
        [
            ({"fields": {"app": "a", "type": "t2"}, "beat": {"name": "b"}}, "a", "t2"),
            ({"beat": {"name": "b"}, "type": "t"}, "b", "t"),
            ({"agent": {"name": "host1"}, "fields": {"app": 7}}, "host1", ""),
            ({"fields": "notamap", "type": ""}, "", ""),
            ({"fields": {"app": "x" * 300}}, "", ""),
        ],
    )
    def test_default_field_paths(self, doc: dict[str, object], stream: str, topic: str) -> None:
        (window,) = ServerConnection("p").receive_data(W(1) + J(1, doc), 1)
        (rec,) = decode_batch(window.batch.body, 0)
        assert (rec.stream, rec.topic) == (stream, topic)
        assert rec.payload == orjson.dumps(doc)

    def test_many_streams_bounded_cache(self) -> None:
        # More distinct (stream, topic) pairs than the per-connection cache holds.
        docs = [{"fields": {"app": f"app{i}"}, "type": f"t{i % 7}"} for i in range(600)]
        data = W(600) + b"".join(J(i + 1, d) for i, d in enumerate(docs))
        (window,) = ServerConnection("p").receive_data(data, 1)
        recs = decode_batch(window.batch.body, 0)
        assert [(r.stream, r.topic) for r in recs] == [(f"app{i}", f"t{i % 7}") for i in range(600)]

    @pytest.mark.parametrize(
        ("when", "ts_ns", "odd"),
        [
            ("2024-05-01T12:00:00.123Z", 1_714_564_800_123_000_000, 0),  # Filebeat's form
            ("2024-05-01T12:00:00.123456789Z", 1_714_564_800_123_456_789, 0),  # Logstash ns
            ("2024-05-01T14:00:00+02:00", 1_714_564_800_000_000_000, 0),
            ("1969-12-31T23:59:59Z", -1_000_000_000, 0),
            ("9999-12-31T23:59:59.999Z", 0, 1),  # the journal cannot hold it: absent, counted
            ("0001-01-01T00:00:00Z", 0, 1),
            ("1970-01-01T00:00:00Z", 0, 0),  # 0 is absent
            ("yesterday", 0, 0),
            (1714564800, 0, 0),  # not the ISO text Beats send: no time
        ],
    )
    def test_timestamp_is_the_event_time(self, when: object, ts_ns: int, odd: int) -> None:
        """Issue 25 part 4: ``@timestamp`` becomes ``ts_ns`` by the event-time rule, in J
        (v2) and D (v1) frames; a time the journal cannot hold is absent and counted."""
        conn = ServerConnection("p")
        data = W(2) + J(1, {"@timestamp": when, "message": "m"})
        data += W(1, V1) + D(2, {"@timestamp": str(when), "line": "l"})
        windows = conn.receive_data(data, 1)
        records = [r for w in windows for r in decode_batch(w.batch.body, 0)]
        json_ts = ts_ns if isinstance(when, str) else 0
        kv_ts = ts_ns if isinstance(when, str) else 0
        assert [r.ts_ns for r in records] == [json_ts, kv_ts]
        assert conn.times.take() == 2 * odd

    def test_invalid_utf8_in_d_becomes_replacement_char(self) -> None:
        frame = struct.pack(">BBII", V1, 0x44, 1, 1) + b"\0\0\0\x01k\0\0\0\x02\xff\xfe"
        (window,) = ServerConnection("p").receive_data(W(1, V1) + frame, 1)
        (rec,) = decode_batch(window.batch.body, 0)
        assert orjson.loads(rec.payload) == {"k": "\ufffd\ufffd"}


@pytest.mark.usefixtures("decoder_path")
class TestAcks:
    """Seed "'ack' frame type": ack the highest sequence number received, never a count."""

    def test_counting_across_windows_pylogbeat_style(self) -> None:
        conn = ServerConnection("p")
        first = conn.receive_data(W(3) + C(b"".join(J(s, {"s": s}) for s in (1, 2, 3))), 1)
        second = conn.receive_data(W(2) + C(b"".join(J(s, {"s": s}) for s in (4, 5))), 1)
        assert [w.ack_seq for w in first + second] == [3, 5]

    def test_restart_at_one_per_window_go_lumber_style(self) -> None:
        data = b"".join(W(2) + C(J(1, {}) + J(2, {})) for _ in range(3))
        assert [w.ack_seq for w in receive_all(ServerConnection("p"), data)] == [2, 2, 2]

    def test_rollover(self) -> None:
        seqs = [0xFFFFFFFE, 0xFFFFFFFF, 0, 1]
        data = W(4) + b"".join(J(s, {}) for s in seqs)
        (window,) = ServerConnection("p").receive_data(data, 1)
        assert window.ack_seq == 1
        assert [r.seq for r in decode_batch(window.batch.body, 0)] == seqs

    def test_highest_not_last(self) -> None:
        (window,) = ServerConnection("p").receive_data(W(3) + J(5, {}) + J(9, {}) + J(7, {}), 1)
        assert window.ack_seq == 9

    def test_window_zero_acked_with_zero(self) -> None:
        (window,) = ServerConnection("p").receive_data(W(0, V1), 1)
        assert (window.ack_seq, window.batch.count, window.version) == (0, 0, V1)
        assert encode_ack(window.version, 0) == b"1A\0\0\0\0"

    def test_streaming_v1_flush_on_idle(self) -> None:
        conn = ServerConnection("p")
        assert conn.receive_data(W(1000, V1) + D(1, {"a": "1"}) + D(2, {"a": "2"}), 1) == []
        assert conn.pending_events == 2
        window = conn.flush()
        assert window is not None and window.ack_seq == 2 and window.batch.count == 2
        assert conn.flush() is None
        # The stream goes on without another W: windows keep closing every 1000 frames,
        # on the sender's boundaries (frame 1000, 2000, ...) despite the partial ack.
        frames = b"".join(D(s, {"a": "x"}) for s in range(3, 2003))
        first, second = conn.receive_data(frames, 1)
        assert (first.ack_seq, first.batch.count) == (1000, 998)
        assert (second.ack_seq, second.batch.count) == (2000, 1000)
        assert conn.pending_events == 2

    def test_new_window_closes_open_one(self) -> None:
        windows = ServerConnection("p").receive_data(W(5) + J(1, {}) + W(1) + J(2, {}), 1)
        assert [(w.ack_seq, w.batch.count) for w in windows] == [(1, 1), (2, 1)]

    def test_large_window_split_v2_parts_carry_partial_acks(self) -> None:
        conn = ServerConnection("p", limits=Limits(max_batch_bytes=64 * 1024))
        doc = {"m": "x" * 1000}
        windows = conn.receive_data(W(200) + b"".join(J(s, doc) for s in range(1, 201)), 1)
        assert len(windows) > 1
        acks = [w.ack_seq for w in windows]
        assert acks == sorted(acks) and acks[-1] == 200  # partial acks, then the window's
        assert [w.done for w in windows] == [False] * (len(windows) - 1) + [True]
        assert sum(w.batch.count for w in windows) == 200
        # Parts of a window not yet complete carry their events' fingerprints.
        assert all(len(w.fingerprints) == w.batch.count for w in windows[:-1])
        assert windows[-1].fingerprints == ()

    def test_large_window_split_v1_ack_on_last_part_only(self) -> None:
        # logstash-forwarder reads exactly one ack per window and takes it for all of it.
        conn = ServerConnection("p", limits=Limits(max_batch_bytes=64 * 1024))
        pairs = {"line": "x" * 1000}
        windows = conn.receive_data(W(200, V1) + b"".join(D(s, pairs) for s in range(1, 201)), 1)
        assert len(windows) > 1
        assert all(w.ack_seq is None for w in windows[:-1]) and windows[-1].ack_seq == 200

    def test_ack_frame_bytes(self) -> None:
        assert AckFrame(513, V2).serialize() == b"2A\x00\x00\x02\x01"
        assert encode_ack(V1, 1 << 32) == b"1A\0\0\0\0"


def _bomb(inflated: int) -> bytes:
    comp = zlib.compressobj(9)
    block = bytes(1 << 20)
    out = [comp.compress(block) for _ in range(inflated >> 20)]
    return b"".join(out) + comp.flush()


MAL = [
    (b"3W\0\0\0\1", "bad_version", LumberjackError),
    (b"2X\0\0\0\1", "bad_frame_type", LumberjackError),
    (b"2A\0\0\0\1", "unexpected_ack", LumberjackError),
    (b"2J\0\0\0\1\0\0\0\0", "empty_json", LumberjackError),
    (JsonFrame(1, b"{nope").serialize(), "bad_json", LumberjackError),
    (JsonFrame(1, b'{"a":1}x').serialize(), "bad_json", LumberjackError),
    (JsonFrame(1, b'"just a string"').serialize(), "json_not_object", LumberjackError),
    (b"1D\0\0\0\1\0\0\0\0", "empty_data", LumberjackError),
    (b"1D\0\0\0\1\0\0\x10\x01", "too_many_pairs", LumberjackLimit),
    (b"2W\0\0\x27\x11", "window_too_large", LumberjackLimit),
    (b"2J\0\0\0\1\x01\0\0\x01", "frame_too_large", LumberjackLimit),
    # No bound on a C frame's length (it is streamed): an absurd one costs nothing, and what
    # follows is judged as it arrives.
    (b"2C\xff\xff\xff\xffabcd", "bad_compressed", LumberjackError),
    (b"1D\0\0\0\1\0\0\0\1\x01\0\0\x01", "frame_too_large", LumberjackLimit),
    (b"2C\0\0\0\4abcd", "bad_compressed", LumberjackError),
    (b"2C\0\0\0\0", "bad_compressed", LumberjackError),
    (CompressedFrame(zlib.compress(J(1, {}))[:-3]).serialize(), "bad_compressed", LumberjackError),
    (
        CompressedFrame(zlib.compress(J(1, {})) + b"xx").serialize(),
        "bad_compressed",
        LumberjackError,
    ),
    (
        CompressedFrame(zlib.compress(J(1, {})[:-1])).serialize(),
        "truncated_compressed",
        LumberjackError,
    ),
    (C(C(C(C(J(1, {}))))), "nesting_too_deep", LumberjackLimit),
    # zlib bombs of zeros: refused at the first inflated byte, whatever they would inflate to
    (CompressedFrame(zlib.compress(bytes(2 << 20))).serialize(), "bad_version", LumberjackError),
    (CompressedFrame(_bomb(64 << 20)).serialize(), "bad_version", LumberjackError),
    (C(C(CompressedFrame(_bomb(64 << 20)).serialize())), "bad_version", LumberjackError),
]


@pytest.mark.usefixtures("decoder_path")
class TestMalformed:
    """Every malformed case gets its documented reason; nothing before it is lost."""

    LIMITS = Limits(max_event_bytes=1 << 20, max_pairs=4096)

    @pytest.mark.parametrize(("data", "reason", "kind"), MAL, ids=[m[1] for m in MAL])
    def test_rejected(self, data: bytes, reason: str, kind: type[Exception]) -> None:
        conn = ServerConnection("p", limits=self.LIMITS)
        before = W(1) + J(1, {"ok": True})
        got: list[Window] = []
        with pytest.raises(kind) as info:
            got += conn.receive_data(before + data, 1)
            while conn.more_buffered:
                got += conn.receive_data(b"", 1)
        assert info.value.reason == reason  # type: ignore[attr-defined]
        # The window completed before the bad frame is handed over for commit and ack (with
        # any whole window the bad C frame held before the damage).
        window = (got + info.value.windows)[0]  # type: ignore[attr-defined]
        assert window.ack_seq == 1 and window.batch.count == 1
        assert all(w.ack_seq == 1 for w in got + info.value.windows)  # type: ignore[attr-defined]

    @pytest.mark.parametrize(("data", "reason", "kind"), MAL, ids=[m[1] for m in MAL])
    def test_rejected_byte_by_byte(self, data: bytes, reason: str, kind: type[Exception]) -> None:
        if len(data) > 4096:
            data = data[:4096]  # the head decides for the length checks; keep it quick
        conn = ServerConnection("p", limits=self.LIMITS)
        with pytest.raises(kind) as info:
            for i in range(len(data)):
                conn.receive_data(data[i : i + 1], 1)
        assert info.value.reason == reason  # type: ignore[attr-defined]

    def test_nesting_within_bound_is_fine(self) -> None:
        conn = ServerConnection("p", limits=Limits(max_nesting=3))
        (window,) = conn.receive_data(W(1) + C(C(C(J(1, {})))), 1)
        assert window.ack_seq == 1


@pytest.mark.usefixtures("decoder_path")
class TestStreaming:
    """Issue 24: a C frame is never whole in memory, nor what it inflates to; the glue grants
    room before events are made; a refused window hands over what it had; a resent window is
    recognised."""

    def test_nested_frames_stream_and_take_every_window(self) -> None:
        # Eight inner C frames of 600 KiB each inside one small outer frame: no shared inflate
        # bound any more (go-lumber and Logstash take them): every window, nothing held whole.
        inner = W(1) + C(J(1, {"pad": "x" * (600 << 10)}), level=9)
        outer = C(inner * 8, level=9)
        assert len(outer) < 40_000
        conn = ServerConnection("p")
        windows = conn.receive_data(outer, 1)
        while conn.more_buffered:
            assert conn.buffered_bytes < 2 << 20
            windows += conn.receive_data(b"", 1)
        assert [w.ack_seq for w in windows] == [1] * 8

    def test_a_large_compressed_frame_is_inflated_a_batch_per_call(self) -> None:
        """A small C frame holding a window of four 5 MiB events is not inflated at once: a
        call inflates about a step (1 MiB) or hands over one batch (a v2 part with its partial
        ack), and stops inside the C frame, holding only the compressed rest and the start of
        the next event."""
        events = [{"pad": "z" * (5 << 20), "n": n} for n in range(4)]
        frame = W(4) + C(b"".join(J(n + 1, e) for n, e in enumerate(events)), level=9)
        assert len(frame) < 100_000
        conn = ServerConnection("p", limits=Limits(max_batch_bytes=1 << 20))
        calls = [conn.receive_data(frame, 1)]
        while conn.more_buffered:
            assert conn.buffered_bytes < 9 << 20  # never the whole window's content
            calls.append(conn.receive_data(b"", 1))
        assert all(len(call) <= 1 for call in calls) and len(calls) >= 4 * 5
        assert [w.batch.count for call in calls for w in call] == [1, 1, 1, 1]
        assert [w.ack_seq for call in calls for w in call] == [1, 2, 3, 4]
        payloads = [
            r.payload for call in calls for w in call for r in decode_batch(w.batch.body, 0)
        ]
        assert [orjson.loads(p) for p in payloads] == events
        assert conn.buffered_bytes == 0

    def test_one_compressed_frame_per_call_rest_left_buffered(self) -> None:
        # Five small C frames arrive in one read: the decoder inflates one, returns its window
        # and keeps the rest as received (compressed), so the glue can grant room first.
        frame = W(1) + C(J(1, {"pad": "y" * (900 << 10)}), level=9)
        conn = ServerConnection("p")
        first = conn.receive_data(J(0, {"plain": 1}) + frame * 5, 1)
        assert [w.batch.count for w in first] == [1, 1] and conn.more_buffered
        assert conn.buffered_bytes == 4 * len(frame) - len(W(1))  # from the second C on
        later = []
        while conn.more_buffered:
            later.append(conn.receive_data(b"", 1))
        assert [[w.ack_seq for w in ws] for ws in later] == [[1]] * 4
        assert conn.buffered_bytes == 0

    def test_a_compressed_frame_arriving_in_pieces_is_parsed_as_it_comes(self) -> None:
        events = [{"i": i, "pad": "q" * 3000} for i in range(2000)]
        frame = W(2000) + C(b"".join(J(i + 1, e) for i, e in enumerate(events)), level=1)
        conn = ServerConnection("p", limits=Limits(max_batch_bytes=256 << 10))
        got: list[Window] = []
        step = 1 << 10
        for at in range(0, len(frame), step):
            got += receive_all(conn, frame[at : at + step])
            assert conn.raw_bytes <= step and conn.inflated_bytes <= 2 << 20
            if at + step < len(frame) // 2:
                continue
            assert got  # parts were handed over before the frame's end
        assert sum(w.batch.count for w in got) == 2000 and got[-1].ack_seq == 2000
        assert len(frame) > 20 * step

    def test_large_content_in_one_window(self) -> None:
        frames = b"".join(J(i, {"i": i, "pad": "r" * (1 << 20)}) for i in range(1, 7))
        (window,) = receive_all(ServerConnection("p"), W(6) + C(frames))
        assert window.ack_seq == 6 and window.batch.count == 6
        conn = ServerConnection("p")
        got: list[Window] = []
        with pytest.raises(LumberjackError) as info:
            more = b"".join(J(i, {"i": i, "pad": "r" * (1 << 20)}) for i in range(7, 13))
            got += conn.receive_data(W(12) + C(frames + more[:-10]), 1)
            while conn.more_buffered:
                got += conn.receive_data(b"", 1)
        assert info.value.reason == "truncated_compressed"
        # The eleven whole events before the cut are handed over, acknowledged (v2).
        got += info.value.windows
        assert sum(w.batch.count for w in got) == 11
        assert got[-1].ack_seq == 11 and not got[-1].done

    def test_more_events_than_the_window_inside_a_c_frame_are_refused(self) -> None:
        # go-lumber reads a window's events and skips the rest of the C frame: a zlib bomb of
        # valid events behind W 1 stops after one event here.
        frames = b"".join(J(i, {"i": i}) for i in range(1, 1000))
        conn = ServerConnection("p")
        with pytest.raises(LumberjackError) as info:
            receive_all(conn, W(1) + C(frames))
        assert info.value.reason == "window_overrun"
        assert [(w.ack_seq, w.batch.count) for w in info.value.windows] == [(1, 1)]
        # A W inside the C frame starts a new window there (taproom's own client nests so).
        ok = receive_all(ServerConnection("p"), W(1) + C(J(1, {}) + W(1) + J(2, {})))
        assert [w.ack_seq for w in ok] == [1, 2]

    def test_no_room_stops_before_the_event_and_hands_over_what_it_holds(self) -> None:
        conn = ServerConnection("p")
        conn.room = 0
        data = W(3) + J(1, {"a": 1}) + J(2, {"a": 2}) + J(3, {"a": 3})
        assert conn.receive_data(data, 1) == []
        assert conn.stalled == STALL_ROOM and conn.more_buffered and conn.room_wanted > 48
        one = conn.room_wanted
        conn.room = one  # room for the first event only
        assert conn.receive_data(b"", 1) == [] and conn.stalled == STALL_ROOM
        assert conn.open_batch_bytes == one and conn.room == 0
        # Before the glue waits for more room, it takes what is built as a part of the
        # window (its room is held: commits free it), acknowledged (v2).
        part = conn.hand_over()
        assert part is not None and conn.hand_over() is None
        assert (part.batch.count, part.ack_seq, part.done) == (1, 1, False)
        assert len(part.batch.body) == one and conn.open_batch_bytes == 0
        conn.room = 10 * one
        (rest,) = conn.receive_data(b"", 1)
        assert (rest.batch.count, rest.ack_seq, rest.done) == (2, 3, True)
        assert conn.room == 10 * one - len(rest.batch.body)

    def test_a_read_completing_a_j_frame_is_parsed_where_it_is(self) -> None:
        # A read mostly ends inside a J frame: the next completes that frame from its head and
        # parses the rest of itself in place (not copied behind the frame's start). At every
        # cut inside the second frame, with room for all and with room that runs out at the
        # completed frame (it waits, the rest held with it), the windows are those of one read.
        frames = [J(i + 1, {"message": "m" * (20 + i), "fields": {"app": "a"}}) for i in range(6)]
        data = W(6) + b"".join(frames)
        expected = summary(feed(ServerConnection("p"), data))
        second = len(W(6)) + len(frames[0])
        for cut in range(second + 1, second + len(frames[1])):
            assert summary(feed(ServerConnection("p"), data, [cut])) == expected, cut
            if cut - second < 10:
                continue  # its header is not whole yet: the frame's size is not known
            conn = ServerConnection("p")
            conn.room = 0
            got = conn.receive_data(data[:cut], 1)
            assert conn.stalled == STALL_ROOM
            conn.room = conn.room_wanted  # the first event's record, no more
            got += conn.receive_data(b"", 1)
            assert conn.room == 0 and conn.incomplete_frame_bytes == len(frames[1])
            got += conn.receive_data(data[cut:], 1)
            assert conn.stalled == STALL_ROOM, cut
            assert conn.buffered_bytes == len(data) - second, cut
            conn.room = 1 << 20
            got += receive_all(conn, b"")
            assert summary(got) == expected, cut
            assert conn.buffered_bytes == 0

    def test_no_inflate_room_waits_before_inflating(self) -> None:
        conn = ServerConnection("p")
        conn.inflate_room = 0
        frame = W(2) + C(J(1, {"a": 1}) + J(2, {"pad": "p" * 200_000}))
        assert conn.receive_data(frame, 1) == []
        assert conn.stalled == STALL_INFLATE and conn.inflated_bytes == 0
        conn.inflate_room = conn.inflate_wanted
        windows = receive_all(conn, b"")
        assert [w.ack_seq for w in windows] == [2]
        assert conn.inflated_bytes == 0

    def test_a_large_event_is_inflated_whole_once_its_room_is_granted(self) -> None:
        conn = ServerConnection("p")
        conn.inflate_room = 256 << 10
        frame = W(1) + C(J(1, {"pad": "z" * (3 << 20)}), level=9)
        windows = receive_all(conn, frame)
        assert windows == [] and conn.stalled == STALL_INFLATE
        assert conn.inflated_bytes <= 256 << 10 and conn.inflate_wanted > 3 << 20
        conn.inflate_room = conn.inflate_wanted
        (window,) = receive_all(conn, b"")
        assert window.ack_seq == 1

    @pytest.mark.parametrize("version", [V1, V2])
    def test_a_refused_window_hands_over_the_events_before_the_bad_one(
        self, version: Version
    ) -> None:
        good = [D(s, {"n": str(s)}, version) for s in range(1, 5)]
        data = W(10, version) + b"".join(good) + b"2J\0\0\0\5\0\0\0\3xyz"
        with pytest.raises(LumberjackError) as info:
            ServerConnection("p").receive_data(data, 1)
        (part,) = info.value.windows
        assert part.batch.count == 4 and not part.done and len(part.fingerprints) == 4
        # v2: a partial ack before the close; v1: none (its client takes any ack as the
        # window's), so its resend is recognised instead.
        assert part.ack_seq == (4 if version == V2 else None)

    @pytest.mark.parametrize("version", [V1, V2])
    def test_no_idle_ack_inside_a_compressed_frame(self, version: Version) -> None:
        # logstash-forwarder sends 1W n + one 1C and takes the first ack for the whole
        # window: a frame arriving slowly must not be acknowledged in part while it arrives.
        frames = b"".join(D(s, {"n": str(s)}, version) for s in range(1, 101))
        data = W(100, version) + C(frames, version, level=0)
        conn = ServerConnection("p")
        assert receive_all(conn, data[: len(data) // 2]) == []
        assert conn.pending_events > 0 and conn.flush() is None
        # ... but when the input ends there, what was parsed is handed over (v2: with a
        # partial ack; v1: without), with its fingerprints for the resend.
        part = conn.flush(ending=True)
        assert part is not None and not part.done and part.fingerprints
        assert part.ack_seq == (None if version == V1 else part.batch.count)

    def test_a_resent_window_skips_what_was_stored(self) -> None:
        events = [J(s, {"n": s}) for s in range(1, 11)]
        with pytest.raises(LumberjackError) as info:
            ServerConnection("p").receive_data(W(10) + b"".join(events[:6]) + b"2X", 1)
        (part,) = info.value.windows
        remembered = {part.fingerprints[0]: part.fingerprints}
        conn = ServerConnection("p")
        conn.resend = remembered
        windows = receive_all(conn, W(10) + C(b"".join(events)))
        (window,) = windows
        assert window.ack_seq == 10 and window.done
        assert window.skipped == part.fingerprints and window.resent_of == part.fingerprints[0]
        assert [r.seq for r in decode_batch(window.batch.body, 0)] == [7, 8, 9, 10]
        # Another window (the sender's next one, or the rest only after a partial ack):
        # nothing matches, nothing is skipped.
        other = ServerConnection("p")
        other.resend = remembered
        (rest,) = receive_all(other, W(4) + C(b"".join(J(s, {"n": s + 6}) for s in range(1, 5))))
        assert rest.skipped == () and rest.batch.count == 4

    def test_incomplete_frame_bytes_from_the_header(self) -> None:
        conn = ServerConnection("p")
        assert conn.incomplete_frame_bytes == 0
        frame = J(1, {"pad": "z" * 5000})
        conn.receive_data(frame[:3], 1)
        assert conn.buffered_bytes == 3
        conn.receive_data(frame[3:100], 1)
        assert conn.incomplete_frame_bytes == len(frame) and conn.buffered_bytes == 100
        conn.receive_data(frame[100:], 1)
        assert conn.incomplete_frame_bytes == 0 and conn.buffered_bytes == 0


# Building frames inside hypothesis is slow; the fuzz picks from prebuilt pieces instead
# (valid frames of every type, truncated and oversized ones) and adds random bytes and flips.
_PIECES = [
    W(0),
    W(2, V1),
    W(20_000),
    D(1, {"line": "a", "type": "t"}),
    D(0xFFFFFFFF, {"": ""}, V2),
    J(2, {"a": 1}),
    J(0, {"fields": {"app": "x"}}, V1),
    JsonFrame(3, b"[1]").serialize(),
    JsonFrame(3, b"\xff").serialize(),
    C(J(1, {}) + D(2, {"k": "v"})),
    C(C(J(1, {}))),
    C(bytes(10_000)),
    b"2C\0\0\0\x05x\x9c\x03\0\0",
    b"2J\0\0\0\1\xff\xff\xff\xff",
    b"1D\0\0\0\1\0\0\0\2\0\0\0\1k",
    b"2A\0\0\0\0",
]


def _fuzz_once(data: bytes, cut: int) -> None:
    conn = ServerConnection("p", limits=Limits(max_window=1000, max_event_bytes=4096))
    try:
        receive_all(conn, data[:cut], 1)
        receive_all(conn, data[cut:], 1)
        conn.flush()
    except (LumberjackError, LumberjackLimit):
        pass


def _fuzz_choice(choice: bytes) -> None:
    # One cheap strategy drives everything: bytes 0-2 pick the cut, the flip and whether to
    # wrap in C; each further byte with the top bit set picks a piece, the others are junk.
    cut, flip_at, wrap = choice[0], choice[1], choice[2] & 1
    data = bytearray()
    for b in choice[3:]:
        if b & 0x80:
            data += _PIECES[b % len(_PIECES)]
        else:
            data.append(b)
    if data and flip_at < 200:
        data[flip_at % len(data)] ^= 1 << (flip_at % 8)
    body = bytes(data)
    if wrap:
        body = CompressedFrame(zlib.compress(body, 1)).serialize()
    _fuzz_once(body, cut)


class TestFuzz:
    """Random input gives windows or a documented protocol error, never a crash or a hang.

    ``make test`` runs 20,000 examples; ``make soak`` (``-m soak``) the 1,000,000 variant.
    """

    @given(st.binary(min_size=3, max_size=24))
    @settings(max_examples=fuzz_examples(20_000, 200_000), deadline=None)
    def test_decoder(self, choice: bytes) -> None:
        _fuzz_choice(choice)

    @pytest.mark.soak
    @given(st.binary(min_size=3, max_size=24))
    @settings(max_examples=fuzz_examples(20_000, 200_000), deadline=None)
    def test_decoder_soak(self, choice: bytes) -> None:
        _fuzz_choice(choice)

    @given(st.binary(max_size=40), st.integers(0, 40))
    @settings(max_examples=fuzz_examples(2_000, 100_000), deadline=None)
    def test_random_bytes(self, data: bytes, cut: int) -> None:
        _fuzz_once(data, cut)


class TestClientSession:
    """The sender's bookkeeping: windows, bulk acks, keepalives, roll-over, resend."""

    def test_windows_and_bulk_ack(self) -> None:
        session = ClientSession(Version.V2, compression_level=0)
        a = session.encode_window([{"n": 1}, {"n": 2}])
        b = session.encode_window([{"n": 3}])
        assert (a.first_seq, a.last_seq, b.first_seq, b.last_seq) == (1, 2, 3, 3)
        assert a.data.startswith(W(2) + J(1, {"n": 1}))
        assert session.receive_data(encode_ack(V2, 0) + encode_ack(V2, 1)) == []
        assert session.keepalives == 1
        assert session.receive_data(encode_ack(V2, 3)) == [a, b]
        assert session.acked_events == 3

    def test_rollover_skips_zero(self) -> None:
        assert next_seq(0xFFFFFFFF) == 1 and next_seq(5) == 6
        assert seq_after(1, 0xFFFFFFFF) and not seq_after(0xFFFFFFFF, 1)
        session = ClientSession(Version.V1)
        session.next_seq = 0xFFFFFFFE
        window = session.encode_window([{"a": "b"}] * 3)
        assert (window.first_seq, window.last_seq) == (0xFFFFFFFE, 1)
        assert session.receive_data(encode_ack(V1, 0xFFFFFFFF)) == []
        assert session.receive_data(encode_ack(V1, 1)) == [window]

    def test_reconnected_reencodes_unacked(self) -> None:
        session = ClientSession(Version.V2)
        session.encode_window([{"n": 1}])
        session.encode_window([{"n": 2}])
        session.receive_data(encode_ack(V2, 1))
        (data,) = session.reconnected()
        windows = ServerConnection("p").receive_data(data, 1)
        assert windows[0].ack_seq == 1
        assert decode_batch(windows[0].batch.body, 0)[0].payload == b'{"n":2}'

    def test_server_sending_data_is_an_error(self) -> None:
        with pytest.raises(LumberjackError):
            ClientSession().receive_data(W(1))

    @given(
        st.lists(
            st.dictionaries(st.text(max_size=8), st.text(max_size=8), min_size=1, max_size=4),
            min_size=1,
            max_size=30,
        ),
        st.integers(0, 9),
        st.sampled_from([V1, V2]),
    )
    @settings(max_examples=300)
    def test_round_trip(self, events: list[dict[str, str]], level: int, version: Version) -> None:
        session = ClientSession(version, compression_level=level)
        window = session.encode_window(events)
        (got,) = ServerConnection("p").receive_data(window.data, 1)
        assert got.ack_seq == window.last_seq
        records = decode_batch(got.batch.body, 0)
        assert [orjson.loads(r.payload) for r in records] == events
        assert {r.content_type for r in records} == {"kv" if version == V1 else "json"}


# A child interpreter: how much a zlib bomb's event makes the
# decoder hold, as the kernel counts it (VmHWM from the start of the parse).
_BOMB_PROBE = """
import struct, sys, zlib
from taproom.protocols.lumberjack import LumberjackError, ServerConnection
from taproom.servers.lumberjack.kernel import WindowKernels

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

size = int(sys.argv[1])
comp = zlib.compressobj(9)
body = comp.compress(b"2J" + struct.pack(">II", 1, size))
zeros = bytes(1 << 20)
for _ in range(size >> 20):
    body += comp.compress(zeros)
body += comp.flush()
del zeros
frame = b"2W" + struct.pack(">I", 1) + b"2C" + struct.pack(">I", len(body)) + body
conn = ServerConnection("p", kernels=WindowKernels.create())
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM counts from here
base = status("VmRSS")
try:
    conn.receive_data(frame, 1)
    while conn.more_buffered and not conn.stalled:
        conn.receive_data(b"", 1)
    reason = "accepted"
except LumberjackError as exc:
    reason = exc.reason
print(reason, status("VmHWM") - base)
"""


def test_a_bomb_event_costs_its_frame_and_one_copy_not_four(decoder_path: str) -> None:
    # Issue 26: a C frame announcing a 12 MiB J event of zeros (a zlib bomb's) was held as
    # the bytearray it grew in, the bytes copied from it, the payload sliced from those and
    # orjson's copy while it failed: 4.0 x the event (50 MB) where the inflate holder counts
    # one; now the frame (a bytearray of its size, filled in place and parsed as it is) and
    # orjson's error document, a str of the payload it builds as it fails (2.0 x).
    size = 12 << 20
    reason, peak = subprocess.run(
        [sys.executable, "-c", _BOMB_PROBE, str(size)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.split()
    assert reason == "bad_json"
    assert int(peak) < 3 * size, int(peak) / size
