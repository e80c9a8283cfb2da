"""Lager data formats: the ``BEERR01`` XML a tap registers, and rows encoded with it.

A tap describes one payload row as a ``<format version="BEERR01">`` element holding
``<item name type size offset>`` children (seed, "Data Formats"). This module parses and
validates that XML (and the ``<keg>`` XML at the end of a keg file), and turns rows -- the
payload frame of a data message, always network byte order -- into typed values and back.

Public, stable API (the Spark keg source and ``taproom keg`` use it):

* :func:`parse_format_xml` ``(text) -> DataFormat``
* :meth:`DataFormat.encode_row` ``(values) -> bytes``, :meth:`DataFormat.decode_row`
  ``(row) -> dict``, :meth:`DataFormat.decode_rows` ``(rows) -> dict[name, ndarray]``,
  :meth:`DataFormat.decode_buffer` for rows already back to back in one buffer
* :func:`parse_keg_xml` / :func:`keg_xml` for the keg trailer.

Rules enforced (each error names the item and the rule; see docs/protocols/lager.md):
required attributes, version at most 8 characters and a known version, known types (Lager
and C++ spellings), sizes that fit the type (a multiple of the element size makes a
fixed-length array), non-negative integer offsets, no overlap, nothing outside the row. The row
size is the sum of the item sizes, so the items tile the row exactly.

Pure code: no I/O, no clock (STYLE.md rule 1).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import struct
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import quoteattr

import numpy as np

from ...errors import ProtocolError

__all__ = [
    "CPP_SPELLING",
    "DEFAULT_MAX_ITEMS",
    "DEFAULT_MAX_XML_BYTES",
    "FORMAT_VERSION",
    "KNOWN_VERSIONS",
    "TYPES",
    "DataFormat",
    "FormatError",
    "Item",
    "LagerType",
    "keg_xml",
    "parse_format_xml",
    "parse_keg_xml",
]

# "BEERR01 must be a literal string value corresponding to this version of the XML schema."
FORMAT_VERSION = "BEERR01"
KNOWN_VERSIONS = frozenset({FORMAT_VERSION})
# The schema's LimitedString: maxLength 8.
MAX_VERSION_CHARS = 8
# A registration is one row description; 64 KiB holds ~1000 items and stops XML bombs early.
DEFAULT_MAX_XML_BYTES = 64 * 1024
DEFAULT_MAX_ITEMS = 1024
MAX_NAME_CHARS = 255


# What Xerces' DOMLSSerializer (nasa/lager's XML writer) puts first.
_DECLARATION = '<?xml version="1.0" encoding="UTF-8" standalone="no" ?>'


class FormatError(ProtocolError):
    """A data format (or a row against it) breaks a rule. ``reason`` is a bounded label."""


@dataclass(frozen=True, slots=True)
class LagerType:
    """One row of the seed's type table."""

    name: str  # the Lager spelling, as taproom writes it
    size: int  # bytes of one element; 0 for string (the item's size is its maximum)
    struct_code: str  # struct format letter ('s' for string)
    numpy_code: str  # numpy kind+size without byte order


