"""Test peers that behave as nasa/lager's C++ programs do, read from its source (src/ of
github.com/nasa/lager): no C++ peer is available here, so these keep its observable rules.

* :class:`NasaChpClient` -- ClusteredHashmapClient's subscriber: the sequence frame is a
  host-order double; an update is applied only if its sequence is larger than the last message's
  (HUGZ included: the client stores every message's sequence).
* :func:`check_format_xml`, :func:`check_keg_xml` -- what Xerces enforces with nasa/lager's
  share/data_format.xsd and share/keg_schema.xsd (the rules written out here; the XSD files are
  not copied): exact element names and nesting, required attributes, no undeclared ones, the
  ``LimitedString`` version (at most 8 characters) and ``PositiveInteger`` size/offset.
* :func:`write_unfinished_keg` -- what nasa/lager's Keg leaves when its process dies: a zero
  header (version and offset), the records, and a ``.lgr.format`` sidecar to which it appended
  the whole ``<keg>`` document each time it learnt a format.
* :func:`read_keg_like_lagr2hdf5` -- the rules of nasa/lager's scripts/lagr2hdf5.py (header,
  XML from dataFormatOffset to the end, formats with uuid/version/key, items by C++ type name,
  the record walk), without h5py.
"""

from __future__ import annotations

import binascii
import re
import struct
import uuid as uuid_module
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from pathlib import Path

import zmq
import zmq.asyncio

__all__ = [
    "NasaChpClient",
    "XsdError",
    "check_format_xml",
    "check_keg_xml",
    "read_keg_like_lagr2hdf5",
    "write_unfinished_keg",
]

_DOUBLE = struct.Struct("=d")


class NasaChpClient:
    """The subscriber thread of nasa/lager's ClusteredHashmapClient, as an asyncio socket."""

    def __init__(self, ctx: zmq.asyncio.Context, publisher: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 1)  # as the C++: "so messages don't stack up"
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(publisher)
        self.sequence = -1.0
        self.hash_map: dict[bytes, bytes] = {}
        self.uuid_map: dict[bytes, bytes] = {}
        self.applied: list[bytes] = []

    async def handle_one(self, timeout: float) -> bool:
        """Read one message if one comes within ``timeout`` seconds; False otherwise."""
        if not await self.sub.poll(int(timeout * 1000)):
            return False
        key, seq, uuid, _empty, value = (await self.sub.recv_multipart())[:5]
        sequence = _DOUBLE.unpack(seq)[0]  # *(double*)msg.data()
        if key != b"HUGZ" and sequence > self.sequence:
            if value:
                self.hash_map[key] = value
                self.uuid_map[uuid] = key
                self.applied.append(key)
            else:
                self.hash_map.pop(key, None)
        self.sequence = sequence
        return True

    def close(self) -> None:
        self.sub.close(linger=0)


class XsdError(ValueError):
    """What Xerces reports for a document its schema refuses ("error in xml: ...")."""


# xs:integer after whitespace collapse; PositiveInteger adds minInclusive 0.
_XS_INTEGER = re.compile(r"^[+-]?[0-9]+$")


def _attributes(elem: ET.Element, required: tuple[str, ...]) -> None:
    for name in required:
        if name not in elem.attrib:
            raise XsdError(f"missing required attribute '{name}' in <{elem.tag}>")
    for name in elem.attrib:
        if name not in required:  # no xs:anyAttribute anywhere in the schemas
            raise XsdError(f"attribute '{name}' is not declared for element '{elem.tag}'")


def _element_only(elem: ET.Element) -> None:
    """Complex types without mixed content: only whitespace between child elements."""
    if (elem.text or "").strip():
        raise XsdError(f"text is not allowed in <{elem.tag}>")
    for child in elem:
        if (child.tail or "").strip():
            raise XsdError(f"text is not allowed in <{elem.tag}>")


def _children(elem: ET.Element, tag: str) -> list[ET.Element]:
    _element_only(elem)
    children = list(elem)
    if not children:
        raise XsdError(f"<{elem.tag}> needs at least one <{tag}>")
    for child in children:
        if child.tag != tag:
            raise XsdError(f"element '{child.tag}' is not allowed in <{elem.tag}>")
    return children


def _item(elem: ET.Element) -> None:
    _attributes(elem, ("name", "type", "size", "offset"))
    _element_only(elem)
    if len(elem):
        raise XsdError("<item> is empty by the schema")
    for name in ("size", "offset"):
        raw = " ".join(elem.attrib[name].split())
        if not _XS_INTEGER.match(raw) or int(raw) < 0:
            raise XsdError(f"value '{raw}' of attribute '{name}' is not a PositiveInteger")


def _format(elem: ET.Element, required: tuple[str, ...]) -> None:
    if elem.tag != "format":
        raise XsdError(f"no declaration found for element '{elem.tag}'")
    _attributes(elem, required)
    if len(elem.attrib["version"]) > 8:
        raise XsdError("value of attribute 'version' is longer than 8 (LimitedString)")
    for item in _children(elem, "item"):
        _item(item)


