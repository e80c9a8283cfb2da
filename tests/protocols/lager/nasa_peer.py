"""Test peers that behave as nasa/lager's C++ programs do, read from its source (src/ of
github.com/nasa/lager): no C++ peer is available here, so these keep its observable rules.

* :class:`NasaChpClient` -- ClusteredHashmapClient's subscriber: the sequence frame is a
  host-order double; an update is applied only if its sequence is larger than the last message's
  (HUGZ included: the client stores every message's sequence).
* :class:`NasaMug` -- Mug::subscriberThread: a SUB subscribed to everything on the forwarder's
  output, which takes every message for data and aborts on anything else ("received invalid
  uuid size", "received unsupported zmq message size": item frames must be 1, 2, 4 or 8 bytes).
* :class:`NasaTap` -- Tap + its ClusteredHashmapClient: registration with a 0.0 double sequence,
  re-sent every 100 ms until the registrar publishes the key with the same value; rows as
  uuid | "BEERR01" | 1-byte flags | timestamp | one frame per item, from a PUB socket.
  :meth:`NasaTap.start` is Tap::start as a whole, the way a restarted Tap behaves: a new uuid,
  the client's snapshot thread (``ICANHAZ?`` again after every message it reads, until
  ``KTHXBAI``, then the socket closed), its subscriber thread, and its publisher thread, which
  every 100 ms sends what ``getUnsyncedHashmap`` finds: a key of its own missing from its view
  of the map, or present with another value *and* its own uuid. A key present with the same
  value (a restart with the same format) is never sent again, whatever uuid the map names.
* :class:`NasaBartender` -- ClusteredHashmapServer + Forwarder: snapshot ROUTER at P, publisher
  PUB at P+1 (updates, else HUGZ every 10 ms, sequences as host-order doubles), collector SUB at
  P+2 (any key; a key held by another uuid keeps its uuid but takes the new value), and a plain
  SUB -> PUB forwarder at P+10 / P+11. No hello, no marks, nothing at P+12.
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

import asyncio
import binascii
import re
import struct
import threading
import time
import uuid as uuid_module
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.devices

__all__ = [
    "NasaBartender",
    "NasaChpClient",
    "NasaMug",
    "NasaMugAbort",
    "NasaTap",
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


class NasaMugAbort(RuntimeError):
    """The std::runtime_error that ends a real Mug's subscriber thread (and its process)."""


