"""protocols/logjam/: frames, meta, compression, grammar, output mapping, replay requests."""

from __future__ import annotations

import gzip
import struct
import zlib

import lz4.block
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taproom.eventtime import EventTimes
from taproom.protocols import logjam as lj
from taproom.protocols.logjam import Compression, LogjamError, LogjamLimit
from taproom.records import BatchBuilder, Record, decode_batch
from tests.support import fuzz_examples

MAX = 1 << 20
BODY = orjson.dumps({"action": "Users#show", "code": 200, "total_time": 12.5, "x": "y" * 200})


def meta(**kw):
    args = {"compression": 0, "device": 7, "created_ms": 1_700_000_000_123, "sequence": 42}
    args.update(kw)
    return lj.encode_meta(args["compression"], args["device"], args["created_ms"], args["sequence"])


def parse(frames, **kw):
    kw.setdefault("max_body", MAX)
    kw.setdefault("max_decompressed", MAX)
    return lj.parse_message(frames, **kw)


class TestMetaFrame:
    """Seed: meta-info = tag compression-method version device-number created-ms sequence."""

    def test_24_byte_logjam_tools_form_round_trips(self):
        frame = lj.encode_meta(Compression.LZ4, 70_000, 1_700_000_000_123, (1 << 64) - 1)
        assert len(frame) == 24
        assert frame[:2] == b"\xca\xbd"
        m = lj.parse_meta(frame)
        assert (m.compression, m.device, m.created_ms, m.sequence, m.size) == (
            Compression.LZ4,
            70_000,
            1_700_000_000_123,
            (1 << 64) - 1,
            24,
        )

    def test_22_byte_seed_form(self):
        frame = struct.pack("!HBBHQQ", 0xCABD, 2, 1, 513, 99, 3)
        assert len(frame) == 22
        m = lj.parse_meta(frame)
        assert (m.compression, m.device, m.created_ms, m.sequence, m.size) == (
            Compression.SNAPPY,
            513,
            99,
            3,
            22,
        )
        assert lj.encode_meta(2, 513, 99, 3, size=22) == frame

    @pytest.mark.parametrize("fmt,size", [("<HBBIQQ", 24), ("<HBBHQQ", 22)])
    def test_byte_swapped_tag_reads_little_endian(self, fmt, size):
        frame = struct.pack(fmt, 0xCABD, 1, 1, 5, 1234, 77)
        assert frame[:2] == b"\xbd\xca"
        m = lj.parse_meta(frame)
        assert (m.compression, m.device, m.created_ms, m.sequence, m.swapped, m.size) == (
            Compression.ZLIB,
            5,
            1234,
            77,
            True,
            size,
        )

    @pytest.mark.parametrize("size", [n for n in range(0, 40) if n not in (22, 24)])
    def test_other_sizes_are_refused(self, size):
        with pytest.raises(LogjamError) as info:
            lj.parse_meta(meta()[:size] if size <= 24 else meta() + b"\0" * (size - 24))
        assert info.value.reason == "bad_meta_size"
        assert info.value.reply == lj.BAD_REQUEST

    @pytest.mark.parametrize("tag", [0, 0xCABC, 0xBDCB, 0xFFFF, 0xBACD])
    def test_wrong_tag(self, tag):
        frame = struct.pack("!HBBIQQ", tag, 0, 1, 0, 0, 1)
        with pytest.raises(LogjamError) as info:
            lj.parse_meta(frame)
        assert info.value.reason == "bad_meta_tag"

    @pytest.mark.parametrize("version", [0, 2, 255])
    def test_wrong_version(self, version):
        with pytest.raises(LogjamError) as info:
            lj.parse_meta(struct.pack("!HBBIQQ", 0xCABD, 0, version, 0, 0, 1))
        assert info.value.reason == "bad_meta_version"

    @pytest.mark.parametrize("method", [4, 5, 127, 255])
    def test_unknown_compression(self, method):
        with pytest.raises(LogjamError) as info:
            lj.parse_meta(struct.pack("!HBBIQQ", 0xCABD, method, 1, 0, 0, 1))
        assert info.value.reason == "bad_compression"


