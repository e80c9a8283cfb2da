"""The common event record and its compact batch encoding.

Every protocol maps what it receives to :class:`Record` fields (DESIGN.md decision 5). On the
ack path events never become ``Record`` objects: servers append fields straight into a
:class:`BatchBuilder`, whose ``build()`` gives the bytes the journal stores. Decoding back to
``Record`` happens off the ack path (fan-out, ``taproom tail``, the Spark reader).

Record layout inside a batch body (little-endian, no padding)::

    u32 length of the rest of this record
    i64 received_ns   i64 ts_ns   u64 seq
    u8  len(protocol) u8 len(content_type)
    u16 len(stream)   u16 len(topic)  u16 len(producer)  u16 len(event_id)
    u32 len(attrs)    u32 len(payload)
    protocol content_type stream topic producer event_id attrs payload   (UTF-8 / raw bytes)

``attrs`` is a JSON object of string values (empty bytes when there are none). Offsets are not
stored per record: the journal frames each batch with its base offset, record *i* of a batch
has offset ``base + i``.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import orjson

from .errors import LimitExceeded

__all__ = [
    "MAX_PAYLOAD_BYTES",
    "RECORD_HEAD",
    "RECORD_HEAD_AFTER_LEN",
    "BatchBuilder",
    "EncodedBatch",
    "Record",
    "decode_batch",
    "iter_batch",
    "shown",
]

# The record head. Public for the few hot paths (Lumberjack decoder, logjam PUB) that write or
# walk records without Record objects; everything else uses BatchBuilder and iter_batch.
RECORD_HEAD = struct.Struct("<IqqQBBHHHHII")
RECORD_HEAD_AFTER_LEN = RECORD_HEAD.size - 4
_HEAD = RECORD_HEAD
_HEAD_AFTER_LEN = RECORD_HEAD_AFTER_LEN
# One record's payload may not exceed this: the journal frames batches with u32 lengths and a
# single event larger than 64 MiB is a sender bug, not telemetry.
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
_U64 = (1 << 64) - 1
# Distinct short strings remembered per builder: a batch has few protocols/streams/topics.
_CACHE_ENTRIES = 512


def shown(text: str) -> str:
    """A field for people and JSON: bytes a sender sent that are not UTF-8 (kept with
    surrogateescape, e.g. a logjam routing key after its prefix) become U+FFFD, as the Spark
    reader shows them; JSON encoders refuse the escapes themselves."""
    if text.isascii():
        return text
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class Record:
    """One event as taproom stores it. ``offset`` is assigned by the journal at commit."""

    protocol: str
    stream: str = ""
    topic: str = ""
    producer: str = ""
    seq: int = 0
    event_id: str = ""
    ts_ns: int = 0
    content_type: str = "raw"
    payload: bytes = b""
    attrs: Mapping[str, str] = field(default_factory=dict)
    received_ns: int = 0
    offset: int = -1

    def to_json_dict(self) -> dict[str, object]:
        """A JSON-ready view: payload decoded as JSON or text where the content type allows."""
        from .payloads import decode_payload  # local: payload codecs are not needed to store

        return {
            "offset": self.offset,
            "received_ns": self.received_ns,
            "protocol": self.protocol,
            "stream": shown(self.stream),
            "topic": shown(self.topic),
            "producer": shown(self.producer),
            "seq": self.seq,
            "event_id": shown(self.event_id),
            "ts_ns": self.ts_ns,
            "content_type": self.content_type,
            "payload": decode_payload(self.content_type, self.payload),
            "attrs": dict(self.attrs),
        }


@dataclass(frozen=True, slots=True)
class EncodedBatch:
    """What the journal appends: ``count`` records encoded back to back in ``body``.

    ``kinds``: labels of the records' protocols and content types (``"lumberjack/json"``, or
    ``"logjam/*"`` for any content type of a protocol; see :mod:`taproom.journal.kinds`), so
    the journal knows which segments hold what without reading records on the commit path.
    None: not declared, the journal reads the records for them. Two batches are equal when
    their records are: the labels are not compared.
    """

    count: int
    body: bytes
    kinds: frozenset[str] | None = field(default=None, compare=False)  # a hint, not content


def _utf8(value: str, limit: int, name: str) -> bytes:
    raw = value.encode("utf-8", "surrogateescape")
    if len(raw) > limit:
        raise LimitExceeded(f"{name} is {len(raw)} bytes, at most {limit}", reason="field_too_long")
    return raw


class BatchBuilder:
    """Accumulates encoded records for one journal append.

    Not thread-safe; one per connection or per read loop. ``received_ns`` defaults to the time
    the builder was created so one batch shares one receive time.
    """

    __slots__ = (
        "_cache",
        "_content_type",
        "_count",
        "_kinds",
        "_nbytes",
        "_parts",
        "_protocol",
        "received_ns",
    )

    def __init__(self, received_ns: int | None = None) -> None:
        self.received_ns = time.time_ns() if received_ns is None else received_ns
        self._parts: list[bytes] = []
        self._count = 0
        self._nbytes = 0
        self._cache: dict[str, bytes] = {"": b""}
        # The batch's kinds (EncodedBatch.kinds), noted when the protocol or content type
        # differs from the last record's: callers pass the same strings record after record.
        self._kinds: set[str] = set()
        self._protocol: str | None = None
        self._content_type: str | None = None

    def _encode(self, value: str, limit: int, name: str) -> bytes:
        raw = _utf8(value, limit, name)
        if len(self._cache) < _CACHE_ENTRIES:
            self._cache[value] = raw
        return raw

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Encoded size so far, for callers that cap a batch by bytes."""
        return self._nbytes

    def add(
        self,
        protocol: str,
        payload: bytes,
        *,
        stream: str = "",
        topic: str = "",
        producer: str = "",
        seq: int = 0,
        event_id: str = "",
        ts_ns: int = 0,
        content_type: str = "raw",
        attrs: Mapping[str, str] | bytes | None = None,
        received_ns: int | None = None,
    ) -> None:
        """Append one event. Raises :class:`LimitExceeded` on an over-long field."""
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise LimitExceeded(
                f"payload is {len(payload)} bytes, at most {MAX_PAYLOAD_BYTES}",
                reason="payload_too_large",
            )
        if not 0 <= seq <= _U64:
            raise LimitExceeded(f"seq {seq} outside u64", reason="bad_seq")
        # Hot path: protocol, content type, stream, topic and producer repeat within a batch,
        # so their encoded (and length-checked) bytes come from a per-builder cache.
        cache = self._cache
        p = cache.get(protocol)
        if p is None:
            p = self._encode(protocol, 255, "protocol")
        c = cache.get(content_type)
        if c is None:
            c = self._encode(content_type, 255, "content_type")
        s = cache.get(stream)
        if s is None:
            s = self._encode(stream, 65535, "stream")
        t = cache.get(topic)
        if t is None:
            t = self._encode(topic, 65535, "topic")
        r = cache.get(producer)
        if r is None:
            r = self._encode(producer, 65535, "producer")
        e = _utf8(event_id, 65535, "event_id") if event_id else b""
        if attrs is None:
            a = b""
        elif isinstance(attrs, bytes):
            a = attrs
        else:
            a = orjson.dumps(dict(attrs)) if attrs else b""
        rest = len(p) + len(c) + len(s) + len(t) + len(r) + len(e) + len(a) + len(payload)
        head = _HEAD.pack(
            _HEAD_AFTER_LEN + rest,
            self.received_ns if received_ns is None else received_ns,
            ts_ns,
            seq,
            len(p),
            len(c),
            len(s),
            len(t),
            len(r),
            len(e),
            len(a),
            len(payload),
        )
        self._parts += (head, p, c, s, t, r, e, a, payload)
        self._count += 1
        self._nbytes += _HEAD.size + rest
        if protocol is not self._protocol or content_type is not self._content_type:
            self._kinds.add(f"{protocol}/{content_type}")
            self._protocol, self._content_type = protocol, content_type

    def add_record(self, record: Record) -> None:
        """Append a :class:`Record` (its ``offset`` is ignored; the journal assigns one)."""
        self.add(
            record.protocol,
            record.payload,
            stream=record.stream,
            topic=record.topic,
            producer=record.producer,
            seq=record.seq,
            event_id=record.event_id,
            ts_ns=record.ts_ns,
            content_type=record.content_type,
            attrs=record.attrs,
            received_ns=record.received_ns or None,
        )

    def build(self) -> EncodedBatch:
        """The batch so far. The builder is reset and can be reused."""
        batch = EncodedBatch(self._count, b"".join(self._parts), frozenset(self._kinds))
        self._parts = []
        self._count = 0
        self._nbytes = 0
        self._kinds = set()
        self._protocol = self._content_type = None
        return batch


