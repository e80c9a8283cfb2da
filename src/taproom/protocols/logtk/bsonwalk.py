"""BSON as producers really write it, read without trusting a single length.

Two readers share one element walker:

* :func:`top_level_value` finds one top-level element (the ack path's ``$time``) without
  decoding anything else;
* :func:`decode_lenient` decodes a whole document for ``taproom tail`` when pymongo's strict
  decoder refuses it.

**Progress by construction.** Every loop here moves its position forward: an element costs at
least its type byte and its name's NUL, and the end of its value is computed from a length that
is checked against the type's minimum and against the end of the enclosing document before the
position moves (:func:`value_end` never returns a position before the value's start, nor past
the document). A negative, short or overlong length is :class:`BsonError`, never a jump
backwards (issue 25: a string length of -7 sent the old walker back to the same element forever,
on the event loop). Nesting is bounded (:data:`MAX_DEPTH`).

**logtkjs's strings.** logtkjs writes a string's length prefix as JavaScript's ``str.length +
1``: UTF-16 code units, not UTF-8 bytes (its ``lib/format.js``), so any non-ASCII text makes
the document invalid BSON. Where a declared string length does not end on the string's NUL, the
walker takes the text up to the next NUL and accepts it when that text is exactly ``length - 1``
UTF-16 code units long: the document is read as logtkjs meant it (docs/compat.md). Anything else
that does not add up is refused.
"""

from __future__ import annotations

import datetime
import struct

__all__ = ["MAX_DEPTH", "BsonError", "decode_lenient", "top_level_value", "value_end"]

MAX_DEPTH = 64  # nested documents and arrays; deeper is refused (pymongo's limit is similar)

_I32 = struct.Struct("<i")
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_U32X2 = struct.Struct("<II")

# Element value sizes by type that need no length: double, undefined, ObjectId, bool, UTC
# datetime, null, int32, timestamp, int64, decimal128, min key, max key.
FIXED_SIZES = {
    0x01: 8,
    0x06: 0,
    0x07: 12,
    0x08: 1,
    0x09: 8,
    0x0A: 0,
    0x10: 4,
    0x11: 8,
    0x12: 8,
    0x13: 16,
    0x7F: 0,
    0xFF: 0,
}
_STRINGS = (0x02, 0x0D, 0x0E)  # string, JavaScript code, symbol: int32 length, bytes, NUL
_DOCUMENTS = (0x03, 0x04)  # document, array: int32 length (inclusive), elements, NUL


class BsonError(ValueError):
    """A document that cannot be read, even leniently."""


def _i32(doc: bytes, pos: int, end: int) -> int:
    if pos + 4 > end:
        raise BsonError("length runs past the document")
    return int(_I32.unpack_from(doc, pos)[0])


def string_end(doc: bytes, pos: int, end: int) -> tuple[int, int]:
    """A BSON string's text bounds at ``pos`` (its int32 length): ``(text_end, value_end)``,
    ``text_end`` at its NUL. Accepts logtkjs's UTF-16 code unit lengths (module doc)."""
    length = _i32(doc, pos, end)
    if length < 1:
        raise BsonError(f"string length {length}")
    start = pos + 4
    strict = start + length
    if strict <= end and doc[strict - 1] == 0:
        return strict - 1, strict
    # logtkjs: length = UTF-16 code units + 1, and UTF-8 never has fewer bytes than UTF-16 has
    # code units, so the NUL is at or after where the length says.
    nul = doc.find(b"\x00", start + length - 1, end)
    if nul < 0:
        raise BsonError("string without its NUL")
    try:
        text = doc[start:nul].decode("utf-8")
    except UnicodeDecodeError:
        raise BsonError("string is not UTF-8") from None
    if len(text.encode("utf-16-le")) // 2 + 1 != length:
        raise BsonError("string length matches neither bytes nor UTF-16 code units")
    return nul, nul + 1


def _cstring_end(doc: bytes, pos: int, end: int) -> int:
    nul = doc.find(b"\x00", pos, end)
    if nul < 0:
        raise BsonError("name or cstring without its NUL")
    return nul


def value_end(doc: bytes, etype: int, pos: int, end: int) -> int:
    """Where the value of an element of type ``etype`` starting at ``pos`` ends, checked to lie
    in ``[pos, end]`` (a size-0 value ends where it starts; the element's type byte and name
    already moved the walk forward)."""
    size = FIXED_SIZES.get(etype)
    if size is not None:
        stop = pos + size
    elif etype in _STRINGS:
        stop = string_end(doc, pos, end)[1]
    elif etype in _DOCUMENTS:
        length = _i32(doc, pos, end)
        if length < 5:
            raise BsonError(f"document length {length}")
        stop = pos + length
    elif etype == 0x05:  # binary: int32 length, subtype, bytes
        length = _i32(doc, pos, end)
        if length < 0:
            raise BsonError(f"binary length {length}")
        stop = pos + 5 + length
    elif etype == 0x0B:  # regular expression: two cstrings
        stop = _cstring_end(doc, _cstring_end(doc, pos, end) + 1, end) + 1
    elif etype == 0x0C:  # DBPointer: string, 12-byte ObjectId
        stop = string_end(doc, pos, end)[1] + 12
    elif etype == 0x0F:  # code with scope: int32 length (inclusive), string, document
        length = _i32(doc, pos, end)
        if length < 14:
            raise BsonError(f"code with scope length {length}")
        stop = pos + length
    else:
        raise BsonError(f"unknown element type {etype:#04x}")
    if stop > end:
        raise BsonError("element runs past the document")
    return stop


