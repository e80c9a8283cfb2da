"""The payload formats LogTK carries, decoded off the ack path.

``protobuf`` is taproom's ``LogEntry`` (``logtk_entry.proto`` next to this module), ``bson`` the
reference client's documents. Both decoders register with :mod:`taproom.payloads`.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...payloads import json_ready, register_decoder

__all__ = [
    "decode_bson_payload",
    "decode_log_entry",
    "encode_log_entry",
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


register_decoder("protobuf", decode_log_entry)
register_decoder("bson", decode_bson_payload)
