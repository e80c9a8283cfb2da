"""The payload formats LogTK carries: decoded off the ack path, and their event time.

``protobuf`` is taproom's ``LogEntry`` (``logtk_entry.proto`` next to this module), ``bson`` the
reference client's documents (read leniently where logtkjs breaks BSON: :mod:`.bsonwalk`).
Both decoders register with :mod:`taproom.payloads`. :func:`time_reader` gives the ack path a
cheap reader of each format's time field, for the records' ``ts_ns``, by the event-time rule
(:mod:`taproom.eventtime`).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Mapping

import orjson

from ...eventtime import EventTimes
from ...payloads import json_ready, register_decoder
from .bsonwalk import BsonError, decode_lenient, top_level_value

__all__ = [
    "JSON_TIME_FIELDS",
    "decode_bson_payload",
    "decode_log_entry",
    "encode_log_entry",
    "time_reader",
]


# --- payload formats ------------------------------------------------------------------------
# taproom's LogEntry (logtk_entry.proto next to this module), hand-coded: five fields do not
# justify generated code, and no protoc is needed at build time. Field numbers follow the
# reference client's ``logtk.LogMessage`` (1 time, 2 trace, 3 level, 4 message) so its
# messages decode too; ``fields`` (5) is taproom's addition.


def _pb_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _pb_read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise ValueError("varint too long")


def _pb_bytes(number: int, value: bytes) -> bytes:
    return _pb_varint(number << 3 | 2) + _pb_varint(len(value)) + value


def encode_log_entry(
    *,
    time_ms: int = 0,
    level: int = 0,
    message: str = "",
    trace: Mapping[str, object] | None = None,
    fields: Mapping[str, str] | None = None,
) -> bytes:
    """Serialize a ``taproom.logtk.LogEntry`` (proto3 wire format, default values omitted)."""
    out = bytearray()
    if time_ms:
        out += _pb_varint(1 << 3) + _pb_varint(time_ms)
    if trace:
        inner = bytearray()
        if trace.get("file"):
            inner += _pb_bytes(1, str(trace["file"]).encode("utf-8"))
        for number, key in ((2, "line"), (3, "col")):
            value = int(trace.get(key) or 0)  # type: ignore[call-overload]
            if value:
                inner += _pb_varint(number << 3) + _pb_varint(value)
        out += _pb_bytes(2, bytes(inner))
    if level:
        out += _pb_varint(3 << 3) + _pb_varint(level)
    if message:
        out += _pb_bytes(4, message.encode("utf-8"))
    for key, value in (fields or {}).items():
        entry = _pb_bytes(1, key.encode("utf-8")) + _pb_bytes(2, str(value).encode("utf-8"))
        out += _pb_bytes(5, entry)
    return bytes(out)


def _pb_fields(buf: bytes) -> list[tuple[int, int, object]]:
    """(field number, wire type, value) for every field; unknown fields are kept, not fatal."""
    out: list[tuple[int, int, object]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _pb_read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: object
        if wire == 0:
            value, pos = _pb_read_varint(buf, pos)
        elif wire == 1:
            if pos + 8 > len(buf):
                raise ValueError("truncated fixed64")
            value = buf[pos : pos + 8]
            pos += 8
        elif wire == 2:
            n, pos = _pb_read_varint(buf, pos)
            if pos + n > len(buf):
                raise ValueError("truncated length-delimited field")
            value = buf[pos : pos + n]
            pos += n
        elif wire == 5:
            if pos + 4 > len(buf):
                raise ValueError("truncated fixed32")
            value = buf[pos : pos + 4]
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        out.append((number, wire, value))
    return out


def decode_log_entry(payload: bytes) -> dict[str, object]:
    """A ``LogEntry`` as a JSON-ready dict; raises ``ValueError`` on a malformed message."""
    entry: dict[str, object] = {"time": 0, "level": 0, "message": "", "trace": None, "fields": {}}
    fields: dict[str, str] = {}
    for number, wire, value in _pb_fields(payload):
        if number == 1 and wire == 0:
            entry["time"] = value
        elif number == 2 and wire == 2:
            assert isinstance(value, bytes)
            trace: dict[str, object] = {"file": "", "line": 0, "col": 0}
            for n, w, v in _pb_fields(value):
                if n == 1 and w == 2:
                    assert isinstance(v, bytes)
                    trace["file"] = v.decode("utf-8")
                elif n == 2 and w == 0:
                    trace["line"] = v
                elif n == 3 and w == 0:
                    trace["col"] = v
            entry["trace"] = trace
        elif number == 3 and wire == 0:
            entry["level"] = value
        elif number == 4 and wire == 2:
            assert isinstance(value, bytes)
            entry["message"] = value.decode("utf-8")
        elif number == 5 and wire == 2:
            assert isinstance(value, bytes)
            key = text = ""
            for n, w, v in _pb_fields(value):
                if w == 2 and n in (1, 2):
                    assert isinstance(v, bytes)
                    if n == 1:
                        key = v.decode("utf-8")
                    else:
                        text = v.decode("utf-8")
            fields[key] = text
    entry["fields"] = fields
    return entry


def decode_bson_payload(payload: bytes) -> object:
    """A BSON document (the reference client's ``$level``/``$message``/... records).

    pymongo's strict decoder first; a document it refuses is read leniently
    (:func:`.bsonwalk.decode_lenient`), which takes logtkjs's UTF-16 string lengths
    (docs/compat.md). Raises ``ValueError`` when neither can read it."""
    import bson  # from pymongo; imported here so the wire path never pays for it

    # Dates as aware UTC datetimes (printed with their zone); one outside Python's range stays
    # a DatetimeMS (printed as such) instead of failing the whole document.
    options: bson.CodecOptions[dict[str, object]] = bson.CodecOptions(
        tz_aware=True, datetime_conversion=bson.DatetimeConversion.DATETIME_AUTO
    )
    try:
        return json_ready(bson.decode(payload, codec_options=options))
    except bson.errors.InvalidBSON as strict:
        try:
            return json_ready(decode_lenient(payload))
        except BsonError:
            raise ValueError(f"not BSON: {strict}") from None


# --- event time -----------------------------------------------------------------------------
# Each reader returns nanoseconds since the epoch (UTC) by the event-time rule
# (taproom.eventtime: a time the journal cannot hold is absent and counted in ``times``), or 0
# when the entry carries no time it can read: a missing or malformed time never costs the
# entry, it only leaves ts_ns unset. Every loop below moves forward by construction (issue 25).

# Top-level JSON fields read as the entry's time, first found wins: logtkjs's own name first,
# then the names loggers commonly use.
JSON_TIME_FIELDS = ("$time", "time", "timestamp", "@timestamp", "ts")
_JSON_TIME_HINT = re.compile(rb'"(?:\$time|time|timestamp|@timestamp|ts)"')
# logtkjs's "json" format is JavaScript-flavoured text, not JSON: "$time": [Date: <ISO>Z]
_JS_DATE = re.compile(rb'"\$time"\s*:\s*\[Date: ([0-9T:.+\-Z]{10,40})\]')
_I64 = struct.Struct("<q")
_I32 = struct.Struct("<i")
_F64 = struct.Struct("<d")


def _number_ns(value: int | float, times: EventTimes) -> int:
    """A number's unit from its size: seconds, milliseconds, microseconds or nanoseconds
    since the epoch (each reading covers the years 1973-5138)."""
    size = abs(value)
    scale = 1 if size >= 1e17 else 1_000 if size >= 1e14 else 10**6 if size >= 1e11 else 10**9
    if isinstance(value, int):
        return times.ns(value * scale)
    if value != value or size == float("inf"):
        return 0
    # A double holds ~16 digits: keep microseconds, not float noise in the nanoseconds.
    return times.ns(round(value * scale / 1_000) * 1_000 if scale >= 1_000 else round(value))


def _protobuf_time_ns(payload: bytes, times: EventTimes) -> int:
    """``LogEntry.time`` (field 1, milliseconds), as logtkjs's ``LogMessage._time`` too."""
    pos = 0
    end = len(payload)
    while pos < end:
        key, pos = _pb_read_varint(payload, pos)  # always past at least one byte
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _pb_read_varint(payload, pos)
            if number == 1:
                return times.ms(value)
        elif wire == 2:
            n, pos = _pb_read_varint(payload, pos)  # n >= 0: never backwards
            pos += n
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            return 0
    return 0


def _bson_time_ns(doc: bytes, times: EventTimes) -> int:
    """The top-level ``$time``: a UTC datetime (logtkjs), or a number of milliseconds. Read
    with :mod:`.bsonwalk` (every length checked; logtkjs's UTF-16 string lengths taken)."""
    found = top_level_value(doc, b"$time")
    if found is None:
        return 0
    etype, pos = found
    if etype in (0x09, 0x12) and pos + 8 <= len(doc):
        return times.ms(_I64.unpack_from(doc, pos)[0])
    if etype == 0x10 and pos + 4 <= len(doc):
        return times.ms(_I32.unpack_from(doc, pos)[0])
    if etype == 0x01 and pos + 8 <= len(doc):
        return times.float_ms(_F64.unpack_from(doc, pos)[0])
    return 0


def _iso_ns(text: str, times: EventTimes) -> int:
    """RFC 3339 / ISO 8601 text (no zone: UTC); 0 when it is not a date-time."""
    ns = times.iso(text)
    return 0 if ns is None else ns


def _json_time_ns(payload: bytes, times: EventTimes) -> int:
    """The first of :data:`JSON_TIME_FIELDS` at the top level: a number (unit by size) or an
    ISO 8601 string. logtkjs's JavaScript-flavoured text gives its ``[Date: ...]``."""
    if _JSON_TIME_HINT.search(payload) is None:
        return 0  # entries without a time field never pay for a parse
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        match = _JS_DATE.search(payload)
        return _iso_ns(match.group(1).decode("ascii"), times) if match else 0
    if not isinstance(doc, dict):
        return 0
    for name in JSON_TIME_FIELDS:
        value = doc.get(name)
        if value is None or isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            return _number_ns(value, times)
        if isinstance(value, str):
            return _iso_ns(value, times)
        return 0
    return 0


TimeReader = Callable[[bytes, EventTimes], int]


def _never_raises(read: TimeReader) -> TimeReader:
    def safe(payload: bytes, times: EventTimes) -> int:
        try:
            return read(payload, times)
        except (ValueError, IndexError, OverflowError, struct.error):
            return 0

    return safe


_TIME_READERS: dict[str, TimeReader] = {
    "protobuf": _never_raises(_protobuf_time_ns),
    "bson": _never_raises(_bson_time_ns),
    "json": _never_raises(_json_time_ns),
}


def _no_time(payload: bytes, times: EventTimes) -> int:
    return 0


def time_reader(content_type: str) -> TimeReader:
    """The event-time reader of ``content_type``: ``(payload, times) -> ns`` since the epoch,
    or 0 (absent); a time the journal cannot hold is counted in ``times``."""
    return _TIME_READERS.get(content_type, _no_time)


register_decoder("protobuf", decode_log_entry)
register_decoder("bson", decode_bson_payload)
