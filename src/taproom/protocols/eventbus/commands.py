"""Event BUS (Clone pattern) commands as the seed frames them, sans-I/O.

This module turns lists of ZeroMQ frames into typed commands and typed commands back into
frame lists, as ``seeds/event-bus.txt`` describes them (see ``docs/protocols/eventbus.md`` for
every decision on the seed's ambiguities). It never touches a socket and never reads the
clock: the server and client in ``servers/eventbus/`` and ``clients/eventbus.py`` pass the
time in.

Commands (frames after the ROUTER identity frame, which is not part of a command)::

    SYNCSTART  "SYNCSTART" | subtrees | sequence(8)                     client -> SNAPSHOT
    SYNC       "SYNC" | topic | sequence(8) | producer | ts | uuid | data   SNAPSHOT -> client
    SYNCEND    "SYNCEND" | subtrees | sequence(8)                        SNAPSHOT -> client
    BROADCAST  topic | sequence(8) | producer | ts | uuid | data         PUBLISHER -> clients
    PUB        topic | sequence(8) | producer | ts | uuid | data         client -> COLLECTOR

taproom adds, in the seed's own frame shapes:

* the heartbeat, a BROADCAST whose topic is ``HUGZ`` (zguide Clone), carrying the bus's
  current sequence and, as its MessagePack data, the server's Binary Star state;
* ``REPLICATE`` / ``REPLICATED`` between the two servers of a Binary Star pair, sent to the
  peer's COLLECTOR (a real topic always starts with ``/`` so they cannot be mistaken for PUB).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

import msgpack

from ...errors import ProtocolError
from ...eventtime import EventTimes

__all__ = [
    "HUGZ_TOPIC",
    "Command",
    "Event",
    "EventBusError",
    "Heartbeat",
    "Limits",
    "SyncEnd",
    "SyncStart",
    "broadcast_frames",
    "encode_sequence",
    "format_subtrees",
    "hugz_frames",
    "matches",
    "parse_broadcast",
    "parse_pub",
    "parse_replicate",
    "parse_replicated",
    "parse_snapshot_reply",
    "parse_subtrees",
    "parse_syncstart",
    "parse_timestamp",
    "pub_frames",
    "replicate_frames",
    "replicated_frames",
    "sync_frames",
    "syncend_frames",
    "syncstart_frames",
]

SEQUENCE = struct.Struct(">Q")
_U64_MAX = (1 << 64) - 1
HUGZ_TOPIC = b"HUGZ"
# For callers that do not count out-of-range times (clients, tests): its tally is never read.
_UNCOUNTED = EventTimes()
# RFC 4122 version 4 in its canonical 8-4-4-4-12 text form: version nibble 4, variant 10xx.
_UUID4 = re.compile(
    rb"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-4[0-9a-fA-F]{3}-[89abAB][0-9a-fA-F]{3}-[0-9a-fA-F]{12}"
)
_NIL = b"\xc0"  # MessagePack nil: what an empty data frame stands for (see the docs)


class Command(Enum):
    """Command names, the first frame of the snapshot commands (seed, "State Synchronization")."""

    SYNCSTART = b"SYNCSTART"  # 'Frame 0: "SYNCSTART", as 0MQ string'
    SYNC = b"SYNC"  # 'Frame 0: "SYNC", as 0MQ string'
    SYNCEND = b"SYNCEND"  # 'Frame 0: "SYNCEND"'
    REPLICATE = b"REPLICATE"  # taproom: primary -> backup, a run of committed events
    REPLICATED = b"REPLICATED"  # taproom: backup -> primary, "durable up to this sequence"
    COPY = b"COPY"  # taproom: passive -> active SNAPSHOT: the whole state as REPLICATEs, SYNCEND


class EventBusError(ProtocolError):
    """A malformed Event BUS command. The bus has no error reply: it is dropped and counted.

    ``reason`` is one of: ``frame_count``, ``bad_command``, ``bad_topic``, ``bad_sequence``,
    ``bad_producer``, ``bad_timestamp``, ``bad_uuid``, ``bad_msgpack``, ``bad_subtree``,
    ``too_large``.
    """

    def __init__(self, message: str, *, reason: str = "malformed") -> None:
        super().__init__(message, reason=reason, reply=None)


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds checked before anything from the wire is kept (config: ``[eventbus]``)."""

    max_topic_bytes: int = 1024
    max_producer_bytes: int = 256
    max_data_bytes: int = 1024 * 1024
    max_subtrees: int = 64
    max_properties_bytes: int = 4096  # kvmsg properties (the CHP dialect)