class NasaMug:
    """The data side of nasa/lager's Mug. ``formats`` (uuid -> item sizes) makes it stricter
    than the C++: the item frames must also be the tap's items, in order."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        forwarder_out: str,
        formats: Mapping[bytes, list[int]] | None = None,
    ) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 0)  # a test must not lose rows to its own HWM
        self.sub.connect(forwarder_out)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")  # "subscribe to everything (for now)"
        self.formats = dict(formats or {})
        self.rows: list[bytes] = []  # what Keg::write gets: uuid | timestamp | items

    async def read(self, timeout: float) -> bytes | None:
        """One message as the keg row the C++ builds, or None after ``timeout`` seconds."""
        if not await self.sub.poll(int(timeout * 1000)):
            return None
        frames = await self.sub.recv_multipart()
        if len(frames) < 4:  # the C++ recv()s four frames without looking: it desynchronises
            raise NasaMugAbort(f"message of {len(frames)} frames read as a data header")
        uuid, _version, _compression, timestamp = frames[:4]
        if len(uuid) != 16:
            raise NasaMugAbort("received invalid uuid size")
        if len(timestamp) != 8:
            raise NasaMugAbort(f"timestamp frame of {len(timestamp)} bytes")
        items = frames[4:]
        for item in items:
            if len(item) not in (1, 2, 4, 8):
                raise NasaMugAbort("received unsupported zmq message size")
        sizes = self.formats.get(uuid)
        if sizes is not None and [len(item) for item in items] != sizes:
            raise NasaMugAbort(f"item frames {[len(i) for i in items]}, the format has {sizes}")
        row = uuid + timestamp + b"".join(items)
        self.rows.append(row)
        return row

    def close(self) -> None:
        self.sub.close(linger=0)


class NasaTap:
    """A real Tap's sockets: collector PUB (registration), data PUB, and the CHP subscriber.

    The two publishers are XPUB sockets here: on the wire an XPUB is a PUB (the bartender's
    SUBs see no difference, and nothing is delivered before their subscription arrives), but
    the test can wait for that subscription (:meth:`connected`) instead of sleeping."""

    def __init__(
        self, ctx: zmq.asyncio.Context, registrar: str, forwarder_in: str, key: str, xml: str
    ) -> None:
        host, port = registrar.rsplit(":", 1)
        self.ctx = ctx
        self.snapshot_address = f"tcp://{host}:{port}"
        self.key, self.xml = key.encode(), xml.encode()
        self.uuid = uuid_module.uuid4().bytes  # lager_utils::getUuid(): new at every start
        self.collector = ctx.socket(zmq.XPUB)
        self.collector.setsockopt(zmq.LINGER, 0)
        self.collector.connect(f"tcp://{host}:{int(port) + 2}")
        self.data = ctx.socket(zmq.XPUB)
        self.data.setsockopt(zmq.LINGER, 0)
        self.data.setsockopt(zmq.SNDHWM, 0)
        self.data.connect(f"tcp://{forwarder_in}")
        self.chp = NasaChpClient(ctx, f"tcp://{host}:{int(port) + 1}")
        self.registrations_sent = 0
        self._threads: list[asyncio.Task[None]] = []

    async def connected(self, timeout: float = 10.0) -> None:
        """Both publishers hold the bartender's subscription: what is sent now arrives."""
        for sock in (self.collector, self.data):
            if not await sock.poll(int(timeout * 1000)):
                raise TimeoutError("the bartender never subscribed")
            await sock.recv()

    def unsynced(self) -> dict[bytes, bytes]:
        """ClusteredHashmapClient::getUnsyncedHashmap for the one key of this Tap."""
        held = self.chp.hash_map.get(self.key)
        if held is None:
            return {self.key: self.xml}
        uuids_match = any(k == self.key and u == self.uuid for u, k in self.chp.uuid_map.items())
        if held != self.xml and uuids_match:
            return {self.key: self.xml}
        return {}

    async def start(self, *, snapshot_after_s: float | None = None) -> None:
        """Tap::start: the client's three threads start, then its key goes into selfMap, so
        the publisher thread's first pass has nothing to send; it passes again every 100 ms.
        ``snapshot_after_s=None`` is the usual order: the snapshot (a few messages on loopback)
        is in before that second pass, so a restarted Tap whose key the map shows with its
        format sends no registration at all. A number is a snapshot that comes that late (a
        busy registrar): meanwhile the key is missing from the map the client sees, and the
        registration goes out every 100 ms."""
        self._snapshot_done = asyncio.Event()
        self._threads = [
            asyncio.create_task(self._snapshot_thread(snapshot_after_s or 0.0)),
            asyncio.create_task(self._subscriber_thread()),
            asyncio.create_task(self._publisher_thread(snapshot_first=snapshot_after_s is None)),
        ]

    async def _snapshot_thread(self, after_s: float) -> None:
        await asyncio.sleep(after_s)
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.snapshot_address)
        update_map: dict[bytes, bytes] = {}
        update_uuids: dict[bytes, bytes] = {}
        try:
            while True:
                await dealer.send_multipart([b"ICANHAZ?", b""])
                if not await dealer.poll(2000):
                    update_map.clear()  # "only process a complete set"
                    update_uuids.clear()
                    continue
                key, _seq, uuid, _empty, value = (await dealer.recv_multipart())[:5]
                if value:
                    update_map[key] = value
                    update_uuids[uuid] = key
                if key == b"KTHXBAI":
                    break
        finally:
            dealer.close(linger=0)  # the answers to the other requests are never read
        self.chp.hash_map.update(update_map)
        self.chp.uuid_map.update(update_uuids)
        self._snapshot_done.set()

    async def _subscriber_thread(self) -> None:
        while True:
            await self.chp.handle_one(1.0)

    async def _publisher_thread(self, *, snapshot_first: bool) -> None:
        await asyncio.sleep(0.1)  # the first pass ran before selfMap had the key
        if snapshot_first:
            await self._snapshot_done.wait()
        while True:
            for key, value in self.unsynced().items():
                await self.collector.send_multipart([key, _DOUBLE.pack(0.0), self.uuid, b"", value])
                self.registrations_sent += 1
            await asyncio.sleep(0.1)  # "keep this from running at full speed"

    async def register(self, timeout: float = 10.0) -> None:
        """getUnsyncedHashmap: re-send until the map holds our key with our value (whatever
        uuid the registrar shows with it: the C++ compares values only)."""
        deadline = time.monotonic() + timeout
        while self.chp.hash_map.get(self.key) != self.xml:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.key!r} never came back from the registrar")
            await self.collector.send_multipart(
                [self.key, _DOUBLE.pack(0.0), self.uuid, b"", self.xml]
            )
            until = time.monotonic() + 0.1
            while time.monotonic() < until:
                await self.chp.handle_one(max(until - time.monotonic(), 0.001))

    async def log(self, ts_ns: int, items: list[bytes], flags: int = 0) -> None:
        await self.data.send_multipart(
            [self.uuid, b"BEERR01", bytes([flags]), struct.pack(">Q", ts_ns), *items]
        )

    def close(self) -> None:
        for thread in self._threads:
            thread.cancel()
        for sock in (self.collector, self.data):
            sock.close(linger=0)
        self.chp.close()