def _parse(text: str | bytes) -> ET.Element:
    raw = text.encode() if isinstance(text, str) else text
    if b"<!DOCTYPE" in raw or b"<!ENTITY" in raw:
        raise XsdError("no DTDs here")
    try:
        return ET.fromstring(raw)
    except ET.ParseError as exc:
        raise XsdError(f"not well-formed: {exc}") from None


def check_format_xml(text: str | bytes) -> None:
    """A registration value as nasa/lager's Mug parses it (data_format.xsd, Val_Always)."""
    _format(_parse(text), ("version", "key"))


def check_keg_xml(text: str | bytes) -> None:
    """A keg trailer or sidecar document as keg_schema.xsd describes it."""
    root = _parse(text)
    if root.tag != "keg":
        raise XsdError(f"no declaration found for element '{root.tag}'")
    _element_only(root)
    children = list(root)
    if not children or children[0].tag != "formats":
        raise XsdError("<keg> starts with exactly one <formats>")
    if len(children) > 2 or (len(children) == 2 and children[1].tag != "metadata"):
        raise XsdError("<keg> holds <formats> and at most one <metadata>")
    for fmt in _children(children[0], "format"):
        _format(fmt, ("version", "uuid", "key"))
    if len(children) == 2:
        for meta in _children(children[1], "meta"):
            _attributes(meta, ("key", "value"))
            _element_only(meta)


def _xerces_keg(formats: Mapping[str, tuple[str, str]]) -> str:
    """createFromUuidMap's document: the format elements of each registration (key and
    version as the tap wrote them) get the uuid string; Xerces sorts attributes by name."""
    parts = ['<?xml version="1.0" encoding="UTF-8" standalone="no" ?><keg><formats>']
    for uuid_text, (key, items_xml) in formats.items():
        parts.append(
            f'<format key="{key}" uuid="{uuid_text}" version="BEERR01">{items_xml}</format>'
        )
    parts.append("</formats></keg>")
    return "".join(parts)


def write_unfinished_keg(
    path: Path,
    formats: Mapping[str, tuple[str, str]],
    records: Iterable[tuple[str, int, bytes]],
) -> None:
    """``formats``: uuid string -> (key, the <item> elements); ``records``: (uuid string,
    timestamp ns, row in network order), as Mug::subscriberThread hands them to Keg::write."""
    with open(path, "wb") as f:
        f.write(bytes(10))  # Keg::start: emptyVersion (0) and emptyOffset (0), patched at stop
        for uuid_text, ts, row in records:
            f.write(uuid_module.UUID(uuid_text).bytes + struct.pack(">Q", ts) + row)
    known: dict[str, tuple[str, str]] = {}
    with open(str(path) + ".format", "wb") as sidecar:
        for uuid_text, fmt in formats.items():  # Keg::addFormat -> writeFormatFile: appends
            known[uuid_text] = fmt
            sidecar.write(_xerces_keg(known).encode())


# lagr2hdf5.py's type_map: struct codes by C++ type name (nothing else is readable).
LAGR2HDF5_TYPES = {
    "int8_t": "b",
    "uint8_t": "B",
    "int16_t": "h",
    "uint16_t": "H",
    "int32_t": "i",
    "uint32_t": "I",
    "int64_t": "q",
    "uint64_t": "Q",
    "float32": "f",
    "float64": "d",
}


def read_keg_like_lagr2hdf5(path: Path) -> tuple[dict[str, list[object]], list[int]]:
    """The columns lagr2hdf5.py would put in its HDF5 file ("name|key" -> values, in file order)
    and the timestamps it reads. Its failures stay failures: a format without ``key`` raises
    TypeError, an unknown type KeyError, a size that is not the type's struct.error. Uuids are
    compared as text, as under the Python 2 the script was written for."""
    with open(path, "rb") as f:
        _version = struct.unpack("!H", f.read(2))[0]
        dataoffset = struct.unpack("!Q", f.read(8))[0]
        f.seek(dataoffset)
        root = ET.fromstring(f.read())
        column_size = 0
        items: list[tuple[str, int, str, str, str]] = []
        columns: dict[str, list[object]] = {}
        for m in root.iter("format"):
            uuid_text, key = m.get("uuid"), m.get("key")
            for n in m:
                name, size, dtype = n.get("name"), int(n.get("size") or 0), n.get("type")
                items.append((name, size, dtype, uuid_text, key))  # type: ignore[arg-type]
                column_size += size
                columns.setdefault(name + "|" + key, [])  # type: ignore[operator]
        f.seek(10, 0)
        timestamps = []
        while True:
            if f.tell() + column_size > dataoffset:
                break
            record_uuid = binascii.hexlify(f.read(16)).decode()
            timestamps.append(struct.unpack("!Q", f.read(8))[0])
            for name, size, dtype, uuid_text, key in items:
                if uuid_text.replace("-", "") == record_uuid:
                    value = struct.unpack("!" + LAGR2HDF5_TYPES[dtype], f.read(size))[0]
                    columns[name + "|" + key].append(value)
    return columns, timestamps