DEFAULT_LIMITS = Limits()


class Event(NamedTuple):
    """One event: the six frames of PUB, BROADCAST and (after its command frame) SYNC.

    ``timestamp`` is kept as sent so a snapshot replays it byte for byte; ``ts_ns`` is the same
    instant as nanoseconds since the epoch (naive timestamps are taken as UTC). A NamedTuple,
    not a dataclass: one is built per event on the hot path and a frozen dataclass costs ten
    times as much to construct.

    An empty ``data`` in a BROADCAST or SYNC is a deletion (a CHP client's empty body, or an
    expired ``ttl``). ``chp`` and ``expires_ms`` travel only between servers (REPLICATE): for
    an event that came from a kvmsg client, its other properties and raw body, and the
    wall-clock time (ms) at which its ``ttl`` expires (0: never).
    """

    topic: str
    sequence: int
    producer: str
    timestamp: str
    uuid: str
    data: bytes
    ts_ns: int = 0
    chp: tuple[bytes, bytes] | None = None
    expires_ms: int = 0

    def frames(self) -> list[bytes]:
        return [
            self.topic.encode(),
            SEQUENCE.pack(self.sequence),
            self.producer.encode(),
            self.timestamp.encode(),
            self.uuid.encode(),
            self.data,
        ]


@dataclass(frozen=True, slots=True)
class SyncStart:
    """SYNCSTART: the subtrees wanted (empty tuple: everything) and the sequence filter."""

    subtrees: tuple[str, ...]
    sequence: int


