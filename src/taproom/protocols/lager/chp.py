"""Lager's registration flow: ZeroMQ CHP (Clustered Hashmap Protocol) as the seed modifies it.

Three sockets on the registrar (seed, "Registrar"): the COLLECTOR takes tap registrations
(5 frames: key, sequence, uuid, properties, value), the SNAPSHOT answers ``ICANHAZ?`` with the
matching tap descriptions and ``KTHXBAI``, the PUBLISHER sends every hashmap update as it
happens and ``HUGZ`` when idle. This module holds the frames and the hashmap
(:class:`Registrar`); the sockets live in ``servers/lager/`` and ``clients/lager/``.

Pure code: no I/O, no clock (STYLE.md rule 1).
"""

from __future__ import annotations

import re
import struct
import uuid as uuid_module
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from ...errors import ProtocolError
from ..clustered_hashmap import HUGZ, ICANHAZ, KTHXBAI, snapshot_subtree
from .formats import DEFAULT_MAX_ITEMS, DEFAULT_MAX_XML_BYTES, DataFormat, parse_format_xml

__all__ = [
    "HUGZ",
    "ICANHAZ",
    "KTHXBAI",
    "SEQUENCE",
    "ChpError",
    "Command",
    "Refused",
    "Registrar",
    "Registration",
    "Update",
    "decode_sequence",
    "encode_sequence",
    "hugz_frames",
    "kthxbai_frames",
    "parse_registration",
    "parse_snapshot_request",
    "parse_update",
    "registration_frames",
    "snapshot_request_frames",
    "valid_key",
]

# The sequence frame, as nasa/lager encodes it: its registrar memcpy()s a C++ ``double`` in the
# host's byte order, and its ClusteredHashmapClient reads one back and applies an update only
# if the number is larger than the last it saw. The seed says "8 bytes in network order" and
# the ØMQ Guide's kvmsg sends a big-endian u64; read as a little-endian double, such a
# sequence whose low byte is 0x80 or more is negative and the real client ignores the update.
# So taproom sends (and reads) the real programs' encoding: an IEEE 754 double, native order.
SEQUENCE = struct.Struct("=d")
# Integers up to 2**53 are exact in a double: far beyond any registrar's count of changes.
_MAX_SEQUENCE = 1 << 53
# Seed: 'frame 0: "ICANHAZ?"', 'a KTHXBAI message', 'send a HUGZ message at an interval of 1Hz'
# (the words the Event BUS's CHP dialect uses too: protocols/clustered_hashmap.py).
# The seed asks for "/Namespace/Tap/" keys, but nasa/lager's registrar takes any key (its own
# example is "/sample_format"), so taproom accepts what it accepts, within bounds: UTF-8, not
# empty, no control characters (a NUL or a newline in a key breaks logs, XML attributes and C
# strings), and not one of the registrar's command words, which a client would take for the
# command (a key "HUGZ" would read as a HUGZ).
_KEY = re.compile(r"^[^\x00-\x1f\x7f]+$")
_RESERVED_KEYS = frozenset(command.decode() for command in (ICANHAZ, KTHXBAI, HUGZ))
DEFAULT_MAX_KEY_BYTES = 255


def encode_sequence(sequence: int) -> bytes:
    """A registrar sequence number as nasa/lager's frame 1 (host-order double)."""
    return SEQUENCE.pack(float(sequence))


def decode_sequence(frame: bytes) -> int:
    """Frame 1 of a description, update or ``KTHXBAI``: a host-order double holding a
    non-negative integer. Raises :class:`ChpError` (``bad_sequence``) otherwise."""
    if len(frame) != SEQUENCE.size:
        raise ChpError(f"sequence frame is {len(frame)} bytes, expected 8", reason="bad_sequence")
    value = SEQUENCE.unpack(frame)[0]
    if not (0 <= value <= _MAX_SEQUENCE and value == int(value)):  # NaN fails both tests
        raise ChpError(f"sequence {value!r} is not a count", reason="bad_sequence")
    return int(value)


class Command(Enum):
    """The literal frame-0 strings of the registration flow."""

    ICANHAZ = ICANHAZ  # "represents a request to the Registrar for available Taps"
    KTHXBAI = KTHXBAI  # "indicates to the Mug that all Tap descriptions have been sent"
    HUGZ = HUGZ  # "In the absence of updates ... a HUGZ message at an interval of 1Hz"


