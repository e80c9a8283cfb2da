"""The sans-I/O Lumberjack core: framing, windows and acks, mapping, malformed input, fuzz."""

from __future__ import annotations

import struct
import zlib

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taproom.protocols.lumberjack import (
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
from tests.support import fuzz_examples

V1, V2 = Version.V1, Version.V2


def W(size: int, v: Version = V2) -> bytes:
    return WindowSizeFrame(size, v).serialize()


def J(seq: int, obj: object, v: Version = V2) -> bytes:
    return JsonFrame(seq, orjson.dumps(obj), v).serialize()


def D(seq: int, pairs: dict[str, str], v: Version = V1) -> bytes:
    return DataFrame.from_mapping(seq, pairs, v).serialize()


def C(frames: bytes, v: Version = V2, level: int = 6) -> bytes:
    return CompressedFrame.compress(frames, level, v)


def receive_all(conn: ServerConnection, data: bytes, now_ns: int = 7) -> list[Window]:
    """``receive_data`` and then the rest it left buffered (one ``C`` frame per call)."""
    out = conn.receive_data(data, now_ns)
    while conn.more_buffered:
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
    @settings(max_examples=200)
    def test_random_segmentation(self, chunks: list[int]) -> None:
        expected = summary(feed(ServerConnection("p"), MIXED))
        assert summary(feed(ServerConnection("p"), MIXED, chunks)) == expected


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

    def test_large_window_split_ack_on_last_part(self) -> None:
        conn = ServerConnection("p", limits=Limits(max_batch_bytes=64 * 1024))
        doc = {"m": "x" * 1000}
        windows = conn.receive_data(W(200) + b"".join(J(s, doc) for s in range(1, 201)), 1)
        assert len(windows) > 1
        assert all(w.ack_seq is None for w in windows[:-1]) and windows[-1].ack_seq == 200
        assert sum(w.batch.count for w in windows) == 200

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
    (b"2C\x01\0\0\x01", "frame_too_large", LumberjackLimit),
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
    (
        CompressedFrame(zlib.compress(bytes(2 << 20))).serialize(),
        "decompressed_too_large",
        LumberjackLimit,
    ),
    (CompressedFrame(_bomb(64 << 20)).serialize(), "decompressed_too_large", LumberjackLimit),
]


class TestMalformed:
    """Every malformed case gets its documented reason; nothing before it is lost."""

    LIMITS = Limits(max_frame_bytes=1 << 20, max_decompressed_bytes=1 << 20, max_pairs=4096)

    @pytest.mark.parametrize(("data", "reason", "kind"), MAL, ids=[m[1] for m in MAL])
    def test_rejected(self, data: bytes, reason: str, kind: type[Exception]) -> None:
        conn = ServerConnection("p", limits=self.LIMITS)
        before = W(1) + J(1, {"ok": True})
        with pytest.raises(kind) as info:
            conn.receive_data(before + data, 1)
        assert info.value.reason == reason  # type: ignore[attr-defined]
        # The window completed before the bad frame is handed over for commit and ack.
        (window,) = info.value.windows  # type: ignore[attr-defined]
        assert window.ack_seq == 1 and window.batch.count == 1

    @pytest.mark.parametrize(("data", "reason", "kind"), MAL, ids=[m[1] for m in MAL])
    def test_rejected_byte_by_byte(self, data: bytes, reason: str, kind: type[Exception]) -> None:
        if len(data) > 4096:
            data = data[:4096]  # the head decides for the length checks; keep it quick
            if reason in ("decompressed_too_large",):
                return
        conn = ServerConnection("p", limits=self.LIMITS)
        with pytest.raises(kind) as info:
            for i in range(len(data)):
                conn.receive_data(data[i : i + 1], 1)
        assert info.value.reason == reason  # type: ignore[attr-defined]

    def test_nesting_within_bound_is_fine(self) -> None:
        conn = ServerConnection("p", limits=Limits(max_nesting=3))
        (window,) = conn.receive_data(W(1) + C(C(C(J(1, {})))), 1)
        assert window.ack_seq == 1