@dataclass(frozen=True, slots=True)
class SyncEnd:
    """SYNCEND: the snapshot is complete up to and including ``sequence``."""

    subtrees: tuple[str, ...]
    sequence: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A HUGZ broadcast: the bus is alive, its sequence, and its Binary Star state.

    ``acks``: (event UUID, bus sequence) of PUBs the bus dropped as repeats of events it has
    already committed and broadcast, so that a producer whose retry was a duplicate (it missed
    the BROADCAST, e.g. across a failover) learns that its event is stored.
    """

    sequence: int
    producer: str
    timestamp: str
    state: int
    synced: bool
    acks: tuple[tuple[str, int], ...] = ()


# --- small field codecs ------------------------------------------------------------------------


def encode_sequence(sequence: int) -> bytes:
    return SEQUENCE.pack(sequence)


def _sequence(frame: bytes, *, empty_ok: bool) -> int:
    """8 bytes in network order (the seed); decimal text or empty as micro-toolkit sends.

    Eight ASCII digits are decimal text: as a big-endian u64 they would be at least
    0x3030303030303030 (3.5e18), a sequence no bus reaches, while peers do write ``00000001``.
    """
    if len(frame) == 8 and not frame.isdigit():
        return int(SEQUENCE.unpack(frame)[0])
    if not frame:
        if empty_ok:
            return 0
        raise EventBusError("empty sequence frame", reason="bad_sequence")
    if len(frame) < 20 and frame.isdigit():
        return int(frame)
    raise EventBusError(f"sequence frame of {len(frame)} bytes", reason="bad_sequence")


def _text(frame: bytes, limit: int, reason: str, name: str) -> str:
    if len(frame) > limit:
        raise EventBusError(f"{name} is {len(frame)} bytes, at most {limit}", reason="too_large")
    try:
        return frame.decode("utf-8")
    except UnicodeDecodeError:
        raise EventBusError(f"{name} is not UTF-8", reason=reason) from None


def parse_timestamp(text: str, times: EventTimes = _UNCOUNTED) -> int:
    """Nanoseconds since the epoch for an ISO-8601 date-time (naive means UTC), by the event
    time rule (taproom.eventtime): a date-time the journal cannot hold (years 1-1677 and
    2262-9999) is 0, absent, and counted in ``times``; the event is kept.

    Raises :class:`EventBusError` (``bad_timestamp``) for anything that is not a date-time,
    including a bare date: the seed's frame is an ISO-8601 timestamp.
    """
    ts_ns = times.iso(text)
    if ts_ns is None:
        raise EventBusError("timestamp is not an ISO-8601 date-time", reason="bad_timestamp")
    return ts_ns


def _check_msgpack(data: bytes) -> None:
    try:
        msgpack.unpackb(data, raw=True, use_list=False, strict_map_key=False)
    except Exception:  # ExtraData, FormatError, StackError, ValueError, TypeError (map keys)
        raise EventBusError(
            "data is not one complete MessagePack value", reason="bad_msgpack"
        ) from None


def parse_subtrees(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[str, ...]:
    """The subtree specification: empty (everything) or ``/a/b/`` parts split by ``;`` or ``,``.

    Each part must start with ``/``; it is matched as a plain prefix of the topic.
    """
    text = _text(frame, limits.max_topic_bytes * limits.max_subtrees, "bad_subtree", "subtrees")
    if not text:
        return ()
    parts = [p for p in re.split(r"[;,]", text) if p]
    if len(parts) > limits.max_subtrees:
        raise EventBusError(
            f"{len(parts)} subtrees, at most {limits.max_subtrees}", reason="too_large"
        )
    for part in parts:
        if not part.startswith("/"):
            raise EventBusError("a subtree must start with '/'", reason="bad_subtree")
        if len(part.encode()) > limits.max_topic_bytes:
            raise EventBusError("subtree longer than a topic may be", reason="too_large")
    return tuple(parts)


def format_subtrees(subtrees: Sequence[str]) -> bytes:
    return ";".join(subtrees).encode()


def matches(topic: str, subtrees: Sequence[str]) -> bool:
    """Whether ``topic`` lies in one of ``subtrees`` (no subtrees: everything)."""
    return not subtrees or topic.startswith(tuple(subtrees))


# --- parsing -----------------------------------------------------------------------------------


def _event(
    frames: Sequence[bytes], limits: Limits, *, from_server: bool, times: EventTimes = _UNCOUNTED
) -> Event:
    if len(frames) != 6:
        raise EventBusError(f"{len(frames)} frames, an event has 6", reason="frame_count")
    topic_b, seq_b, producer_b, ts_b, uuid_b, data = frames
    topic = _text(topic_b, limits.max_topic_bytes, "bad_topic", "topic")
    if not topic.startswith("/"):
        raise EventBusError("a topic must start with '/'", reason="bad_topic")
    sequence = _sequence(seq_b, empty_ok=not from_server)
    producer = _text(producer_b, limits.max_producer_bytes, "bad_producer", "producer")
    if len(ts_b) > 64:
        raise EventBusError("timestamp longer than 64 bytes", reason="bad_timestamp")
    try:
        timestamp = ts_b.decode("ascii")
    except UnicodeDecodeError:
        raise EventBusError("timestamp is not ASCII", reason="bad_timestamp") from None
    ts_ns = parse_timestamp(timestamp, times)
    if len(uuid_b) != 36 or _UUID4.fullmatch(uuid_b) is None:
        raise EventBusError("event UUID is not an RFC 4122 v4 UUID", reason="bad_uuid")
    if len(data) > limits.max_data_bytes:
        raise EventBusError(
            f"data is {len(data)} bytes, at most {limits.max_data_bytes}", reason="too_large"
        )
    if data:
        _check_msgpack(data)
    elif not from_server:
        data = _NIL
    return Event(topic, sequence, producer, timestamp, uuid_b.decode().lower(), data, ts_ns)


def parse_pub(
    frames: Sequence[bytes], limits: Limits = DEFAULT_LIMITS, times: EventTimes = _UNCOUNTED
) -> Event:
    """A PUB command from the COLLECTOR (identity frame already removed).

    Every frame is validated; the producer's sequence may be empty or decimal text. A
    timestamp the journal cannot hold leaves ``ts_ns`` 0 and is counted in ``times``.
    Raises :class:`EventBusError`.
    """
    return _event(frames, limits, from_server=False, times=times)


def parse_broadcast(frames: Sequence[bytes], limits: Limits = DEFAULT_LIMITS) -> Event | Heartbeat:
    """A BROADCAST from the PUBLISHER: an event, or a HUGZ heartbeat."""
    if len(frames) == 6 and frames[0] == HUGZ_TOPIC:
        sequence = _sequence(frames[1], empty_ok=False)
        state, synced = 0, False
        acks: tuple[tuple[str, int], ...] = ()
        try:
            info = msgpack.unpackb(frames[5], raw=False) if frames[5] else {}
        except Exception:
            info = {}
        if isinstance(info, dict):
            raw_state = info.get("state", 0)
            state = raw_state if isinstance(raw_state, int) else 0
            synced = bool(info.get("synced", False))
            acks = _acks(info.get("acks"))
        producer = frames[2].decode("utf-8", "replace")
        timestamp = frames[3].decode("ascii", "replace")
        return Heartbeat(sequence, producer, timestamp, state, synced, acks)
    return _event(frames, limits, from_server=True)


def _acks(value: object) -> tuple[tuple[str, int], ...]:
    """The well-formed [uuid, sequence] pairs of a HUGZ (anything else is ignored)."""
    if not isinstance(value, list):
        return ()
    return tuple(
        (pair[0], pair[1])
        for pair in value
        if isinstance(pair, list)
        and len(pair) == 2
        and isinstance(pair[0], str)
        and isinstance(pair[1], int)
    )


def parse_syncstart(frames: Sequence[bytes], limits: Limits = DEFAULT_LIMITS) -> SyncStart:
    """SYNCSTART on the SNAPSHOT port. Two frames (no sequence: 0) are accepted too."""
    if len(frames) not in (2, 3):
        raise EventBusError(f"{len(frames)} frames, SYNCSTART has 3", reason="frame_count")
    if frames[0] != Command.SYNCSTART.value:
        raise EventBusError("not a SYNCSTART command", reason="bad_command")
    subtrees = parse_subtrees(frames[1], limits)
    sequence = _sequence(frames[2], empty_ok=True) if len(frames) == 3 else 0
    return SyncStart(subtrees, sequence)


def parse_snapshot_reply(
    frames: Sequence[bytes], limits: Limits = DEFAULT_LIMITS
) -> Event | SyncEnd:
    """What a client reads from its SNAPSHOT connection: a SYNC event or the SYNCEND."""
    if not frames:
        raise EventBusError("empty message", reason="frame_count")
    if frames[0] == Command.SYNC.value:
        return _event(frames[1:], limits, from_server=True)
    if frames[0] == Command.SYNCEND.value:
        if len(frames) != 3:
            raise EventBusError(f"{len(frames)} frames, SYNCEND has 3", reason="frame_count")
        return SyncEnd(parse_subtrees(frames[1], limits), _sequence(frames[2], empty_ok=False))
    raise EventBusError("not a SYNC or SYNCEND command", reason="bad_command")


# --- serializing -------------------------------------------------------------------------------


def broadcast_frames(event: Event) -> list[bytes]:
    """BROADCAST: the event's six frames."""
    return event.frames()