_TABLE = (
    LagerType("bool", 1, "?", "b1"),
    LagerType("int8", 1, "b", "i1"),
    LagerType("int16", 2, "h", "i2"),
    LagerType("int32", 4, "i", "i4"),
    LagerType("int64", 8, "q", "i8"),
    LagerType("uint8", 1, "B", "u1"),
    LagerType("uint16", 2, "H", "u2"),
    LagerType("uint32", 4, "I", "u4"),
    LagerType("uint64", 8, "Q", "u8"),
    LagerType("float32", 4, "f", "f4"),
    LagerType("float64", 8, "d", "f8"),
    LagerType("string", 0, "s", "S"),
)
# The seed's table gives both columns ("Lager Type", "C++ Type"); the sample keg mixes them.
TYPES: dict[str, LagerType] = {t.name: t for t in _TABLE}
TYPES.update(
    {
        "int8_t": TYPES["int8"],
        "int16_t": TYPES["int16"],
        "int32_t": TYPES["int32"],
        "int64_t": TYPES["int64"],
        "uint8_t": TYPES["uint8"],
        "uint16_t": TYPES["uint16"],
        "uint32_t": TYPES["uint32"],
        "uint64_t": TYPES["uint64"],
        "float": TYPES["float32"],
        "double": TYPES["float64"],
        "std::string": TYPES["string"],
    }
)
# What taproom writes in a format's ``type`` attribute: nasa/lager's spellings (its Tap writes
# ``uint32_t``, ``float64``...; its keg reader lagr2hdf5.py knows only those). bool and string
# have no C++ counterpart there and keep the seed's names.
CPP_SPELLING = {
    "int8": "int8_t",
    "int16": "int16_t",
    "int32": "int32_t",
    "int64": "int64_t",
    "uint8": "uint8_t",
    "uint16": "uint16_t",
    "uint32": "uint32_t",
    "uint64": "uint64_t",
    "float32": "float32",
    "float64": "float64",
    "bool": "bool",
    "string": "string",
}
_ARRAY_TYPE = re.compile(r"^(?P<base>[A-Za-z_:0-9]+)\[(?P<count>[0-9]{1,9})\]$")
_FORBIDDEN = re.compile(rb"<!\s*(DOCTYPE|ENTITY)", re.IGNORECASE)
_INTEGER = re.compile(r"^\+?[0-9]{1,18}$")
_INT_RANGES = {
    "int8": (-(1 << 7), (1 << 7) - 1),
    "int16": (-(1 << 15), (1 << 15) - 1),
    "int32": (-(1 << 31), (1 << 31) - 1),
    "int64": (-(1 << 63), (1 << 63) - 1),
    "uint8": (0, (1 << 8) - 1),
    "uint16": (0, (1 << 16) - 1),
    "uint32": (0, (1 << 32) - 1),
    "uint64": (0, (1 << 64) - 1),
}


@dataclass(frozen=True, slots=True)
class Item:
    """One ``<item>``: ``count`` > 1 makes a fixed-length array; strings have ``count`` 1."""

    name: str
    type: LagerType
    size: int
    offset: int
    count: int = 1
    type_spelling: str = field(default="", compare=False)

    @property
    def is_array(self) -> bool:
        return self.type.name != "string" and self.count > 1

    @property
    def struct_code(self) -> str:
        if self.type.name == "string":
            return f"{self.size}s"
        return f"{self.count}{self.type.struct_code}" if self.count > 1 else self.type.struct_code

    def numpy_dtype(self) -> Any:
        if self.type.name == "string":
            return np.dtype(f"S{self.size}")
        base = np.dtype(">" + self.type.numpy_code) if self.type.size > 1 else self.type.numpy_code
        return (np.dtype(base), (self.count,)) if self.count > 1 else np.dtype(base)


def _fail(message: str, reason: str) -> FormatError:
    return FormatError(message, reason=reason)


def _int_attr(elem: ET.Element, attr: str, where: str) -> int:
    raw = elem.get(attr)
    if raw is None:
        raise _fail(f"{where}: missing required attribute {attr!r}", "missing_attribute")
    raw = raw.strip()
    if not _INTEGER.match(raw):
        reason = "bad_size" if attr == "size" else "bad_offset"
        raise _fail(f"{where}: {attr}={raw[:32]!r} is not a non-negative integer", reason)
    return int(raw)


def _parse_item(elem: ET.Element, index: int) -> Item:
    name = elem.get("name")
    where = f"item #{index}" if not name else f"item {name!r}"
    for attr in ("name", "type", "size", "offset"):
        if elem.get(attr) is None:
            raise _fail(f"{where}: missing required attribute {attr!r}", "missing_attribute")
    assert name is not None
    if not name.strip() or len(name) > MAX_NAME_CHARS:
        raise _fail(f"{where}: name must be 1..{MAX_NAME_CHARS} characters", "bad_name")
    spelling = (elem.get("type") or "").strip()
    count_from_type = None
    match = _ARRAY_TYPE.match(spelling)
    base_spelling = spelling
    if match:
        base_spelling = match["base"]
        count_from_type = int(match["count"])
    ltype = TYPES.get(base_spelling)
    if ltype is None:
        raise _fail(f"{where}: unknown type {spelling[:40]!r}", "unknown_type")
    size = _int_attr(elem, "size", where)
    offset = _int_attr(elem, "offset", where)
    if size == 0:
        raise _fail(f"{where}: size must be at least 1", "bad_size")
    if ltype.name == "string":
        if count_from_type is not None:
            raise _fail(f"{where}: arrays of strings are not supported", "unknown_type")
        return Item(name, ltype, size, offset, 1, spelling)
    if size % ltype.size:
        raise _fail(
            f"{where}: size {size} is not a multiple of {ltype.name}'s {ltype.size} bytes",
            "bad_size",
        )
    count = size // ltype.size
    if count_from_type is not None and count_from_type != count:
        raise _fail(
            f"{where}: type {spelling!r} needs size {count_from_type * ltype.size}, not {size}",
            "bad_size",
        )
    return Item(name, ltype, size, offset, count, spelling)