class TestCompression:
    """compression-method: 0 none, 1 zlib (gzip too), 2 raw snappy, 3 size-prefixed lz4."""

    @pytest.mark.parametrize("method", list(Compression))
    @pytest.mark.parametrize("data", [b"", b"{}", BODY, BODY * 100])
    def test_round_trip(self, method, data):
        packed = lj.compress(method, data)
        assert lj.decompress(method, packed, MAX) == data
        if method != Compression.NONE and len(data) > 1000:
            assert len(packed) < len(data)

    def test_wire_formats_are_the_documented_ones(self):
        assert zlib.decompress(lj.compress(Compression.ZLIB, BODY)) == BODY
        lz = lj.compress(Compression.LZ4, BODY)
        assert struct.unpack("!I", lz[:4])[0] == len(BODY)
        assert lz4.block.decompress(lz[4:], uncompressed_size=len(BODY)) == BODY
        # someone else's lz4 block with our prefix, and gzip under method 1
        foreign = struct.pack("!I", len(BODY)) + lz4.block.compress(BODY, store_size=False)
        assert lj.decompress(Compression.LZ4, foreign, MAX) == BODY
        assert lj.decompress(Compression.ZLIB, gzip.compress(BODY), MAX) == BODY

    @pytest.mark.parametrize("method", list(Compression))
    def test_decompressed_size_bound(self, method):
        big = b"[" + b"0," * 50_000 + b"0]"
        packed = lj.compress(method, big)
        assert lj.decompress(method, packed, len(big)) == big
        with pytest.raises(LogjamLimit) as info:
            lj.decompress(method, packed, len(big) - 1)
        assert info.value.reason == "decompressed_too_large"

    def test_zlib_bomb_stops_at_the_bound(self):
        bomb = zlib.compress(b"\0" * (64 << 20), 9)  # 64 MiB in ~64 KiB
        with pytest.raises(LogjamLimit):
            lj.decompress(Compression.ZLIB, bomb, MAX)
        with pytest.raises(LogjamLimit):
            lj.decompress(Compression.ZLIB, gzip.compress(b"\0" * (8 << 20)), MAX)

    def test_announced_sizes_are_checked_before_allocating(self):
        with pytest.raises(LogjamLimit):
            lj.decompress(Compression.LZ4, struct.pack("!I", 1 << 31) + b"\0" * 8, MAX)
        huge_snappy = b"\xff\xff\xff\xff\x0f" + b"\0" * 8  # announces 4 GiB
        with pytest.raises(LogjamLimit):
            lj.decompress(Compression.SNAPPY, huge_snappy, MAX)

    @pytest.mark.parametrize("method", [Compression.ZLIB, Compression.SNAPPY, Compression.LZ4])
    def test_every_truncation_is_an_error_never_a_crash(self, method):
        packed = lj.compress(method, BODY)
        for cut in range(len(packed)):
            try:
                out = lj.decompress(method, packed[:cut], MAX)
            except LogjamError:
                continue
            assert out != BODY or cut == len(packed)

    def test_garbage_after_zlib_stream(self):
        with pytest.raises(LogjamError):
            lj.decompress(Compression.ZLIB, zlib.compress(BODY) + b"xx", MAX)

    def test_corrupt_blocks(self):
        with pytest.raises(LogjamError):
            lj.decompress(Compression.LZ4, b"\0\0", MAX)
        with pytest.raises(LogjamError):
            lj.decompress(Compression.LZ4, struct.pack("!I", 100) + b"\xff" * 10, MAX)
        with pytest.raises(LogjamError):
            lj.decompress(Compression.SNAPPY, b"\x80\x80\x80\x80\x80\x80", MAX)
        with pytest.raises(LogjamError):
            lj.decompress(Compression.SNAPPY, b"\x20" + b"\xff" * 10, MAX)

    def test_names(self):
        assert lj.compression_by_name("LZ4") is Compression.LZ4
        with pytest.raises(ValueError):
            lj.compression_by_name("brotli")


