"""Every decoder of producer data, fuzzed with a time bound per input (issue 25, part 2).

A decoder loop that can be sent backwards never ends: one 12-byte LogTK entry hung the whole
hub. Each target here feeds one decoder valid encodings mutated where lengths live (bytes
flipped, int32s overwritten with negative and huge values, cut short, spliced) as well as raw
bytes, and checks that every input returns or raises the decoder's documented error **within
a second** (:func:`time_bound`: a SIGALRM interrupts a pure-Python loop that does not end;
generous, so a loaded machine cannot fail it, and a hang fails at once instead of timing out
the suite). ``make soak`` runs many more examples.
"""

from __future__ import annotations

import contextlib
import datetime
import signal
import struct
import time
from collections.abc import Iterator

import bson
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taproom.eventtime import MAX_NS, MIN_NS, EventTimes
from taproom.payloads import decode_payload
from taproom.protocols import logjam as lj
from taproom.protocols.eventbus import EventBusError, Limits, kvmsg, parse_pub
from taproom.protocols.eventbus.commands import _check_msgpack
from taproom.protocols.lager.formats import TYPES, DataFormat, FormatError, Item
from taproom.protocols.lager.messages import MessageError, parse_data_message
from taproom.protocols.logtk import (
    Data,
    FrameDecoder,
    Init,
    LogTKError,
    decode_log_entry,
    encode_frame,
    encode_log_entry,
    time_reader,
)
from taproom.protocols.logtk.bsonwalk import BsonError, decode_lenient
from taproom.protocols.lumberjack import (
    CompressedFrame,
    JsonFrame,
    ServerConnection,
    WindowSizeFrame,
)
from taproom.protocols.lumberjack.frames import LumberjackError, LumberjackLimit
from tests.support import fuzz_examples

PER_INPUT_S = 1.0


class Hung(Exception):
    """A decoder did not return within the per-input bound."""


@contextlib.contextmanager
def time_bound(seconds: float = PER_INPUT_S) -> Iterator[None]:
    """Interrupt the block after ``seconds`` (SIGALRM: a Python loop that never ends raises
    :class:`Hung`). The suite's own alarm (pytest-timeout) is put back, less the time used."""

    def expire(signum: int, frame: object) -> None:
        raise Hung(f"no result within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay:
            left = max(outer_delay - (time.monotonic() - started), 0.001)
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


FUZZ = settings(
    max_examples=fuzz_examples(200, 50_000),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[bytes]) -> bytes:
    """A valid encoding with a few mutations where decoders trust the bytes."""
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(0, 4))):
        if not data:
            break
        kind = draw(st.integers(0, 4))
        at = draw(st.integers(0, len(data) - 1))
        if kind == 0:  # a length overwritten: negative, tiny, huge
            value = draw(
                st.sampled_from([-1, -7, -(2**31), 0, 1, 4, 5, 2**31 - 1])
                | st.integers(-(2**31), 2**31 - 1)
            )
            data[at : at + 4] = struct.pack("<i", value)
        elif kind == 1:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == 2:
            del data[at:]
        elif kind == 3:
            data[at:at] = draw(st.binary(max_size=8))
        else:
            data[at] = draw(st.integers(0, 255))
    return bytes(data)


# --- BSON (LogTK's bson format: the ack path's $time, tail's decode) ----------------------------

# BSON names and C strings end at NUL; a lone surrogate is not text (logtkjs's Buffer.from
# writes U+FFFD for one, which reads back as one code unit, as it counted it).
_NO_NUL = st.characters(exclude_characters="\x00", exclude_categories=("Cs",))