def _check_xml(text: str | bytes, max_bytes: int) -> bytes:
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    if len(raw) > max_bytes:
        raise _fail(f"format XML is {len(raw)} bytes, at most {max_bytes}", "xml_too_large")
    # No DTDs at all: they are the door to entity expansion (billion laughs) and external fetches.
    if _FORBIDDEN.search(raw):
        raise _fail("format XML must not contain a DOCTYPE or ENTITY declaration", "xml_forbidden")
    return raw


def _parse_root(raw: bytes) -> ET.Element:
    try:
        return ET.fromstring(raw)
    except ET.ParseError as exc:
        raise _fail(f"format XML does not parse: {exc}", "xml_malformed") from None
    except (ValueError, LookupError) as exc:  # unknown encoding declarations and the like
        raise _fail(f"format XML does not parse: {exc}", "xml_malformed") from None


def _format_from_element(elem: ET.Element, max_items: int, *, keg: bool) -> DataFormat:
    version = elem.get("version")
    if version is None:
        raise _fail("format: missing required attribute 'version'", "missing_attribute")
    if len(version) > MAX_VERSION_CHARS:
        raise _fail(
            f"format: version {version[:16]!r} is longer than {MAX_VERSION_CHARS} characters",
            "bad_version",
        )
    if version not in KNOWN_VERSIONS:
        raise _fail(
            f"format: version {version!r} is not one taproom knows ({FORMAT_VERSION})",
            "bad_version",
        )
    uuid = elem.get("uuid")
    if keg and uuid is None:
        raise _fail("format: missing required attribute 'uuid'", "missing_attribute")
    # nasa/lager's schema requires a key (the tap's key) on <format>; the seed's has none.
    key = elem.get("key") or ""
    children = list(elem)
    if not children:
        raise _fail("format: needs at least one item", "no_items")
    if len(children) > max_items:
        raise _fail(f"format: {len(children)} items, at most {max_items}", "too_many_items")
    items = []
    for index, child in enumerate(children):
        if child.tag != "item":
            raise _fail(f"format: unexpected element <{child.tag[:32]}>", "bad_element")
        items.append(_parse_item(child, index))
    return DataFormat.from_items(items, version=version, uuid=uuid or "", key=key)


def parse_format_xml(
    text: str | bytes,
    *,
    max_bytes: int = DEFAULT_MAX_XML_BYTES,
    max_items: int = DEFAULT_MAX_ITEMS,
) -> DataFormat:
    """Parse and validate a registration's ``<format>`` XML. Raises :class:`FormatError`."""
    raw = _check_xml(text, max_bytes)
    return _parse_format_cached(raw, max_items)


# Fleets register many taps with the same format: parse each distinct XML once. DataFormat is
# immutable, so sharing is safe; errors are not cached (lru_cache does not keep exceptions).
@functools.lru_cache(maxsize=256)  # worst case 256 x max_bytes of keys
def _parse_format_cached(raw: bytes, max_items: int) -> DataFormat:
    root = _parse_root(raw)
    if root.tag != "format":
        raise _fail(f"root element is <{root.tag[:32]}>, expected <format>", "bad_root")
    return _format_from_element(root, max_items, keg=False)


def parse_keg_xml(
    text: str | bytes, *, max_bytes: int = 64 * 1024 * 1024, max_items: int = DEFAULT_MAX_ITEMS
) -> tuple[dict[str, DataFormat], dict[str, str]]:
    """The ``<keg>`` trailer: formats by uuid string and the metadata key/values."""
    raw = _check_xml(text, max_bytes)
    root = _parse_root(raw)
    if root.tag != "keg":
        raise _fail(f"root element is <{root.tag[:32]}>, expected <keg>", "bad_root")
    formats_elem = root.find("formats")
    if formats_elem is None:
        raise _fail("keg: missing <formats>", "no_items")
    formats: dict[str, DataFormat] = {}
    for elem in formats_elem:
        if elem.tag != "format":
            raise _fail(f"keg: unexpected element <{elem.tag[:32]}>", "bad_element")
        fmt = _format_from_element(elem, max_items, keg=True)
        formats[fmt.uuid.lower()] = fmt
    metadata: dict[str, str] = {}
    meta_elem = root.find("metadata")
    if meta_elem is not None:
        for meta in meta_elem:
            key, value = meta.get("key"), meta.get("value")
            if meta.tag != "meta" or key is None or value is None:
                raise _fail("keg: <meta> needs key and value", "missing_attribute")
            metadata[key] = value
    return formats, metadata


