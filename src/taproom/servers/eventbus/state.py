"""The bus state, and how bus events become journal records (and back, after a restart).

A hashmap entry keeps what both dialects send, ready to go out: the six frames of the seed's
BROADCAST/SYNC and, once the CHP dialect needs them, the five of a kvmsg. An event that came
from a kvmsg client also keeps its other properties and raw body (``chp``); its seed data
frame is that body as a MessagePack bin. An empty data frame is a deletion: it is journaled
and broadcast, and removes the key from the hashmap.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack
import orjson

from ...protocols.eventbus import SEQUENCE, Event
from ...protocols.eventbus.kvmsg import Update, update_properties
from ...records import RECORD_HEAD, RECORD_HEAD_AFTER_LEN, BatchBuilder

log = logging.getLogger("taproom.eventbus")

PROTOCOL = "eventbus"
RESET_ATTRS = b'{"eventbus":"reset"}'
# What one hashmap entry costs besides its frames' bytes (CPython objects: the entry and frame
# tuples, eleven bytes headers, the dict slots of the hashmap and of the admission table).
ENTRY_OVERHEAD = 640

Frames = tuple[bytes, ...]


# One event as the hashmap (and a burst on its way to it) holds it: a *plain* tuple of
# (seq, frames, chp, expires_ms, kv), read by the indices below. Not a NamedTuple: CPython's
# cyclic GC untracks a plain tuple whose items are all untracked (ints, bytes, None, plain
# tuples of those) at its first collection, never a tuple subclass, so every full collection
# walked every NamedTuple entry (100,000 keys: 30-49 ms CPU a full collection under updates).
#   seq: the bus sequence
#   frames: topic, sequence, producer, timestamp, uuid, data (b"": a deletion)
#   chp: a kvmsg client's other properties and raw body, or None
#   expires_ms: wall-clock ms at which its ttl expires; 0: never
#   kv: key, sequence, uuid(16), properties, body (the kvmsg): built when needed, or None
Entry = tuple[int, Frames, tuple[bytes, bytes] | None, int, Frames | None]
SEQ: Final = 0
FRAMES: Final = 1
CHP: Final = 2
EXPIRES_MS: Final = 3
KV: Final = 4


def new_entry(
    seq: int,
    frames: Frames,
    chp: tuple[bytes, bytes] | None = None,
    expires_ms: int = 0,
    kv: Frames | None = None,
) -> Entry:
    """An entry from its fields (hot paths write the tuple itself, in this order)."""
    return (seq, frames, chp, expires_ms, kv)


def kv_frames(frames: Frames, chp: tuple[bytes, bytes] | None) -> Frames:
    """The kvmsg of an event: producer and timestamp as properties, then a kvmsg client's own
    properties; the body is its raw body, or an event from a seed client's MessagePack data."""
    topic, seq, producer, timestamp, uuid_text, data = frames
    uuid16 = bytes.fromhex(uuid_text.decode().replace("-", ""))
    if chp is None:
        return (topic, seq, uuid16, update_properties(producer, timestamp, b""), data)
    return (topic, seq, uuid16, update_properties(producer, timestamp, chp[0]), chp[1])


def entry_bytes(frames: Frames, chp: tuple[bytes, bytes] | None) -> int:
    """The memory an entry is charged against ``max_hashmap_bytes``."""
    size = ENTRY_OVERHEAD + len(frames[0]) + len(frames[2]) + len(frames[3]) + len(frames[5])
    return size + (len(chp[0]) + len(chp[1]) if chp is not None else 0)


def chp_data(body: bytes) -> bytes:
    """The seed's data frame for a kvmsg body: a MessagePack bin, or empty for a deletion."""
    return msgpack.packb(body, use_bin_type=True) if body else b""


def chp_event(update: Update, event_uuid: str, received: str, received_ns: int) -> Event:
    """The bus event of a client's kvmsg update (``event_uuid``: its uuid, or one the server
    gave it), received at ``received`` (ISO text) / ``received_ns``: an update without a
    timestamp takes the receive time. The CHP collector's kernel (servers/eventbus/kernel.py)
    is held to it by tests/protocols/test_eventbus_chp_kernel.py."""
    return Event(
        update.topic,
        0,
        update.producer,
        update.timestamp or received,
        event_uuid,
        chp_data(update.body),
        update.ts_ns if update.timestamp else received_ns,
        (update.properties, update.body),
        received_ns // 1_000_000 + update.ttl_ms if update.ttl_ms else 0,
    )


@dataclass
class BusState:
    """What a restart must get back: the Clone hashmap, the sequence, the recent UUIDs."""

    hashmap: dict[bytes, Entry] = field(default_factory=dict)
    sequence: int = 0
    recent_uuids: list[tuple[str, int]] = field(default_factory=list)  # (uuid, sequence)
    offset: int = 0  # journal offset the state covers (everything before it is applied)
    from_checkpoint: bool = False
    checkpoint_offset: int | None = None  # what the checkpoint loaded at start covered
    replayed: int = 0  # journal records applied at start after the checkpoint


class Dedup:
    """The bus sequence of each recent event UUID, bounded (FIFO eviction)."""

    def __init__(self, window: int) -> None:
        self.window = window
        # read (and written, as add() does) directly by the CHP collector's hot loop
        self.order: deque[str] = deque()
        self.seqs: dict[str, int] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.seqs

    def seq_of(self, key: str) -> int:
        return self.seqs.get(key, 0)

    def add(self, key: str, seq: int) -> None:
        if not self.window or key in self.seqs:
            return
        self.seqs[key] = seq
        self.order.append(key)
        if len(self.order) > self.window:
            self.seqs.pop(self.order.popleft(), None)

    def forget(self, key: str) -> None:
        self.seqs.pop(key, None)

    def recent(self) -> list[tuple[str, int]]:
        seqs = self.seqs
        return [(key, seqs[key]) for key in self.order if key in seqs]