class ChpError(ProtocolError):
    """A registration or snapshot request that breaks the seed's rules."""


def valid_key(key: str, max_bytes: int = DEFAULT_MAX_KEY_BYTES) -> bool:
    return (
        len(key.encode("utf-8")) <= max_bytes
        and bool(_KEY.match(key))
        and key not in _RESERVED_KEYS
    )


@dataclass(frozen=True, slots=True)
class Registration:
    """A tap's registration, validated: its key, uuid and data format."""

    key: str
    uuid: bytes
    value: str  # the format XML exactly as the tap sent it
    format: DataFormat
    sequence: int = 0  # assigned by the registrar when the hashmap changes

    @property
    def uuid_str(self) -> str:
        return str(uuid_module.UUID(bytes=self.uuid))

    def frames(self) -> list[bytes]:
        """The tap description / update message: key, sequence, uuid, <empty>, value."""
        return [
            self.key.encode("utf-8"),
            encode_sequence(self.sequence),
            self.uuid,
            b"",
            self.value.encode("utf-8"),
        ]

    def with_sequence(self, sequence: int) -> Registration:
        return Registration(self.key, self.uuid, self.value, self.format, sequence)


def parse_registration(
    frames: Sequence[bytes],
    *,
    max_key_bytes: int = DEFAULT_MAX_KEY_BYTES,
    max_xml_bytes: int = DEFAULT_MAX_XML_BYTES,
    max_items: int = DEFAULT_MAX_ITEMS,
) -> Registration:
    """A collector message -> :class:`Registration`. Raises :class:`ChpError` / FormatError.

    Frame 1 (sequence) "is ignored in this part of the CHP spec": any 8 bytes are accepted
    (the C++ taps send a host-order double). Frame 3 (properties) "should be an empty ZMQ
    string"; anything there is ignored.
    """
    if len(frames) != 5:
        raise ChpError(f"registration has {len(frames)} frames, expected 5", reason="frame_count")
    key_raw, seq, uuid, _properties, value = frames
    if len(key_raw) > max_key_bytes:
        raise ChpError(f"key is {len(key_raw)} bytes, at most {max_key_bytes}", reason="bad_key")
    try:
        key = bytes(key_raw).decode("utf-8")
    except UnicodeDecodeError:
        raise ChpError("key is not UTF-8", reason="bad_key") from None
    if not _KEY.match(key):
        raise ChpError(f"key {key[:64]!r} is empty or has control characters", reason="bad_key")
    if key in _RESERVED_KEYS:
        raise ChpError(f"key {key!r} is a registrar command word", reason="bad_key")
    if len(seq) != 8:
        raise ChpError(f"sequence frame is {len(seq)} bytes, expected 8", reason="bad_sequence")
    if len(uuid) != 16:
        raise ChpError(f"uuid frame is {len(uuid)} bytes, expected 16", reason="bad_uuid")
    if len(value) > max_xml_bytes:
        raise ChpError(
            f"format is {len(value)} bytes, at most {max_xml_bytes}", reason="xml_too_large"
        )
    try:
        text = bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise ChpError("format is not UTF-8", reason="xml_malformed") from None
    fmt = parse_format_xml(text, max_bytes=max_xml_bytes, max_items=max_items)
    return Registration(key, bytes(uuid), text, fmt)


def registration_frames(key: str, uuid: bytes, value: str) -> list[bytes]:
    """What a tap publishes to the collector (sequence zero, empty properties)."""
    return [key.encode("utf-8"), bytes(8), uuid, b"", value.encode("utf-8")]


def snapshot_request_frames(subtree: str = "") -> list[bytes]:
    return [ICANHAZ, subtree.encode("utf-8")]


def parse_snapshot_request(
    frames: Sequence[bytes], *, max_key_bytes: int = DEFAULT_MAX_KEY_BYTES
) -> str:
    """``ICANHAZ?`` + subtree (a missing subtree frame means the whole map)."""
    subtree = snapshot_subtree(frames)
    if subtree is None:
        raise ChpError("snapshot request is not ICANHAZ? + subtree", reason="bad_request")
    if len(subtree) > max_key_bytes:
        raise ChpError("subtree longer than any key", reason="bad_request")
    try:
        return subtree.decode("utf-8")
    except UnicodeDecodeError:
        raise ChpError("subtree is not UTF-8", reason="bad_request") from None