class TestInflateBounds:
    """Issue 19 item 6: nested ``C`` frames and many ``C`` frames in one read stay bounded."""

    LIMITS = Limits(max_frame_bytes=1 << 20, max_decompressed_bytes=1 << 20)

    def test_nested_frames_share_the_outer_frames_bound(self) -> None:
        # Each inner C inflates to 600 KiB (within the bound alone); eight of them would be
        # 4.8 MiB from one small outer frame. Together they may inflate to the bound, no more.
        inner = W(1) + C(J(1, {"pad": "x" * (600 << 10)}), level=9)
        outer = C(inner * 8, level=9)
        assert len(outer) < 40_000
        conn = ServerConnection("p", limits=self.LIMITS)
        with pytest.raises(LumberjackLimit) as info:
            receive_all(conn, outer)
        assert info.value.reason == "decompressed_too_large"
        # The one window that fitted is handed over for commit and ack, not lost.
        assert [w.ack_seq for w in info.value.windows] == [1]

    def test_nesting_within_the_bound_is_whole(self) -> None:
        inner = W(1) + C(J(1, {"pad": "x" * (200 << 10)}), level=9)
        windows = receive_all(ServerConnection("p", limits=self.LIMITS), C(inner * 4))
        assert [w.ack_seq for w in windows] == [1, 1, 1, 1]

    def test_a_large_compressed_frame_is_inflated_a_batch_per_call(self) -> None:
        """Issue 19 (bench attack, compressed burst): a small C frame holding a window of four
        5 MiB events is not inflated at once (20 MiB, then batches of it, then the next
        window). Each call hands over one batch and stops inside the C frame, holding only the
        compressed rest and the start of the next event; the window's ack comes with the last."""
        events = [{"pad": "z" * (5 << 20), "n": n} for n in range(4)]
        frame = W(4) + C(b"".join(J(n + 1, e) for n, e in enumerate(events)), level=9)
        assert len(frame) < 100_000
        conn = ServerConnection("p", limits=Limits(max_batch_bytes=1 << 20))
        calls = [conn.receive_data(frame, 1)]
        while conn.more_buffered:
            assert conn.buffered_bytes < 9 << 20  # never the whole window's content
            calls.append(conn.receive_data(b"", 1))
        assert [[w.batch.count for w in call] for call in calls] == [[1], [1], [1], [1]]
        assert [w.ack_seq for call in calls for w in call] == [None, None, None, 4]
        payloads = [
            r.payload for call in calls for w in call for r in decode_batch(w.batch.body, 0)
        ]
        assert [orjson.loads(p) for p in payloads] == events
        assert conn.buffered_bytes == 0

    def test_one_compressed_frame_per_call_rest_left_buffered(self) -> None:
        # Five small C frames that inflate to 900 KiB each arrive in one read: the decoder
        # inflates one, returns its window and keeps the rest as received (compressed), so
        # the glue can check the hub's capacity before inflating the next.
        frame = W(1) + C(J(1, {"pad": "y" * (900 << 10)}), level=9)
        conn = ServerConnection("p", limits=self.LIMITS)
        first = conn.receive_data(J(0, {"plain": 1}) + frame * 5, 1)
        assert [w.batch.count for w in first] == [1, 1] and conn.more_buffered
        assert conn.buffered_bytes == 4 * len(frame) - len(W(1))  # from the second C on
        later = []
        while conn.more_buffered:
            later.append(conn.receive_data(b"", 1))
        assert [[w.ack_seq for w in ws] for ws in later] == [[1]] * 4
        assert conn.buffered_bytes == 0

    def test_large_content_inflates_in_steps_within_the_bound(self) -> None:
        # Past 4 MiB the output grows in one bytearray a step at a time (a single bounded
        # zlib call peaks at twice its bound); frames parse the same from it.
        limits = Limits(max_frame_bytes=2 << 20, max_decompressed_bytes=7 << 20)
        frames = b"".join(J(i, {"i": i, "pad": "r" * (1 << 20)}) for i in range(1, 7))
        (window,) = receive_all(ServerConnection("p", limits=limits), W(6) + C(frames))
        assert window.ack_seq == 6 and window.batch.count == 6
        with pytest.raises(LumberjackLimit) as info:
            receive_all(ServerConnection("p", limits=limits), W(8) + C(frames + frames[:-10]))
        assert info.value.reason == "decompressed_too_large"

    def test_incomplete_frame_bytes_from_the_header(self) -> None:
        conn = ServerConnection("p", limits=self.LIMITS)
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
    conn = ServerConnection(
        "p", limits=Limits(max_window=1000, max_frame_bytes=4096, max_decompressed_bytes=8192)
    )
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