class TestGrammar:
    """The "device" grammar (default): logjam-device's own functions, well_formed_stream_name
    and well_formed_topic (logjam-tools src/logjam-util.c; the cases of its own unit tests,
    test_well_formed_stream_name and test_well_formed_topic, are among these); the "seed"
    grammar: logjam-consumer.txt's ABNF."""

    @pytest.mark.parametrize(
        "value",
        [
            b"app-prod",
            b"a-b",  # logjam-util.c's own test cases
            b"a-b-c",
            b"my_app-production",  # the Ruby agent's app-env for an app called my_app
            b"web2-production",
            b"my.app-production",  # every byte 32..127 and one "-": nothing else is asked
            b"my app-production",
            b"-production",
            b"myapp-",
            b"-",
            b"app-prod/x",
            b"app\x7f-prod",  # 127 passes `s[i] > 127`
            b"~!@#$%^&*()-{}[]",
        ],
    )
    def test_valid_app_env(self, value):
        assert lj.is_valid_app_env(value)
        assert lj.well_formed_stream_name(value)

    @pytest.mark.parametrize(
        "value",
        [
            b"",  # logjam-util.c's own test cases
            b"abc",
            "ö-ö".encode(),
            b"ping",
            b"app-prod\n",  # below 32
            b"app-\x00prod",
            b"app-\x1fprod",
            b"app-pr\xc3\xa9",  # 128 and above: negative as a signed char, > 127 unsigned
            b"app-\x80",
            b"app prod",
        ],
    )
    def test_invalid_app_env(self, value):
        assert not lj.is_valid_app_env(value)
        assert not lj.well_formed_stream_name(value)

    @pytest.mark.parametrize(
        "value",
        [
            b"logs.1",  # logjam-util.c's own test cases
            b"events.1",
            b"javascript.1",
            b"frontend.page.1",
            b"frontend.ajax.1",
            b"mobile",
            b"logs",
            b"logs.my_app.production",  # the Ruby agent's routing key for my_app
            b"logs.perf-ua.production",
            b"logs..",
            b"logsx",  # a prefix, not a word
            b"logs.my app",  # nothing after the prefix is checked
            b"logs/myapp",
            "logs.äpp".encode(),
            b"logs.\xff\x00",
            b"frontend.pages",
            b"mobile.x",
        ],
    )
    def test_valid_topic(self, value):
        assert lj.is_valid_topic(value)
        assert lj.well_formed_topic(value)

    @pytest.mark.parametrize(
        "value",
        [
            b"abc",  # logjam-util.c's own test case
            b"",
            b"log",
            b"Logs.myapp.production",  # strncmp: case matters
            b"metrics.cpu.production",
            b".logs",
            b" logs",
            b"frontend",
            b"frontend.",
            b"frontend.pag",
            b"javascrip",
            b"event",
            b"mobil",
        ],
    )
    def test_invalid_topic(self, value):
        assert not lj.is_valid_topic(value)
        assert not lj.well_formed_topic(value)

    @pytest.mark.parametrize(
        "value,valid",
        [
            (b"app-prod", True),
            (b"my_app-pre_view", True),
            (b"web2-prod", False),
            (b"1app-prod", False),
            (b"app-prod-2", False),
        ],
    )
    def test_seed_app_env(self, value, valid):
        assert lj.is_valid_app_env(value, grammar="seed") is valid

    @pytest.mark.parametrize(
        "value,valid",
        [
            (b"logs.app.prod", True),
            (b"logsx", True),
            (b"frontend.ajax", True),
            (b"frontend.pages", False),
            (b"logs.my_app.prod", False),
            (b"logs.app-prod", False),
            (b"mobile", False),
            (b"Logs", False),
        ],
    )
    def test_seed_topic(self, value, valid):
        assert lj.is_valid_topic(value, grammar="seed") is valid