def encode_records(records: list[Record]) -> EncodedBatch:
    """Convenience for tests and clients: encode a list of records as one batch."""
    builder = BatchBuilder()
    for record in records:
        builder.add_record(record)
    return builder.build()


def iter_batch(
    body: bytes | memoryview, base_offset: int, protocol: bytes | None = None
) -> Iterator[Record]:
    """Decode the records of one batch body. Raises ``ValueError`` on a malformed body.

    With ``protocol`` (encoded), only that protocol's records are decoded and given; the others
    are stepped over (a service rebuilding its state from a journal of every protocol).
    The journal verifies each batch's CRC before handing its body here, so a malformed body
    means a bug, not disk corruption.
    """
    view = memoryview(body)
    pos = 0
    end = len(view)
    offset = base_offset
    unpack = _HEAD.unpack_from
    while pos < end:
        if end - pos < _HEAD.size:
            raise ValueError("truncated record header")
        (length, received_ns, ts_ns, seq, lp, lc, ls, lt, lr, le, la, ll) = unpack(view, pos)
        rec_end = pos + 4 + length
        if rec_end > end or length != _HEAD_AFTER_LEN + lp + lc + ls + lt + lr + le + la + ll:
            raise ValueError("record length mismatch")
        q = pos + _HEAD.size
        raw_protocol = view[q : q + lp]
        if protocol is not None and raw_protocol != protocol:
            offset += 1
            pos = rec_end
            continue
        q += lp
        content_type = str(view[q : q + lc], "utf-8", "surrogateescape")
        q += lc
        stream = str(view[q : q + ls], "utf-8", "surrogateescape")
        q += ls
        topic = str(view[q : q + lt], "utf-8", "surrogateescape")
        q += lt
        producer = str(view[q : q + lr], "utf-8", "surrogateescape")
        q += lr
        event_id = str(view[q : q + le], "utf-8", "surrogateescape")
        q += le
        attrs = orjson.loads(view[q : q + la]) if la else {}
        q += la
        payload = bytes(view[q : q + ll])
        yield Record(
            protocol=str(raw_protocol, "utf-8", "surrogateescape"),
            stream=stream,
            topic=topic,
            producer=producer,
            seq=seq,
            event_id=event_id,
            ts_ns=ts_ns,
            content_type=content_type,
            payload=payload,
            attrs=attrs,
            received_ns=received_ns,
            offset=offset,
        )
        offset += 1
        pos = rec_end


def decode_batch(body: bytes | memoryview, base_offset: int) -> list[Record]:
    """All records of one batch body, with offsets from ``base_offset``."""
    return list(iter_batch(body, base_offset))