def stream_of(topic: str) -> str:
    """The topic root: ``/orders/eu/1`` -> ``orders``."""
    return topic.split("/", 2)[1] if topic.count("/") >= 1 else topic


def journal_event(builder: BatchBuilder, event: Event, seq: int, timestamp: bytes) -> None:
    """One bus event as a journal record. The original ISO timestamp rides in attrs, so a
    snapshot rebuilt from the journal replays it exactly; so do a kvmsg client's properties
    (its raw body is the payload), the ttl's expiry time, and whether it is a deletion."""
    if event.chp is None and not event.expires_ms and event.data:  # the seed's hot path
        payload, content_type = event.data, "msgpack"
        attrs = b'{"timestamp":"' + timestamp + b'"}'
    else:
        extra: dict[str, Any] = {"timestamp": timestamp.decode()}
        if event.chp is not None:
            extra["dialect"] = "chp"
            if event.chp[0]:
                extra["properties"] = event.chp[0].decode()
        if not event.data:
            extra["delete"] = True
        if event.expires_ms:
            extra["expires_ms"] = event.expires_ms
        attrs = orjson.dumps(extra)
        if event.chp is not None:
            payload, content_type = event.chp[1], "raw"
        else:
            payload, content_type = event.data, "msgpack"
    builder.add(
        PROTOCOL,
        payload,
        stream=stream_of(event.topic),
        topic=event.topic,
        producer=event.producer,
        seq=seq,
        event_id=event.uuid,
        ts_ns=event.ts_ns,
        content_type=content_type,
        attrs=attrs,
    )


# A seed PUB's journal record written directly (the collector's hot path; a test checks the
# bytes equal journal_event's): the head, protocol and content type, then stream, topic,
# producer, event UUID, attrs, data. Every length is bounded by the bus's own limits.
SEED_MIDDLE = PROTOCOL.encode() + b"msgpack"
SEED_KINDS = frozenset({PROTOCOL + "/msgpack"})  # the journal's label (EncodedBatch.kinds)
CHP_KIND = PROTOCOL + "/raw"  # a kvmsg event's record (its raw body is the payload)
SEED_HEAD_FIXED = RECORD_HEAD_AFTER_LEN + len(SEED_MIDDLE) + 36  # + the UUID's 36 bytes


def seed_record(
    topic: bytes,
    producer: bytes,
    timestamp: bytes,
    uuid: bytes,
    data: bytes,
    seq: int,
    ts_ns: int,
    received_ns: int,
) -> tuple[bytes, ...]:
    """The parts of a seed PUB's journal record, as :func:`journal_event` encodes it."""
    stream = topic.split(b"/", 2)[1]
    attrs = b'{"timestamp":"' + timestamp + b'"}'
    rest = len(stream) + len(topic) + len(producer) + len(attrs) + len(data)
    head = RECORD_HEAD.pack(
        SEED_HEAD_FIXED + rest,
        received_ns,
        ts_ns,
        seq,
        len(PROTOCOL),
        7,
        len(stream),
        len(topic),
        len(producer),
        36,
        len(attrs),
        len(data),
    )
    return head, SEED_MIDDLE, stream, topic, producer, uuid, attrs, data


_PROTOCOL = PROTOCOL.encode()
_SEED_ATTRS = b'{"timestamp":"'
_HEAD_SIZE = RECORD_HEAD.size


def replay_entries(
    body: bytes, base_offset: int, start: int, end: int
) -> Iterator[tuple[int, Entry | None, str]]:
    """``(sequence, entry, event uuid)`` of the bus records of one journal batch body whose
    offsets are in ``[start, end)``, read straight from the bytes (a restart may read a
    million): the entry each stands for (see :func:`journal_event`), or None for a reset
    marker. Records of other protocols are stepped over."""
    unpack = RECORD_HEAD.unpack_from
    pos = 0
    size = len(body)
    offset = base_offset
    while pos < size:
        length, _rcv, _ts, seq, lp, lc, ls, lt, lr, le, la, ll = unpack(body, pos)
        q = pos + _HEAD_SIZE
        if start <= offset < end and body[q : q + lp] == _PROTOCOL:
            q += lp + lc + ls
            topic = body[q : q + lt]
            q += lt
            producer = body[q : q + lr]
            q += lr
            uuid = body[q : q + le]
            q += le
            raw_attrs = body[q : q + la]
            data = body[q + la : q + la + ll]
            chp = None
            expires_ms = 0
            if (
                raw_attrs.startswith(_SEED_ATTRS)
                and raw_attrs.endswith(b'"}')
                and raw_attrs.count(b'"') == 4
                and b"\\" not in raw_attrs
            ):  # the seed's hot path: {"timestamp":"..."} and nothing else
                timestamp = raw_attrs[len(_SEED_ATTRS) : -2]
            else:
                attrs = orjson.loads(raw_attrs) if la else {}
                if attrs.get("eventbus") == "reset":
                    yield seq, None, ""
                    pos += 4 + length
                    offset += 1
                    continue
                if attrs.get("dialect") == "chp":
                    chp = (str(attrs.get("properties", "")).encode(), data)
                    data = chp_data(data)
                timestamp = str(attrs.get("timestamp", "")).encode()
                expires_ms = int(attrs.get("expires_ms", 0) or 0)
            frames = (topic, SEQUENCE.pack(seq), producer, timestamp, uuid, data)
            yield seq, (seq, frames, chp, expires_ms, None), uuid.decode("utf-8", "surrogateescape")
        pos += 4 + length
        offset += 1