class TestDataMessage:
    """data-msg = app-env topic json-body meta-info"""

    @pytest.mark.parametrize("method", list(Compression))
    @pytest.mark.parametrize("meta_size", [22, 24])
    def test_encode_then_parse(self, method, meta_size):
        frames = lj.encode_message(
            b"app-prod",
            b"logs.app.prod",
            BODY,
            compression=method,
            device=3,
            created_ms=1_700_000_000_000,
            sequence=9,
            meta_size=meta_size,
        )
        msg = parse(frames)
        assert isinstance(msg, lj.DataMessage)
        assert (msg.app_env, msg.topic, msg.body) == ("app-prod", "logs.app.prod", BODY)
        assert (msg.meta.device, msg.meta.sequence, msg.meta.compression) == (3, 9, method)

    def test_maps_to_a_record(self):
        msg = parse([b"app-prod", b"logs.app.prod", BODY, meta(compression=0)])
        builder = BatchBuilder(received_ns=5)
        msg.add_to(builder)
        (record,) = decode_batch(builder.build().body, 10)
        assert record.protocol == "logjam"
        assert (record.stream, record.topic, record.producer) == ("app-prod", "logs.app.prod", "7")
        assert (record.seq, record.ts_ns, record.content_type) == (
            42,
            1_700_000_000_123_000_000,
            "json",
        )
        assert record.payload == BODY

    @pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 6])
    def test_wrong_frame_count(self, n):
        frames = [b"app-prod", b"logs.x", BODY, meta(), b"extra", b"more"][:n]
        with pytest.raises(LogjamError) as info:
            parse(frames)
        assert info.value.reason == "bad_frame_count"

    @pytest.mark.parametrize(
        "frames,reason",
        [
            ([b"app", b"logs", b"{}", meta()], "bad_app_env"),
            ([b"app-prod", b"metrics.cpu", b"{}", meta()], "bad_topic"),
            ([b"app-prod", b"logs", b"{}", meta()[:23]], "bad_meta_size"),
            ([b"app-prod", b"logs", b"{}", b"\0" * 24], "bad_meta_tag"),
            ([b"app-prod", b"logs", b"xx", meta(compression=1)], "bad_body"),
        ],
    )
    def test_invalid(self, frames, reason):
        with pytest.raises(LogjamError) as info:
            parse(frames)
        assert info.value.reason == reason

    def test_oversized_body_frame(self):
        with pytest.raises(LogjamLimit) as info:
            parse([b"app-prod", b"logs", b"[" + b" " * 100 + b"]", meta()], max_body=50)
        assert info.value.reason == "body_too_large"
        with pytest.raises(LogjamLimit) as info:
            parse([b"app-prod", b"logs", b"[" + b" " * 100 + b"]", meta()], max_decompressed=50)
        assert info.value.reason == "decompressed_too_large"

    def test_truncated_meta_at_every_length(self):
        full = meta()
        for cut in range(len(full)):
            if cut == 22:
                continue  # a 22-byte prefix of a 24-byte frame is a different, valid layout
            with pytest.raises(LogjamError):
                parse([b"app-prod", b"logs", b"{}", full[:cut]])

    def test_ping(self):
        msg = parse([lj.PING, b"app-prod", b"{}", meta()])
        assert isinstance(msg, lj.PingMessage)
        assert msg.app_env == "app-prod"
        with pytest.raises(LogjamError):
            parse([lj.PING, b"app-prod", b"{}", b"short"])

    @pytest.mark.parametrize("body", [b"{not json", b"", b"plain text \xff", b"[1, 2"])
    def test_a_body_that_is_not_json_is_kept_raw(self, body):
        for method in Compression:
            msg = parse([b"app-prod", b"logs", lj.compress(method, body), meta(compression=method)])
            assert isinstance(msg, lj.DataMessage)
            assert (msg.body, msg.content_type) == (body, "raw")
            builder = BatchBuilder()
            msg.add_to(builder)
            (record,) = decode_batch(builder.build().body, 0)
            assert (record.payload, record.content_type) == (body, "raw")

    def test_reply_frames_are_logjam_devices(self):
        """read_router_message_and_forward: routing id, the first frame after the empty one
        (app-env or "ping"), the status, then the host for a ping; "unknown-unknown" when the
        request had nothing after the empty frame. No empty delimiter."""
        assert lj.reply_frames(b"id", [b"app-prod", b"logs"], lj.ACCEPTED) == [
            b"id",
            b"app-prod",
            b"202 Accepted",
        ]
        assert lj.reply_frames(b"id", [lj.PING], lj.PING_OK, b"host") == [
            b"id",
            b"ping",
            b"200 OK",
            b"host",
        ]
        assert lj.reply_frames(b"id", [], lj.BAD_REQUEST) == [
            b"id",
            b"unknown-unknown",
            b"400 Bad Request",
        ]