def keg_xml(formats: Mapping[str, DataFormat], metadata: Mapping[str, str] | None = None) -> str:
    """The ``<keg>`` XML for a keg trailer or sidecar (uuid strings -> formats), valid against
    nasa/lager's keg_schema.xsd: every ``<format>`` has ``key``, ``uuid`` and ``version``. A
    format that came without a key is named by its uuid."""
    lines = [_DECLARATION, "<keg>", "    <formats>"]
    for uuid, fmt in formats.items():
        lines.append(f"        {fmt._format_open(fmt.key or uuid, uuid)}")
        lines.extend(f"            {item}" for item in fmt._item_lines())
        lines.append("        </format>")
    lines.append("    </formats>")
    if metadata:
        lines.append("    <metadata>")
        lines.extend(
            f"        <meta key={quoteattr(k)} value={quoteattr(v)}/>" for k, v in metadata.items()
        )
        lines.append("    </metadata>")
    lines.append("</keg>")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True)
class DataFormat:
    """A validated row layout. Build with :func:`parse_format_xml` or :meth:`from_items`."""

    items: tuple[Item, ...]
    version: str = FORMAT_VERSION
    uuid: str = ""
    row_size: int = 0
    key: str = ""  # the tap key in nasa/lager's <format key=...>; "" when the XML had none
    _struct: struct.Struct = field(default=struct.Struct(">"), repr=False, compare=False)
    _dtype: Any = field(default=None, repr=False, compare=False)
    _simple: bool = field(default=True, repr=False, compare=False)

    @classmethod
    def from_items(
        cls,
        items: Sequence[Item],
        *,
        version: str = FORMAT_VERSION,
        uuid: str = "",
        key: str = "",
    ) -> DataFormat:
        """Validate names, offsets and sizes of ``items`` and build the codecs."""
        if not items:
            raise _fail("format: needs at least one item", "no_items")
        seen: set[str] = set()
        for item in items:
            if item.name in seen:
                raise _fail(f"item {item.name!r}: name used twice", "duplicate_name")
            seen.add(item.name)
        row_size = sum(item.size for item in items)
        ordered = sorted(items, key=lambda i: i.offset)
        end = 0
        previous: Item | None = None
        for item in ordered:
            if item.offset + item.size > row_size:
                raise _fail(
                    f"item {item.name!r}: offset {item.offset} + size {item.size} leaves the "
                    f"{row_size}-byte row",
                    "outside_row",
                )
            if previous is not None and item.offset < end:
                raise _fail(
                    f"item {item.name!r}: offset {item.offset} overlaps item {previous.name!r} "
                    f"(ends at {end})",
                    "overlap",
                )
            end = item.offset + item.size
            previous = item
        code = ">" + "".join(item.struct_code for item in ordered)
        dtype = np.dtype(
            {
                "names": [i.name for i in items],
                "formats": [i.numpy_dtype() for i in items],
                "offsets": [i.offset for i in items],
                "itemsize": row_size,
            }
        )
        simple = all(i.count == 1 and i.type.name != "string" for i in ordered)
        return cls(tuple(ordered), version, uuid, row_size, key, struct.Struct(code), dtype, simple)

    # --- XML -------------------------------------------------------------------------------

    def _item_lines(self) -> list[str]:
        return [
            f'<item name={quoteattr(i.name)} offset="{i.offset}" size="{i.size}" '
            f"type={quoteattr(CPP_SPELLING[i.type.name])}/>"
            for i in self.items
        ]

    def _format_open(self, key: str, uuid: str = "") -> str:
        """``<format>`` with its attributes in the order Xerces writes them (by name)."""
        uuid_attr = f" uuid={quoteattr(uuid)}" if uuid else ""
        return f"<format key={quoteattr(key)}{uuid_attr} version={quoteattr(self.version)}>"

    def with_key(self, key: str) -> DataFormat:
        """The same format naming tap ``key`` (what ``to_xml`` and kegs write)."""
        return dataclasses.replace(self, key=key)

    def to_xml(self, key: str | None = None) -> str:
        """The registration value frame, as nasa/lager's Tap writes it (valid against its
        data_format.xsd): ``<format key version>`` and ``<item name offset size type>`` with
        C++ type names, on one line. ``key`` defaults to :attr:`key`."""
        items = "".join(self._item_lines())
        return (
            f"{_DECLARATION}{self._format_open(self.key if key is None else key)}{items}</format>"
        )

    @property
    def names(self) -> list[str]:
        return [i.name for i in self.items]

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """Structured big-endian dtype of one row (field offsets as registered)."""
        return self._dtype

    # --- one row ---------------------------------------------------------------------------

    def encode_row(self, values: Mapping[str, Any]) -> bytes:
        """One payload row in network byte order. Every item must be given."""
        flat: list[Any] = []
        for item in self.items:
            try:
                value = values[item.name]
            except KeyError:
                raise _fail(f"item {item.name!r}: no value given", "missing_value") from None
            tname = item.type.name
            if tname == "string":
                raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
                if len(raw) > item.size:
                    raise _fail(
                        f"item {item.name!r}: {len(raw)} bytes, the format allows {item.size}",
                        "value_too_long",
                    )
                flat.append(raw)
            elif item.count > 1:
                seq = list(value)
                if len(seq) != item.count:
                    raise _fail(
                        f"item {item.name!r}: {len(seq)} elements, the format has {item.count}",
                        "bad_value",
                    )
                flat.extend(seq)
            else:
                flat.append(value)
        try:
            return self._struct.pack(*flat)
        except (struct.error, TypeError, OverflowError) as exc:
            raise _fail(f"row does not fit the format: {exc}", "bad_value") from None

    def decode_row(self, row: bytes | memoryview) -> dict[str, Any]:
        """Typed values of one row: ints, floats, bools, str, and tuples for arrays."""
        if len(row) != self.row_size:
            raise _fail(
                f"row is {len(row)} bytes, the format needs {self.row_size}", "payload_size"
            )
        values = self._struct.unpack(row)
        if self._simple:
            return dict(zip([i.name for i in self.items], values, strict=True))
        out: dict[str, Any] = {}
        pos = 0
        for item in self.items:
            if item.type.name == "string":
                out[item.name] = values[pos].rstrip(b"\0").decode("utf-8", "replace")
                pos += 1
            elif item.count > 1:
                out[item.name] = values[pos : pos + item.count]
                pos += item.count
            else:
                out[item.name] = values[pos]
                pos += 1
        return out

    # --- many rows -------------------------------------------------------------------------

    def decode_rows(self, rows: Iterable[bytes]) -> dict[str, np.ndarray[Any, Any]]:
        """Columns for many rows (vectorised): item name -> native-endian numpy array."""
        rows = list(rows)
        for row in rows:
            if len(row) != self.row_size:
                raise _fail(
                    f"row is {len(row)} bytes, the format needs {self.row_size}", "payload_size"
                )
        return self.decode_buffer(b"".join(rows))

    def decode_buffer(self, buffer: bytes | memoryview) -> dict[str, np.ndarray[Any, Any]]:
        """Columns for rows stored back to back in ``buffer`` (``len % row_size == 0``)."""
        if len(buffer) % self.row_size:
            raise _fail(
                f"buffer of {len(buffer)} bytes is not whole {self.row_size}-byte rows",
                "payload_size",
            )
        table = np.frombuffer(buffer, dtype=self._dtype)
        return self.columns(table)

    def columns(self, table: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
        """Native-endian columns of a structured array with this format's dtype."""
        out: dict[str, np.ndarray[Any, Any]] = {}
        for item in self.items:
            column = table[item.name]
            if item.type.name == "string":
                out[item.name] = np.char.decode(np.char.rstrip(column, b"\0"), "utf-8", "replace")
            else:
                out[item.name] = column.astype(column.dtype.newbyteorder("="), copy=True)
        return out


def check_value_range(item: Item, value: int) -> bool:
    """Whether an integer fits ``item``'s type (used by property tests and the Tap)."""
    low, high = _INT_RANGES[item.type.name]
    return low <= value <= high
