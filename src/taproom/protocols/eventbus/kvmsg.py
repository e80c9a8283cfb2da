"""The Clustered Hashmap Protocol as the ØMQ Guide's Clone model 5/6 speaks it (kvmsg), sans-I/O.

The seed names the Guide's Clone examples as its reference; their clients (clonecli5/6 with
kvmsg and clone) speak the Guide's own wire, which taproom serves on a second group of ports
beside the seed's. Every message is a kvmsg of five frames::

    key | sequence (8 bytes, network order) | uuid (16 bytes) | properties | body

* snapshot (client DEALER -> server ROUTER): ``ICANHAZ?`` + subtree; the server answers one
  kvmsg per key under the subtree (the CHP spec calls them KVSYNC), then a kvmsg whose key is
  ``KTHXBAI``, whose sequence is the snapshot's and whose body is the subtree;
* updates (client PUSH -> server PULL in model 5, client PUB -> server SUB in model 6): a kvmsg
  with the client's own sequence (ignored) and a fresh uuid; an empty body deletes the key;
  property ``ttl`` (seconds) makes the key expire;
* publisher (server PUB): every update re-numbered by the server, and ``HUGZ`` (key ``HUGZ``,
  the current sequence, empty uuid, properties and body) once a second.

Properties are ``name=value`` lines, each ended by ``\\n``. The Guide's sequence is a big-endian
integer (the C ``kvmsg`` writes it byte by byte, the Python one packs ``!q``); nasa/lager's
registrar, which also speaks CHP (``protocols/lager/chp.py``), sends a host-order double
there instead.

How a kvmsg maps onto a bus event (``docs/protocols/eventbus.md``, "The CHP dialect") is here
too: :func:`parse_update` checks a client's update and splits out what the seed's frames carry
(producer, timestamp) from the properties that stay kvmsg-only.
"""

from __future__ import annotations

import re
import struct
import uuid as uuid_mod
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from ...eventtime import EventTimes
from ..clustered_hashmap import FRAMES, HUGZ, ICANHAZ, KTHXBAI, snapshot_subtree
from .commands import EventBusError, Limits, parse_timestamp

_UNCOUNTED = EventTimes()  # for callers that do not count out-of-range times

__all__ = [
    "HUGZ",
    "ICANHAZ",
    "KTHXBAI",
    "KvMsg",
    "Update",
    "encode_properties",
    "hugz_frames",
    "kthxbai_frames",
    "parse_icanhaz",
    "parse_kvmsg",
    "parse_properties",
    "parse_update",
    "update_properties",
]

# The Guide's sequence frame: big-endian (nasa/lager's registrar sends a host-order double
# instead; see protocols/clustered_hashmap.py for what the two CHP speakers share).
SEQUENCE = struct.Struct(">Q")
# Properties the seed's frames carry: they become the event's producer and timestamp, and
# every kvmsg taproom sends carries them back as properties.
PRODUCER = "producer"
TIMESTAMP = "timestamp"
TTL = "ttl"
# The longest ttl taken: ten years in seconds (an expiry time must fit the journal's attrs).
MAX_TTL_S = 10 * 365 * 86400
_TTL = re.compile(r"[0-9]{1,12}(\.[0-9]{1,9})?")
_NAME = re.compile(r"[^=\n\x00]+")


class KvMsg(NamedTuple):
    """The five frames of a kvmsg, shape-checked only (see :func:`parse_update`)."""

    key: bytes
    sequence: int
    uuid: bytes
    properties: bytes
    body: bytes

    def frames(self) -> list[bytes]:
        return [self.key, SEQUENCE.pack(self.sequence), self.uuid, self.properties, self.body]


class Update(NamedTuple):
    """A client's update, validated and mapped onto the bus event's fields.

    ``uuid`` is the canonical text form (the seed's frame and the dedup key), or empty when the
    client sent an empty uuid frame (the Guide's C clonecli5 does: the server gives the update
    a uuid of its own); ``timestamp`` is None when the client sent none (the server then uses
    the arrival time); ``ts_ns`` is 0 when the timestamp is outside what the journal can hold
    (taproom.eventtime); ``properties`` are the remaining properties, encoded, in the order
    sent; ``ttl_ms`` is 0 for none.
    """

    topic: str
    uuid: str
    producer: str
    timestamp: str | None
    ts_ns: int
    properties: bytes
    body: bytes
    ttl_ms: int


def parse_kvmsg(frames: Sequence[bytes]) -> KvMsg:
    """Five frames with an 8-byte sequence. Raises :class:`EventBusError`."""
    if len(frames) != FRAMES:
        raise EventBusError(f"{len(frames)} frames, a kvmsg has 5", reason="frame_count")
    key, seq, uuid, properties, body = frames
    if len(seq) != 8:
        raise EventBusError(f"sequence frame of {len(seq)} bytes", reason="bad_sequence")
    return KvMsg(key, int(SEQUENCE.unpack(seq)[0]), uuid, properties, body)