class TestOutputMapping:
    """docs/protocols/logjam.md, "Output mapping"."""

    def test_logjam_records_keep_app_env_topic_and_body(self):
        mapper = lj.OutputMapper()
        rec = Record("logjam", "app-prod", "logs.app.prod", payload=BODY, ts_ns=5_000_000)
        assert mapper.map(rec, now_ms=99) == (b"app-prod", b"logs.app.prod", BODY, 5)

    def test_other_protocols_get_default_app_env_and_logs_topic(self):
        mapper = lj.OutputMapper()
        rec = Record(
            "lumberjack",
            "/var/log/syslog",
            "file-1",
            producer="10.0.0.1:5000",
            seq=3,
            content_type="json",
            payload=b'{"message":"hi"}',
            attrs={"k": "v"},
            offset=17,
        )
        app_env, topic, body, created = mapper.map(rec, now_ms=1234)
        assert (app_env, topic, created) == (b"taproom-lumberjack", b"logs.lumberjack.file", 1234)
        assert lj.is_valid_app_env(app_env) and lj.is_valid_topic(topic)
        doc = orjson.loads(body)
        assert doc["payload"] == '{"message":"hi"}'  # no decoder given: text
        assert doc["taproom"]["offset"] == 17
        assert doc["taproom"]["stream"] == "/var/log/syslog"
        assert doc["taproom"]["attrs"] == {"k": "v"}

    @pytest.mark.parametrize(
        "stream", ["10.0.0.1:5000-x", "/var/log/my-app.log", "my app-prod", "-prod", "app-"]
    )
    def test_streams_the_device_takes_but_that_name_no_app_get_the_default(self, stream):
        """Another protocol's stream becomes the app-env only when it names an application and
        an environment (letters, digits, "_"), not whenever logjam-device would take it."""
        assert lj.is_valid_app_env(stream.encode())
        assert lj.OutputMapper().app_env("lumberjack", stream) == b"taproom-lumberjack"

    def test_valid_stream_is_kept_and_event_protocols_use_events(self):
        mapper = lj.OutputMapper(payload_decoder=lambda ct, p: orjson.loads(p))
        rec = Record("eventbus", "shop-prod", "orders/created", content_type="json", payload=b"[1]")
        app_env, topic, body, _ = mapper.map(rec, 0)
        assert (app_env, topic) == (b"shop-prod", b"events.eventbus.orders.created")
        assert orjson.loads(body)["payload"] == [1]
        assert mapper.topic("logtk", "") == b"logs.logtk"
        assert mapper.topic("logtk", "42!!") == b"logs.logtk"

    def test_routes(self):
        mapper = lj.OutputMapper(routes=("logjam", "logtk"))
        assert mapper.routed("logtk") and not mapper.routed("lumberjack")
        assert lj.OutputMapper().routed("anything")
        custom = lj.OutputMapper(default_app_env="hub-{protocol}")
        assert custom.app_env("lager", "") == b"hub-lager"