_bson_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.binary(max_size=8)
    | st.datetimes(timezones=st.just(datetime.UTC)),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(_NO_NUL, max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_bson_docs = st.dictionaries(st.text(_NO_NUL, max_size=8), _bson_values, max_size=6).map(
    bson.encode
)


def _logtkjs_string_doc(text: str) -> bytes:
    units = len(text.encode("utf-16-le")) // 2
    body = b"\x02$message\x00" + struct.pack("<I", units + 1) + text.encode() + b"\x00"
    body += b"\x09$time\x00" + struct.pack("<q", 1_795_464_988_673)
    return struct.pack("<I", len(body) + 5) + body + b"\x00"


_bson_inputs = (
    mutated(_bson_docs)
    | mutated(st.text(_NO_NUL, max_size=20).map(_logtkjs_string_doc))
    | st.binary()
)


@FUZZ
@given(doc=_bson_inputs)
def test_bson_time_reader(doc: bytes) -> None:
    with time_bound():
        ts_ns = time_reader("bson")(doc, EventTimes())
    assert MIN_NS <= ts_ns <= MAX_NS


@FUZZ
@given(doc=_bson_inputs)
def test_bson_decoders(doc: bytes) -> None:
    with time_bound():
        try:
            decode_lenient(doc)
        except BsonError:
            pass
        decode_payload("bson", doc)  # a value, text or base64: never raises


@FUZZ
@given(text=st.text(_NO_NUL, max_size=40))
def test_logtkjs_strings_always_read(text: str) -> None:
    """Any text logtkjs writes (its UTF-16 lengths) is read back exactly, with its time (a
    JavaScript string holding U+0000 cannot be told from its end: not taken)."""
    doc = _logtkjs_string_doc(text)
    with time_bound():
        assert decode_lenient(doc)["$message"] == text
        assert time_reader("bson")(doc, EventTimes()) == 1_795_464_988_673 * 10**6


# --- protobuf (LogTK's protobuf format) ---------------------------------------------------------

_entries = st.builds(
    encode_log_entry,
    time_ms=st.integers(0, 2**64 - 1),
    level=st.integers(0, 2**32),
    message=st.text(max_size=20),
    trace=st.none()
    | st.fixed_dictionaries({"file": st.text(max_size=8), "line": st.integers(0, 99)}),
    fields=st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
)


@FUZZ
@given(payload=mutated(_entries) | st.binary())
def test_protobuf(payload: bytes) -> None:
    with time_bound():
        ts_ns = time_reader("protobuf")(payload, EventTimes())
        try:
            decode_log_entry(payload)
        except ValueError:
            pass
        decode_payload("protobuf", payload)
    assert MIN_NS <= ts_ns <= MAX_NS


# --- msgpack (Event BUS data, tail) -------------------------------------------------------------

_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(data=mutated(_msgpack_values.map(msgpack.packb)) | st.binary())
def test_msgpack(data: bytes) -> None:
    with time_bound():
        try:
            _check_msgpack(data)
        except EventBusError as exc:
            assert exc.reason == "bad_msgpack"
        decode_payload("msgpack", data)


# --- JSON paths (LogTK's json format time fields; Lumberjack's stream and topic paths) ----------

_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=25),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3)
    ),
    max_leaves=10,
)
_time_names = st.sampled_from(["$time", "time", "timestamp", "@timestamp", "ts", "fields", "type"])
_json_docs = st.dictionaries(_time_names | st.text(max_size=6), _json_values, max_size=5)


def _json_bytes(doc: object) -> bytes:
    import json

    return json.dumps(doc).encode()


@settings(FUZZ, max_examples=fuzz_examples(100, 20_000))  # JSON documents: slow to draw
@given(payload=mutated(_json_docs.map(_json_bytes)) | st.binary())
def test_logtk_json_time(payload: bytes) -> None:
    with time_bound():
        ts_ns = time_reader("json")(payload, EventTimes())
    assert MIN_NS <= ts_ns <= MAX_NS


@settings(FUZZ, max_examples=fuzz_examples(100, 20_000))
@given(
    payloads=st.lists(mutated(_json_docs.map(_json_bytes)), min_size=1, max_size=5),
    paths=st.lists(
        st.sampled_from(["fields.app", "type", "fields.type.x", "a.b.c", ""]), max_size=3
    ),
)
def test_lumberjack_json_paths(payloads: list[bytes], paths: list[str]) -> None:
    conn = ServerConnection("10.0.0.1:1", stream_fields=paths, topic_fields=paths)
    wire = b"2W" + struct.pack(">I", len(payloads))
    for seq, payload in enumerate(payloads, 1):
        wire += b"2J" + struct.pack(">II", seq, len(payload)) + payload
    with time_bound():
        try:
            conn.receive_data(wire, 0)
        except (LumberjackError, LumberjackLimit):
            pass


# --- event times (every protocol's producer time) -----------------------------------------------


@FUZZ
@given(
    text=st.text(max_size=40)
    | st.datetimes().map(lambda d: d.isoformat())
    | st.builds(
        lambda y, rest: f"{y:04d}{rest}",
        st.integers(0, 9999),
        st.sampled_from(["-01-01T00:00:00Z", "-12-31T23:59:59.999999999+00:00", "-02-30T00:00:00"]),
    ),
    ms=st.integers(-(2**70), 2**70),
)
def test_event_times(text: str, ms: int) -> None:
    times = EventTimes()
    with time_bound():
        ns = times.iso(text)
        by_ms = times.ms(ms)
    assert ns is None or MIN_NS <= ns <= MAX_NS
    assert MIN_NS <= by_ms <= MAX_NS


# --- kvmsg properties and updates (Event BUS CHP, the Guide's Clone wire) -----------------------

_property_lines = st.lists(
    st.sampled_from(["ttl", "timestamp", "producer", "colour", "", "a=b"]).flatmap(
        lambda name: st.text(max_size=30).map(lambda v: f"{name}={v}")
    )
    | st.text(max_size=20),
    max_size=6,
).map(lambda lines: "\n".join(lines).encode("utf-8", "surrogatepass"))