def kthxbai_frames(sequence: int) -> list[bytes]:
    return [KTHXBAI, encode_sequence(sequence), b"", b"", b""]


def hugz_frames() -> list[bytes]:
    # Seed: 'frame 1: 00000000, 8 bytes in network order'; also 0.0 as nasa/lager's double.
    return [HUGZ, encode_sequence(0), b"", b"", b""]


@dataclass(frozen=True, slots=True)
class Update:
    """What a mug or tap reads from the snapshot or publisher socket."""

    command: Command | None  # None: a tap description (registration)
    sequence: int
    registration: Registration | None = None


def parse_update(frames: Sequence[bytes], *, max_xml_bytes: int = DEFAULT_MAX_XML_BYTES) -> Update:
    """A tap description, ``KTHXBAI`` or ``HUGZ`` from the registrar."""
    if not frames:
        raise ChpError("empty message", reason="frame_count")
    head = bytes(frames[0])
    if head in (KTHXBAI, HUGZ):
        seq = decode_sequence(frames[1]) if len(frames) > 1 and len(frames[1]) == 8 else 0
        return Update(Command(head), seq)
    reg = parse_registration(frames, max_xml_bytes=max_xml_bytes)
    seq = decode_sequence(frames[1])
    return Update(None, seq, reg.with_sequence(seq))


class Refused(ChpError):
    """A registration the hashmap will not take (duplicate key or uuid, too many taps)."""


class Registrar:
    """The registrar's hashmap: key -> registration, with a sequence per change (CHP).

    ``check`` decides without changing anything (so the server can commit first); ``apply``
    changes the map once the registration is durable.
    """

    def __init__(self, *, max_taps: int = 100_000) -> None:
        self.max_taps = max_taps
        self.by_key: dict[str, Registration] = {}
        self.by_uuid: dict[bytes, Registration] = {}
        self.sequence = 0

    def __len__(self) -> int:
        return len(self.by_key)

    def check(self, reg: Registration, *, replacing: bytes | None = None) -> bool:
        """True when ``reg`` changes the map, False when it repeats what is there.

        Raises :class:`Refused` for "avoid duplicate Tap registration": a key held by another
        uuid (unless that uuid is ``replacing``: the key moves to ``reg``'s uuid), a uuid already
        registered under another key, or a full map.
        """
        held = self.by_key.get(reg.key)
        if held is not None and held.uuid != reg.uuid and held.uuid != replacing:
            raise Refused(f"key {reg.key!r} is registered by another tap", reason="duplicate_key")
        other = self.by_uuid.get(reg.uuid)
        if other is not None and other.key != reg.key:
            raise Refused(f"uuid already registered as {other.key!r}", reason="duplicate_uuid")
        if held is None and len(self.by_key) >= self.max_taps:
            raise Refused(f"registrar holds {self.max_taps} taps already", reason="too_many_taps")
        return held is None or held.value != reg.value or held.uuid != reg.uuid

    def apply(self, reg: Registration) -> Registration:
        """Store ``reg`` with the next sequence number and return the stored entry (a key that
        moves to a new uuid leaves its old uuid unregistered)."""
        self.sequence += 1
        stored = reg.with_sequence(self.sequence)
        old = self.by_key.get(reg.key)
        if old is not None and old.uuid != reg.uuid:
            del self.by_uuid[old.uuid]
        self.by_key[reg.key] = stored
        self.by_uuid[reg.uuid] = stored
        return stored

    def restore(self, entries: Iterable[Registration]) -> None:
        """Load persisted entries (keeping their sequences)."""
        for reg in entries:
            old = self.by_key.get(reg.key)
            if old is not None:
                self.by_uuid.pop(old.uuid, None)
            self.by_key[reg.key] = reg
            self.by_uuid[reg.uuid] = reg
            self.sequence = max(self.sequence, reg.sequence)

    def snapshot(self, subtree: str = "") -> list[Registration]:
        """Entries whose key starts with ``subtree`` (CHP subtree = key prefix), by key."""
        if not subtree:
            return [self.by_key[k] for k in sorted(self.by_key)]
        return [self.by_key[k] for k in sorted(self.by_key) if k.startswith(subtree)]

    def format_of(self, uuid: bytes) -> Registration | None:
        return self.by_uuid.get(uuid)