class TestReplayRequest:
    def test_offset_mode(self):
        req = lj.parse_replay_request([b"offset", b"10", b"500", b"app-"], max_count=100)
        assert (req.mode, req.start, req.limit, req.prefixes) == (
            lj.ReplayMode.OFFSET,
            10,
            100,
            (b"app-",),
        )

    def test_seq_mode_is_clamped(self):
        req = lj.parse_replay_request([b"seq", b"5", b"1000"], max_count=10)
        assert (req.mode, req.start, req.limit, req.prefixes) == (lj.ReplayMode.SEQ, 5, 14, ())

    @pytest.mark.parametrize(
        "frames",
        [
            [],
            [b"offset", b"1"],
            [b"rewind", b"1", b"2"],
            [b"offset", b"-1", b"2"],
            [b"offset", b"1", b"x"],
            [b"offset", b"99999999999999999999", b"1"],
            [b"seq", b"5", b"4"],
            [b"offset", b"1", b"2", b"p" * 300],
            [b"offset", b"1", b"2"] + [b"p"] * 17,
        ],
    )
    def test_bad(self, frames):
        with pytest.raises(LogjamError) as info:
            lj.parse_replay_request(frames, max_count=10)
        assert info.value.reason == "bad_replay_request"


# --- fuzz -------------------------------------------------------------------------------------

# One binary draw per example keeps hypothesis's own cost low; the test turns the bytes into a
# frame list: either arbitrary frames, or a near-valid message (grammar picks, a compressed and
# possibly cut body, a meta frame with a valid or swapped tag) so the deep paths get exercised.
_APP_ENVS = [b"app-prod", b"a-b", b"bad", b"", b"ping", b"x-y_z", b"\xff-x", b"my app-", b"-\x7f"]
_TOPICS = [
    b"logs",
    b"logs.a b",
    b"events.x",
    b"frontend.page",
    b"no pe",
    b"",
    b"logs.\xff",
    b"Logs",
]
_RAW = [b'{"a":1}', BODY, b"[]", b"nul", b"{", b'"\xff"']


def _frames_from(data: bytes) -> list[bytes]:
    if not data:
        return []
    mode, rest = data[0], data[1:]
    if mode % 3 == 0:  # arbitrary frames, lengths taken from the data
        frames, pos = [], 0
        while pos < len(rest) and len(frames) < 6:
            n = rest[pos] % 40
            frames.append(rest[pos + 1 : pos + 1 + n])
            pos += 1 + n
        return frames
    rest = rest.ljust(32, b"\0")
    method = rest[0] % 5  # 4 is not a method: the meta must refuse it
    raw = _RAW[rest[1] % len(_RAW)] if rest[2] % 4 else rest[32:]
    body = lj.compress(method % 4, raw)
    if rest[3] % 3 == 0:
        body = body[: rest[4] % (len(body) + 1)] + rest[5:7]
    order = "<" if rest[6] % 5 == 0 else "!"
    fmt = order + ("HBBIQQ" if rest[7] % 2 else "HBBHQQ")
    tag = 0xCABD if rest[8] % 7 else int.from_bytes(rest[9:11], "big")
    version = 1 if rest[11] % 9 else rest[12]
    created = int.from_bytes(rest[13:21], "big")
    seq = int.from_bytes(rest[21:29], "big")
    meta_frame = struct.pack(fmt, tag, method, version, rest[29], created, seq)
    if rest[30] % 11 == 0:
        meta_frame = meta_frame[: rest[31] % 30]
    return [_APP_ENVS[rest[9] % len(_APP_ENVS)], _TOPICS[rest[10] % len(_TOPICS)], body, meta_frame]


_PARSER = lj.IngestParser(max_body=4096, max_decompressed=4096)