def _document_bounds(doc: bytes, pos: int, end: int) -> int:
    """The position of the terminating NUL of the document at ``pos`` (checked)."""
    length = _i32(doc, pos, end)
    if length < 5 or pos + length > end:
        raise BsonError(f"document length {length}")
    last = pos + length - 1
    if doc[last] != 0:
        raise BsonError("document does not end with NUL")
    return last


def top_level_value(doc: bytes, name: bytes) -> tuple[int, int] | None:
    """``(type, value position)`` of the top-level element ``name``, or None when the document
    has none. Raises :class:`BsonError` for a document it cannot walk up to that element."""
    end = _document_bounds(doc, 0, len(doc))
    pos = 4
    while pos < end:
        etype = doc[pos]
        nul = _cstring_end(doc, pos + 1, end)
        value = nul + 1
        if doc[pos + 1 : nul] == name:
            return etype, value
        pos = value_end(doc, etype, value, end)  # >= value > pos
    return None


def decode_lenient(doc: bytes) -> dict[str, object]:
    """The whole document as Python values (datetimes aware UTC; binary as bytes; ObjectId,
    decimal128, regex, code and the rest as text), reading logtkjs's strings as it meant them.
    Raises :class:`BsonError`."""
    end = _document_bounds(doc, 0, len(doc))
    if end != len(doc) - 1:
        raise BsonError("bytes after the document")
    result = _elements(doc, 4, end, 0)
    assert isinstance(result, dict)
    return result


def _elements(doc: bytes, pos: int, end: int, depth: int, array: bool = False) -> object:
    if depth > MAX_DEPTH:
        raise BsonError(f"nested deeper than {MAX_DEPTH}")
    items: list[tuple[str, object]] = []
    while pos < end:
        etype = doc[pos]
        nul = _cstring_end(doc, pos + 1, end)
        name = doc[pos + 1 : nul].decode("utf-8", "replace")
        value_at = nul + 1
        stop = value_end(doc, etype, value_at, end)
        items.append((name, _value(doc, etype, value_at, stop, depth)))
        pos = stop  # > the element's start: its type byte and name NUL at least
    if pos != end:
        raise BsonError("elements overrun the document")
    if array:
        return [value for _name, value in items]
    return dict(items)


def _value(doc: bytes, etype: int, pos: int, stop: int, depth: int) -> object:
    if etype == 0x01:
        return float(_F64.unpack_from(doc, pos)[0])
    if etype in _STRINGS:
        text_end = string_end(doc, pos, stop)[0]
        return doc[pos + 4 : text_end].decode("utf-8", "replace")
    if etype in _DOCUMENTS:
        last = _document_bounds(doc, pos, stop)
        return _elements(doc, pos + 4, last, depth + 1, array=etype == 0x04)
    if etype == 0x05:
        return bytes(doc[pos + 5 : stop])
    if etype in (0x06, 0x0A):
        return None
    if etype == 0x07:
        return doc[pos : pos + 12].hex()
    if etype == 0x08:
        return doc[pos] != 0
    if etype == 0x09:
        ms = int(_I64.unpack_from(doc, pos)[0])
        try:
            return datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(
                milliseconds=ms
            )
        except OverflowError:
            return ms  # outside Python's dates: the milliseconds, as pymongo's DatetimeMS
    if etype == 0x0B:
        pattern_end = _cstring_end(doc, pos, stop)
        pattern = doc[pos:pattern_end].decode("utf-8", "replace")
        flags = doc[pattern_end + 1 : stop - 1].decode("utf-8", "replace")
        return f"/{pattern}/{flags}"
    if etype == 0x0C:
        text_end, id_at = string_end(doc, pos, stop)
        return f"{doc[pos + 4 : text_end].decode('utf-8', 'replace')}:{doc[id_at:stop].hex()}"
    if etype == 0x0F:
        code_end, scope_at = string_end(doc, pos + 4, stop)
        last = _document_bounds(doc, scope_at, stop)
        return {
            "$code": doc[pos + 8 : code_end].decode("utf-8", "replace"),
            "$scope": _elements(doc, scope_at + 4, last, depth + 1),
        }
    if etype == 0x10:
        return int(_I32.unpack_from(doc, pos)[0])
    if etype == 0x11:
        increment, seconds = _U32X2.unpack_from(doc, pos)
        return {"t": seconds, "i": increment}
    if etype == 0x12:
        return int(_I64.unpack_from(doc, pos)[0])
    if etype == 0x13:
        return "decimal128:" + doc[pos : pos + 16].hex()
    if etype == 0x7F:
        return "$maxKey"
    return "$minKey"  # 0xFF, the last type value_end accepts