@FUZZ
@given(
    properties=mutated(_property_lines) | st.binary(max_size=200),
    uuid16=st.sampled_from([b"", b"\x01" * 16]) | st.binary(min_size=16, max_size=16),
)
def test_kvmsg_properties(properties: bytes, uuid16: bytes) -> None:
    frames = [b"/k/1", bytes(8), uuid16, properties, b"body"]
    with time_bound():
        try:
            kvmsg.parse_properties(properties, Limits())
        except EventBusError:
            pass
        try:
            kvmsg.parse_update(frames, Limits(), EventTimes())
        except EventBusError:
            pass


@FUZZ
@given(
    timestamp=st.binary(max_size=70),
    data=mutated(_msgpack_values.map(msgpack.packb)),
)
def test_event_bus_pub(timestamp: bytes, data: bytes) -> None:
    frames = [b"/t/1", bytes(8), b"p", timestamp, b"0f8fad5b-d9cb-469f-a165-70867728950e", data]
    with time_bound():
        try:
            parse_pub(frames, Limits(), EventTimes())
        except EventBusError:
            pass


# --- Lager rows and data messages ----------------------------------------------------------------

_LAGER = DataFormat.from_items(
    [
        Item("a", TYPES["uint32"], 4, 0, 1),
        Item("b", TYPES["float64"], 16, 4, 2),
        Item("s", TYPES["string"], 7, 20, 1),
        Item("c", TYPES["int8"], 1, 27, 1),
    ]
)


@FUZZ
@given(
    row=st.binary(min_size=_LAGER.row_size, max_size=_LAGER.row_size) | st.binary(max_size=60),
    frames=st.lists(st.binary(max_size=20), max_size=8),
)
def test_lager_rows_and_messages(row: bytes, frames: list[bytes]) -> None:
    with time_bound():
        try:
            _LAGER.decode_row(row)
        except FormatError:
            pass
        try:
            _LAGER.decode_buffer(row * 3)
        except FormatError:
            pass
        try:
            parse_data_message(frames)
        except MessageError:
            pass


# --- logjam bodies and meta frames (zlib/gzip, snappy, LZ4: sizes the sender announces) --------

_logjam_bodies = st.tuples(
    st.sampled_from([0, 1, 2, 3]), st.binary(max_size=300) | _json_docs.map(_json_bytes)
).map(lambda mb: (mb[0], lj.compress(mb[0], mb[1])))


@settings(FUZZ, max_examples=fuzz_examples(100, 20_000))  # JSON documents: slow to draw
@given(
    body=_logjam_bodies.flatmap(
        lambda mb: st.tuples(st.just(mb[0]), mutated(st.just(mb[1])) | st.binary(max_size=64))
    ),
    meta=mutated(st.just(lj.encode_meta(1, 7, 1_700_000_000_000, 9))) | st.binary(max_size=30),
)
def test_logjam_bodies_and_meta(body: tuple[int, bytes], meta: bytes) -> None:
    method, data = body
    with time_bound():
        try:
            lj.decompress(method, data, 4096)
        except lj.LogjamError:
            pass
        try:
            lj.parse_meta(meta)
        except lj.LogjamError:
            pass


# --- frame streams: LogTK (varuint lengths, cstrings) and Lumberjack (W/J/D/C, nested zlib) ---


def _logtk_stream(data: list[bytes]) -> bytes:
    return encode_frame(Init("bson", 7, None, False)) + b"".join(
        encode_frame(Data(entry, i)) for i, entry in enumerate(data, 1)
    )


@FUZZ
@given(stream=mutated(st.lists(st.binary(max_size=40), max_size=4).map(_logtk_stream)))
def test_logtk_frames(stream: bytes) -> None:
    decoder = FrameDecoder(truncate_data=True)
    with time_bound():
        try:
            decoder.feed(stream)
        except LogTKError:
            pass


def _lumberjack_stream(docs: list[object]) -> bytes:
    frames = WindowSizeFrame(len(docs)).serialize() + b"".join(
        JsonFrame(i, _json_bytes(doc)).serialize() for i, doc in enumerate(docs, 1)
    )
    return frames + CompressedFrame.compress(frames, 3) + frames[:20]


@settings(FUZZ, max_examples=fuzz_examples(100, 20_000))  # JSON documents: slow to draw
@given(stream=mutated(st.lists(_json_docs, min_size=1, max_size=4).map(_lumberjack_stream)))
def test_lumberjack_frames(stream: bytes) -> None:
    conn = ServerConnection("p")
    with time_bound():
        try:
            conn.receive_data(stream, 1)
            while conn.more_buffered:
                conn.receive_data(b"", 1)
        except (LumberjackError, LumberjackLimit):
            pass


def test_the_time_bound_catches_a_loop_that_never_ends() -> None:
    """The bound itself: a Python loop that never ends is interrupted, not waited for."""
    started = time.monotonic()
    with pytest.raises(Hung), time_bound(0.2):
        while True:
            pass
    assert time.monotonic() - started < 30