@settings(max_examples=fuzz_examples(20_000, 200_000), database=None)
@given(st.binary(max_size=120))
def test_fuzz_frame_decoder_never_crashes(data):
    """Random frames give a message or a documented LogjamError; the server's hot path
    (IngestParser) agrees with parse_message on every input, reason for reason."""
    frames = _frames_from(data)
    builder = BatchBuilder(received_ns=1)
    _PARSER.start_batch(1)
    try:
        msg = lj.parse_message(frames, max_body=4096, max_decompressed=4096)
    except LogjamError as exc:
        assert exc.reply == lj.BAD_REQUEST
        assert exc.reason.replace("_", "").isalpha()
        with pytest.raises(LogjamError) as info:
            _PARSER.add(builder, frames)
        assert info.value.reason == exc.reason
        assert len(builder) == 0
        if len(frames) == 4:  # the fast path (four frames, as the server calls it) agrees
            with pytest.raises(LogjamError) as info:
                _PARSER.push(*frames)
            assert info.value.reason == exc.reason
            assert _PARSER.pending() == 0
        return
    ping = _PARSER.add(builder, frames)
    assert _PARSER.push(*frames) == ping
    if isinstance(msg, lj.DataMessage):
        if msg.content_type == "json":
            orjson.loads(msg.body)
        else:
            assert msg.content_type == "raw"
            with pytest.raises(orjson.JSONDecodeError):
                orjson.loads(msg.body)
        assert lj.is_valid_app_env(msg.app_env.encode())
        assert msg.topic.encode("utf-8", "surrogateescape") == frames[1]
        assert lj.is_valid_topic(frames[1])
        assert len(msg.body) <= 4096
        assert ping is None
        expected = BatchBuilder(received_ns=1)
        msg.add_to(expected)
        expected_batch = expected.build()
        assert builder.build() == expected_batch
        assert _PARSER.take_batch() == expected_batch  # byte-identical from the fast path
    else:
        assert frames[0] == lj.PING
        assert ping == msg and len(builder) == 0 and _PARSER.pending() == 0


@pytest.mark.parametrize("created", [1 << 62, (1 << 64) - 1, lj.MAX_CREATED_MS + 1])
def test_created_ms_beyond_i64_nanoseconds_is_absent_and_counted(created):
    """The event-time rule (issue 25 part 4): stored absent (0), counted, never refused; on
    both ingest paths (add and the fast push)."""
    frames = [b"app-prod", b"logs", b"{}", lj.encode_meta(0, 1, created, 1)]
    parser = lj.IngestParser(max_body=4096, max_decompressed=4096)
    builder = BatchBuilder()
    parser.add(builder, frames)
    parser.start_batch(1)
    parser.pusher()(*frames)
    fast = parser.take_batch()
    times = EventTimes()
    parse(frames).add_to(builder)
    assert [r.ts_ns for r in decode_batch(builder.build().body, 0)] == [0, 0]
    assert [r.ts_ns for r in decode_batch(fast.body, 0)] == [0]
    assert parser.times.take() == 2  # add and push; parse() here counts into its own tally
    assert lj.created_ns(created, times) == 0 and times.take() == 1
    assert lj.created_ns(lj.MAX_CREATED_MS) == lj.MAX_CREATED_MS * 1_000_000
    assert lj.created_ns(1_700_000_000_000) == 1_700_000_000_000_000_000
    assert lj.created_ns(0, times) == 0 and times.take() == 0  # "unknown": absent, not odd


def test_fuzz_generator_reaches_valid_messages():
    """The fuzz input above is not all rejects: some decode to data messages and pings."""
    kinds = set()
    for i in range(3000):
        data = bytes((i * 7 + k * 13 + (i >> 3) * k) % 256 for k in range(60))
        try:
            kinds.add(
                type(lj.parse_message(_frames_from(data), max_body=4096, max_decompressed=4096))
            )
        except LogjamError as exc:
            kinds.add(exc.reason)
    assert lj.DataMessage in kinds
    assert {"bad_meta_tag", "bad_frame_count", "bad_body"} <= kinds


@settings(max_examples=fuzz_examples(1_000, 100_000), database=None)
@given(
    st.sampled_from(list(Compression)),
    st.integers(0, 0xFFFF),
    st.integers(0, (1 << 64) - 1),
    st.integers(0, (1 << 64) - 1),
    st.sampled_from([22, 24]),
    st.binary(max_size=300),
)
def test_fuzz_meta_round_trip(method, device, created, seq, size, data):
    frame = lj.encode_meta(method, device, created, seq, size=size)
    m = lj.parse_meta(frame)
    assert (m.compression, m.device, m.created_ms, m.sequence, m.size) == (
        method,
        device,
        created,
        seq,
        size,
    )
    assert lj.decompress(method, lj.compress(method, data), 300) == data