def parse_properties(frame: bytes, limits: Limits) -> list[tuple[str, str]]:
    """``name=value`` lines. Each line needs a non-empty name and an ``=``; the value runs to
    the end of the line (it may contain ``=``). The last line may lack its ``\\n``."""
    if len(frame) > limits.max_properties_bytes:
        raise EventBusError(
            f"properties are {len(frame)} bytes, at most {limits.max_properties_bytes}",
            reason="too_large",
        )
    try:
        text = frame.decode("utf-8")
    except UnicodeDecodeError:
        raise EventBusError("properties are not UTF-8", reason="bad_properties") from None
    pairs = []
    for line in text.split("\n"):
        if not line:
            continue
        name, eq, value = line.partition("=")
        if not eq or _NAME.fullmatch(name) is None:
            raise EventBusError("a property is not name=value", reason="bad_properties")
        pairs.append((name, value))
    return pairs


def encode_properties(pairs: Iterable[tuple[str, str]]) -> bytes:
    return "".join(f"{name}={value}\n" for name, value in pairs).encode()


def _ttl_ms(text: str) -> int:
    """``ttl`` in seconds (the Guide's clients send an integer; a fraction is taken too)."""
    if _TTL.fullmatch(text) is None or float(text) > MAX_TTL_S:
        raise EventBusError(f"ttl must be 0..{MAX_TTL_S} seconds", reason="bad_ttl")
    return round(float(text) * 1000)


def parse_update(frames: Sequence[bytes], limits: Limits, times: EventTimes = _UNCOUNTED) -> Update:
    """An update from the CHP collector. Raises :class:`EventBusError` with the reason:
    ``frame_count``, ``bad_sequence``, ``bad_topic``, ``too_large``, ``bad_uuid``,
    ``bad_properties``, ``bad_producer``, ``bad_timestamp``, ``bad_ttl``."""
    msg = parse_kvmsg(frames)
    if len(msg.key) > limits.max_topic_bytes:
        raise EventBusError(
            f"key is {len(msg.key)} bytes, at most {limits.max_topic_bytes}", reason="too_large"
        )
    try:
        topic = msg.key.decode("utf-8")
    except UnicodeDecodeError:
        raise EventBusError("key is not UTF-8", reason="bad_topic") from None
    if not topic.startswith("/"):
        # As the seed's topics: this keeps HUGZ, KTHXBAI and ICANHAZ? out of the key space.
        raise EventBusError("a key must start with '/'", reason="bad_topic")
    if not msg.uuid:
        # The Guide's C clonecli5 never sets a uuid (kvmsg_send sends an empty frame) and its
        # clonesrv5 publishes such updates: the server numbers them with a uuid of its own.
        uuid_text = ""
    elif len(msg.uuid) != 16:
        raise EventBusError(f"uuid is {len(msg.uuid)} bytes, not 16", reason="bad_uuid")
    else:
        event_uuid = uuid_mod.UUID(bytes=msg.uuid)
        if event_uuid.version != 4 or event_uuid.variant != uuid_mod.RFC_4122:
            # The seed's frame is a v4 UUID; the Guide's Python clients and libuuid make v4.
            raise EventBusError("uuid is not an RFC 4122 version 4 UUID", reason="bad_uuid")
        uuid_text = str(event_uuid)
    if len(msg.body) > limits.max_data_bytes:
        raise EventBusError(
            f"body is {len(msg.body)} bytes, at most {limits.max_data_bytes}", reason="too_large"
        )
    producer = ""
    timestamp: str | None = None
    ts_ns = 0
    ttl_ms = 0
    rest = []
    for name, value in parse_properties(msg.properties, limits):
        if name == PRODUCER:
            if len(value.encode()) > limits.max_producer_bytes:
                raise EventBusError("producer property too long", reason="bad_producer")
            producer = value
        elif name == TIMESTAMP:
            ts_ns = parse_timestamp(value, times)
            timestamp = value
        else:
            if name == TTL:
                ttl_ms = _ttl_ms(value)
            rest.append((name, value))
    properties = encode_properties(rest) if rest else b""
    return Update(topic, uuid_text, producer, timestamp, ts_ns, properties, msg.body, ttl_ms)


def update_properties(producer: bytes, timestamp: bytes, properties: bytes) -> bytes:
    """The properties of a kvmsg taproom sends: the seed's producer (when there is one) and
    timestamp, then the update's other properties as the client sent them."""
    head = b"producer=" + producer + b"\n" if producer else b""
    return head + b"timestamp=" + timestamp + b"\n" + properties


def parse_icanhaz(frames: Sequence[bytes], limits: Limits) -> bytes:
    """``ICANHAZ?`` + subtree (a plain key prefix; missing or empty means every key)."""
    subtree = snapshot_subtree(frames)
    if subtree is None:
        raise EventBusError("not ICANHAZ? + subtree", reason="bad_command")
    if len(subtree) > limits.max_topic_bytes:
        raise EventBusError("subtree longer than a key may be", reason="too_large")
    return subtree


def kthxbai_frames(sequence: int, subtree: bytes) -> list[bytes]:
    """The snapshot's end: its sequence, and the subtree as the body (clonesrv5/6)."""
    return [KTHXBAI, SEQUENCE.pack(sequence), b"", b"", subtree]


def hugz_frames(sequence: int) -> list[bytes]:
    """The heartbeat with the current sequence (clonesrv6 ``send_hugz``)."""
    return [HUGZ, SEQUENCE.pack(sequence), b"", b"", b""]