class NasaBartender:
    """nasa/lager's bartender on free ports, in threads: ``registrar`` is ``host:P``."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.snapshot = self.ctx.socket(zmq.ROUTER)
        self.publisher = self.ctx.socket(zmq.PUB)
        self.collector = self.ctx.socket(zmq.SUB)
        self.collector.setsockopt(zmq.SUBSCRIBE, b"")
        frontend = self.ctx.socket(zmq.SUB)
        frontend.setsockopt(zmq.SUBSCRIBE, b"")
        backend = self.ctx.socket(zmq.PUB)
        placed = [(self.snapshot, 0), (self.publisher, 1), (self.collector, 2),
                  (frontend, 10), (backend, 11)]  # fmt: skip
        for _ in range(50):
            base = self.snapshot.bind_to_random_port("tcp://127.0.0.1", 20000, 60000)
            bound = [f"tcp://127.0.0.1:{base}"]
            try:
                for sock, offset in placed[1:]:
                    sock.bind(f"tcp://127.0.0.1:{base + offset}")
                    bound.append(f"tcp://127.0.0.1:{base + offset}")
                break
            except zmq.ZMQError:
                for (sock, _offset), address in zip(placed, bound, strict=False):
                    sock.unbind(address)
        self.registrar = f"127.0.0.1:{base}"
        self.forwarder_out = f"tcp://127.0.0.1:{base + 11}"
        self.hash_map: dict[bytes, bytes] = {}
        self.uuid_map: dict[bytes, bytes] = {}  # uuid -> key
        self._updated: list[bytes] = []
        self._sequence = 0.0
        self._running = True
        self._forwarder = threading.Thread(target=self._forward, args=(frontend, backend))
        self._server = threading.Thread(target=self._serve)
        self._forwarder.start()
        self._server.start()

    def _forward(self, frontend: zmq.Socket[bytes], backend: zmq.Socket[bytes]) -> None:
        try:
            zmq.proxy(frontend, backend)  # zmq_device(ZMQ_FORWARDER, ...) until the context ends
        except zmq.ContextTerminated:
            pass
        finally:
            frontend.close(linger=0)
            backend.close(linger=0)

    def _uuid_of(self, key: bytes) -> bytes:
        return next((u for u, k in self.uuid_map.items() if k == key), b"")

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.snapshot, zmq.POLLIN)
        poller.register(self.collector, zmq.POLLIN)
        while self._running:
            events = dict(poller.poll(10))
            if self.collector in events:
                key, _seq, uuid, _props, value = self.collector.recv_multipart()[:5]
                if uuid and uuid not in self.uuid_map and key not in self.uuid_map.values():
                    self.uuid_map[uuid] = key
                self.hash_map[key] = value
                self._updated.append(key)
            if self.snapshot in events:
                identity, icanhaz, *_subtree = self.snapshot.recv_multipart()
                if icanhaz == b"ICANHAZ?":
                    seq = _DOUBLE.pack(self._sequence)
                    for key, value in self.hash_map.items():
                        self.snapshot.send_multipart(
                            [identity, key, seq, self._uuid_of(key), b"", value]
                        )
                    self.snapshot.send_multipart([identity, b"KTHXBAI", seq, b"", b"", b""])
                    self._sequence += 1
            if self._updated:  # publishUpdatedKeys
                for key in self._updated:
                    self.publisher.send_multipart([key, _DOUBLE.pack(self._sequence),
                        self._uuid_of(key), b"", self.hash_map[key]])  # fmt: skip
                    self._sequence += 1
                self._updated.clear()
            else:  # publishHugz
                self.publisher.send_multipart([b"HUGZ", _DOUBLE.pack(0.0), b"", b"", b""])

    def close(self) -> None:
        self._running = False
        self._server.join()
        for sock in (self.snapshot, self.publisher, self.collector):
            sock.close(linger=0)
        self.ctx.term()
        self._forwarder.join()


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
