"""The payload formats LogTK carries: decoded off the ack path, and their event time.

``protobuf`` is taproom's ``LogEntry`` (``logtk_entry.proto`` next to this module), ``bson`` the
reference client's documents. Both decoders register with :mod:`taproom.payloads`.
:func:`time_reader` gives the ack path a cheap reader of each format's time field, for the
records' ``ts_ns``.
"""

from __future__ import annotations

import datetime
import re
import struct
from collections.abc import Callable, Mapping

import orjson

from ...payloads import json_ready, register_decoder

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
    """A BSON document (the reference client's ``$level``/``$message``/... records)."""
    import bson  # from pymongo; imported here so the wire path never pays for it

    # Dates as aware UTC datetimes (printed with their zone); one outside Python's range stays
    # a DatetimeMS (printed as such) instead of failing the whole document.
    options: bson.CodecOptions[dict[str, object]] = bson.CodecOptions(
        tz_aware=True, datetime_conversion=bson.DatetimeConversion.DATETIME_AUTO
    )
    return json_ready(bson.decode(payload, codec_options=options))


# --- event time -----------------------------------------------------------------------------
# Each reader returns nanoseconds since the epoch (UTC), or 0 when the entry carries no time it
# can read: a missing or malformed time never costs the entry, it only leaves ts_ns unset.

# Top-level JSON fields read as the entry's time, first found wins: logtkjs's own name first,
# then the names loggers commonly use.
JSON_TIME_FIELDS = ("$time", "time", "timestamp", "@timestamp", "ts")
_JSON_TIME_HINT = re.compile(rb'"(?:\$time|time|timestamp|@timestamp|ts)"')
# logtkjs's "json" format is JavaScript-flavoured text, not JSON: "$time": [Date: <ISO>Z]
_JS_DATE = re.compile(rb'"\$time"\s*:\s*\[Date: ([0-9T:.+\-Z]{10,40})\]')
_MAX_NS = (1 << 63) - 1  # the record's ts_ns is an i64
_I64 = struct.Struct("<q")
_I32 = struct.Struct("<i")
_F64 = struct.Struct("<d")


def _checked(ns: int) -> int:
    return ns if 0 < ns <= _MAX_NS else 0


def _number_ns(value: int | float) -> int:
    """A number's unit from its size: seconds, milliseconds, microseconds or nanoseconds
    since the epoch (each reading covers the years 1973-5138)."""
    size = abs(value)
    scale = 1 if size >= 1e17 else 1_000 if size >= 1e14 else 10**6 if size >= 1e11 else 10**9
    if isinstance(value, int):
        return _checked(value * scale)
    # A double holds ~16 digits: keep microseconds, not float noise in the nanoseconds.
    return _checked(round(value * scale / 1_000) * 1_000 if scale >= 1_000 else round(value))


def _iso_ns(text: str) -> int:
    """RFC 3339 / ISO 8601 text; without a zone it is UTC."""
    when = datetime.datetime.fromisoformat(text)
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    delta = when - datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
    return _checked((delta.days * 86_400 + delta.seconds) * 10**9 + delta.microseconds * 1_000)


def _protobuf_time_ns(payload: bytes) -> int:
    """``LogEntry.time`` (field 1, milliseconds), as logtkjs's ``LogMessage._time`` too."""
    pos = 0
    end = len(payload)
    while pos < end:
        key, pos = _pb_read_varint(payload, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _pb_read_varint(payload, pos)
            if number == 1:
                return _checked(value * 1_000_000)
        elif wire == 2:
            n, pos = _pb_read_varint(payload, pos)
            pos += n
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            return 0
    return 0


# BSON element sizes after the name, by type: fixed ones, and those with a length prefix.
_BSON_FIXED = {0x01: 8, 0x06: 0, 0x07: 12, 0x08: 1, 0x09: 8, 0x0A: 0, 0x10: 4, 0x11: 8}
_BSON_FIXED |= {0x12: 8, 0x13: 16, 0x7F: 0, 0xFF: 0}


def _bson_time_ns(doc: bytes) -> int:
    """The top-level ``$time``: a UTC datetime (logtkjs), or a number of milliseconds."""
    end = min(len(doc), _I32.unpack_from(doc)[0]) - 1
    pos = 4
    while pos < end:
        etype = doc[pos]
        nul = doc.index(b"\x00", pos + 1, end)
        name = doc[pos + 1 : nul]
        pos = nul + 1
        if name == b"$time":
            if etype in (0x09, 0x12):
                return _checked(_I64.unpack_from(doc, pos)[0] * 1_000_000)
            if etype == 0x10:
                return _checked(_I32.unpack_from(doc, pos)[0] * 1_000_000)
            if etype == 0x01:
                return _checked(int(_F64.unpack_from(doc, pos)[0] * 1_000_000))
            return 0
        size = _BSON_FIXED.get(etype)
        if size is not None:
            pos += size
        elif etype in (0x02, 0x0D, 0x0E):  # string, code, symbol: int32 length + bytes
            pos += 4 + _I32.unpack_from(doc, pos)[0]
        elif etype in (0x03, 0x04, 0x0F):  # document, array, code with scope: length inclusive
            pos += _I32.unpack_from(doc, pos)[0]
        elif etype == 0x05:  # binary: length, subtype, bytes
            pos += 5 + _I32.unpack_from(doc, pos)[0]
        elif etype == 0x0B:  # regex: two cstrings
            pos = doc.index(b"\x00", doc.index(b"\x00", pos, end) + 1, end) + 1
        elif etype == 0x0C:  # DBPointer: string + 12-byte id
            pos += 16 + _I32.unpack_from(doc, pos)[0]
        else:
            return 0
    return 0


def _json_time_ns(payload: bytes) -> int:
    """The first of :data:`JSON_TIME_FIELDS` at the top level: a number (unit by size) or an
    ISO 8601 string. logtkjs's JavaScript-flavoured text gives its ``[Date: ...]``."""
    if _JSON_TIME_HINT.search(payload) is None:
        return 0  # entries without a time field never pay for a parse
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        match = _JS_DATE.search(payload)
        return _iso_ns(match.group(1).decode("ascii")) if match else 0
    if not isinstance(doc, dict):
        return 0
    for name in JSON_TIME_FIELDS:
        value = doc.get(name)
        if value is None or isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            return _number_ns(value)
        if isinstance(value, str):
            return _iso_ns(value)
        return 0
    return 0


def _never_raises(read: Callable[[bytes], int]) -> Callable[[bytes], int]:
    def safe(payload: bytes) -> int:
        try:
            return read(payload)
        except (ValueError, IndexError, OverflowError, struct.error):
            return 0

    return safe


_TIME_READERS = {
    "protobuf": _never_raises(_protobuf_time_ns),
    "bson": _never_raises(_bson_time_ns),
    "json": _never_raises(_json_time_ns),
}


def _no_time(payload: bytes) -> int:
    return 0


def time_reader(content_type: str) -> Callable[[bytes], int]:
    """The event-time reader of ``content_type``: payload -> ns since the epoch, or 0."""
    return _TIME_READERS.get(content_type, _no_time)


register_decoder("protobuf", decode_log_entry)
register_decoder("bson", decode_bson_payload)
