"""Test peers that behave as nasa/lager's C++ programs do, read from its source (src/ of
github.com/nasa/lager): no C++ peer is available here, so these keep its observable rules.

* :class:`NasaChpClient` -- ClusteredHashmapClient's subscriber: the sequence frame is a
  host-order double; an update is applied only if its sequence is larger than the last message's
  (HUGZ included: the client stores every message's sequence).
* :func:`check_format_xml`, :func:`check_keg_xml` -- what Xerces enforces with nasa/lager's
  share/data_format.xsd and share/keg_schema.xsd (the rules written out here; the XSD files are
  not copied): exact element names and nesting, required attributes, no undeclared ones, the
  ``LimitedString`` version (at most 8 characters) and ``PositiveInteger`` size/offset.
"""

from __future__ import annotations

import re
import struct
import xml.etree.ElementTree as ET

import zmq
import zmq.asyncio

__all__ = ["NasaChpClient", "XsdError", "check_format_xml", "check_keg_xml"]

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