def pub_frames(event: Event) -> list[bytes]:
    """PUB: the same six frames as BROADCAST; the sequence is the producer's own."""
    return event.frames()


def sync_frames(event: Event) -> list[bytes]:
    return [Command.SYNC.value, *event.frames()]


def syncstart_frames(subtrees: Sequence[str] = (), sequence: int = 0) -> list[bytes]:
    return [Command.SYNCSTART.value, format_subtrees(subtrees), SEQUENCE.pack(sequence)]


def syncend_frames(subtrees: Sequence[str], sequence: int) -> list[bytes]:
    return [Command.SYNCEND.value, format_subtrees(subtrees), SEQUENCE.pack(sequence)]


def hugz_frames(
    sequence: int,
    producer: str,
    timestamp: str,
    uuid: str,
    state: int,
    synced: bool,
    acks: Sequence[tuple[str, int]] = (),
) -> list[bytes]:
    """The heartbeat, shaped like a BROADCAST so any Clone client can read past it."""
    info: dict[str, Any] = {"state": int(state), "synced": synced}
    if acks:
        info["acks"] = [list(pair) for pair in acks]
    data = msgpack.packb(info)
    return [
        HUGZ_TOPIC,
        SEQUENCE.pack(sequence),
        producer.encode(),
        timestamp.encode(),
        uuid.encode(),
        data,
    ]


# --- replication between the two servers of a Binary Star pair ---------------------------------


def replicate_frames(events: Sequence[Event]) -> list[bytes]:
    """REPLICATE: committed events in sequence order, one MessagePack array of 9-tuples (the
    fields of :class:`Event`, ``chp`` as nil or [properties, body])."""
    body = msgpack.packb(events, use_bin_type=True)
    return [Command.REPLICATE.value, body]


def parse_replicate(frames: Sequence[bytes], limits: Limits = DEFAULT_LIMITS) -> list[Event]:
    """The events of a REPLICATE, checked for shape and strictly increasing sequence."""
    if len(frames) != 2 or frames[0] != Command.REPLICATE.value:
        raise EventBusError("not a REPLICATE command", reason="bad_command")
    try:
        rows: Any = msgpack.unpackb(frames[1], raw=False, use_list=False)
    except Exception:
        raise EventBusError("REPLICATE body is not MessagePack", reason="bad_msgpack") from None
    if not isinstance(rows, tuple):
        raise EventBusError("REPLICATE body is not an array", reason="bad_command")
    events = []
    last = -1
    for row in rows:
        if not (
            isinstance(row, tuple)
            and len(row) == 9
            and isinstance(row[0], str)
            and row[0].startswith("/")
            and isinstance(row[1], int)
            and last < row[1] <= _U64_MAX
            and isinstance(row[2], str)
            and isinstance(row[3], str)
            and isinstance(row[4], str)
            and isinstance(row[5], bytes)
            and isinstance(row[6], int)
            and (row[7] is None or _is_chp_part(row[7]))
            and isinstance(row[8], int)
        ):
            raise EventBusError("malformed REPLICATE row", reason="bad_command")
        chp_body = row[7][1] if row[7] is not None else b""
        if (
            len(row[0].encode()) > limits.max_topic_bytes
            or len(row[5]) > limits.max_data_bytes + 8  # + a msgpack bin header (CHP bodies)
            or len(chp_body) > limits.max_data_bytes
        ):
            raise EventBusError("REPLICATE row over the limits", reason="too_large")
        last = row[1]
        events.append(Event(*row))
    return events


def _is_chp_part(value: object) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], bytes)
        and isinstance(value[1], bytes)
    )


def replicated_frames(sequence: int) -> list[bytes]:
    return [Command.REPLICATED.value, SEQUENCE.pack(sequence)]


def parse_replicated(frames: Sequence[bytes]) -> int:
    if len(frames) != 2 or frames[0] != Command.REPLICATED.value or len(frames[1]) != 8:
        raise EventBusError("not a REPLICATED command", reason="bad_command")
    return int(SEQUENCE.unpack(frames[1])[0])
