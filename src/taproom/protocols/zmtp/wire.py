"""ZMTP 3.x on the wire: the greeting, frames, commands and metadata (rfc.zeromq.org 23/ZMTP
and 37/ZMTP, "3.1"), and the frame scanner the transport runs over its receive buffer.

Everything here is bytes in, values out; no I/O, no clock. The scanner is the pure-Python
twin of ``zt_scan`` / ``zt_take`` in ``taproom/zmqburst/burst.c``: both walk frame headers in
a connection's buffer where the bytes landed, check every size against the bounds *before*
the body is read (a message over its bound is refused at the header that takes it past), and
hand out whole messages only. The tests run both on the same inputs.
"""

from __future__ import annotations

import struct
from enum import IntEnum, IntFlag
from typing import NamedTuple

from ...errors import ProtocolError

__all__ = [
    "COMPATIBLE",
    "GREETING_SIZE",
    "SIGNATURE_SIZE",
    "Flag",
    "Greeting",
    "Scan",
    "ScanStatus",
    "ZmtpError",
    "command_body",
    "encode_command",
    "encode_frame",
    "encode_message",
    "encode_metadata",
    "error_command",
    "parse_command",
    "parse_metadata",
    "ping_command",
    "pong_command",
    "scan",
    "subscribe_message",
    "take",
]


class ZmtpError(ProtocolError):
    """A peer broke ZMTP or one of the transport's bounds; ``reason`` is the metric label.
    ZMTP's own reply to a broken peer is to close the connection (after an ERROR command
    during the handshake, where the peer can read it)."""


class Flag(IntFlag):
    """The flags octet of a frame (23/ZMTP "Framing")."""

    MORE = 0x01  # "more frames to follow"
    LONG = 0x02  # "the frame size is encoded as a 64-bit unsigned integer in network order"
    COMMAND = 0x04  # "the frame is a command frame" (ZMTP 3.0)


class Version(IntEnum):
    """Minor versions of ZMTP 3 taproom speaks: 3.1 adds PING/PONG and SUBSCRIBE/CANCEL
    commands; a 3.0 peer gets subscriptions as messages and no pings."""

    ZMTP_3_0 = 0
    ZMTP_3_1 = 1


# the flags as plain ints for the scanner's loops: IntFlag operators cost a call each
_F_MORE, _F_LONG, _F_COMMAND = int(Flag.MORE), int(Flag.LONG), int(Flag.COMMAND)

SIGNATURE_SIZE = 10  # %xFF padding(8) %x7F: enough to tell ZMTP 2+ from ZMTP 1.0
GREETING_SIZE = 64  # signature, version (2), mechanism (20), as-server (1), filler (31)
_LONG = struct.Struct(">Q")


class Greeting(NamedTuple):
    """The 64-byte greeting (23/ZMTP "Greeting")."""

    major: int
    minor: int
    mechanism: bytes  # "NULL", "PLAIN", "CURVE" (null padding removed)
    as_server: bool

    def serialize(self) -> bytes:
        # libzmq puts its routing-id length + 1 in the padding (a ZMTP 1.0 leftover); the spec
        # says the padding is anything, so zeros.
        return (
            b"\xff" + bytes(8) + b"\x7f"
            + bytes((self.major, self.minor))
            + self.mechanism.ljust(20, b"\x00")
            + (b"\x01" if self.as_server else b"\x00")
            + bytes(31)
        )  # fmt: skip

    @classmethod
    def parse(cls, data: bytes) -> Greeting:
        """A whole greeting; raises ZmtpError when it is not ZMTP 3 or later."""
        if len(data) < GREETING_SIZE:
            raise ZmtpError("short greeting", reason="bad_greeting")
        check_signature(data[:SIGNATURE_SIZE])
        major, minor = data[10], data[11]
        if major < 3:
            # ZMTP 2.0 (libzmq 3.x) and older: nothing taproom serves has spoken them in ten
            # years; libzmq downgrades for them, taproom refuses (docs/compat.md).
            raise ZmtpError(f"ZMTP {major}.{minor} is not supported", reason="bad_version")
        mechanism = bytes(data[12:32]).rstrip(b"\x00")
        return cls(major, minor, mechanism, data[32] == 1)


def check_signature(signature: bytes) -> None:
    """The first ten bytes: ZMTP 1.0 sent a length there instead (no 0xFF / 0x7F)."""
    if signature[0] != 0xFF or not signature[9] & 0x01:
        raise ZmtpError("not a ZMTP 2+ signature", reason="bad_greeting")


# --- frames and commands -----------------------------------------------------------------------


def encode_frame(body: bytes, flags: int = 0) -> bytes:
    """One frame: flags, a short (1 octet) or long (8 octets) size, the body."""
    size = len(body)
    if size < 256:
        return bytes((flags, size)) + body
    return bytes((flags | Flag.LONG,)) + _LONG.pack(size) + body


def encode_message(frames: list[bytes] | tuple[bytes, ...]) -> bytes:
    """A whole multi-part message: MORE on every frame but the last."""
    last = len(frames) - 1
    return b"".join(encode_frame(f, Flag.MORE if i < last else 0) for i, f in enumerate(frames))


def command_body(name: bytes, data: bytes = b"") -> bytes:
    return bytes((len(name),)) + name + data


def encode_command(name: bytes, data: bytes = b"") -> bytes:
    """A command frame: name length, name, data (23/ZMTP "Commands")."""
    return encode_frame(command_body(name, data), Flag.COMMAND)


def parse_command(body: bytes | memoryview) -> tuple[bytes, bytes]:
    """(name, data) of a command frame's body."""
    if not body or len(body) < 1 + body[0]:
        raise ZmtpError("malformed command", reason="bad_command")
    n = body[0]
    return bytes(body[1 : 1 + n]), bytes(body[1 + n :])


def encode_metadata(properties: dict[bytes, bytes]) -> bytes:
    """READY / INITIATE metadata: name (1-octet length) then value (4-octet length)."""
    out = bytearray()
    for name, value in properties.items():
        out += bytes((len(name),)) + name + len(value).to_bytes(4, "big") + value
    return bytes(out)


def parse_metadata(data: bytes) -> dict[bytes, bytes]:
    """Metadata properties, names lower-cased (23/ZMTP: names are case-insensitive)."""
    props: dict[bytes, bytes] = {}
    pos, end = 0, len(data)
    while pos < end:
        n = data[pos]
        if n == 0 or pos + 1 + n + 4 > end:
            raise ZmtpError("malformed metadata", reason="bad_metadata")
        name = data[pos + 1 : pos + 1 + n].lower()
        size = int.from_bytes(data[pos + 1 + n : pos + 5 + n], "big")
        pos += 5 + n
        if pos + size > end:
            raise ZmtpError("malformed metadata", reason="bad_metadata")
        props[name] = data[pos : pos + size]
        pos += size
    return props


def error_command(reason: str) -> bytes:
    """ERROR: the reason a peer is about to be disconnected (at most 255 octets)."""
    text = reason.encode()[:255]
    return encode_command(b"ERROR", bytes((len(text),)) + text)


def ping_command(ttl_deciseconds: int, context: bytes) -> bytes:
    """PING (ZMTP 3.1): a TTL in tenths of a second, and up to 16 octets of context."""
    return encode_command(b"PING", ttl_deciseconds.to_bytes(2, "big") + context[:16])


def pong_command(ping_data: bytes) -> bytes:
    """PONG answering a PING's data (its TTL, then the context PONG echoes)."""
    return encode_command(b"PONG", ping_data[2:18])


def subscribe_message(topic: bytes, minor: int, *, cancel: bool = False) -> bytes:
    """A subscription as the peer's ZMTP minor version wants it: a SUBSCRIBE / CANCEL command
    for 3.1, a message whose first octet is 1 (subscribe) or 0 (cancel) for 3.0."""
    if minor >= Version.ZMTP_3_1:
        return encode_command(b"CANCEL" if cancel else b"SUBSCRIBE", topic)
    return encode_frame((b"\x00" if cancel else b"\x01") + topic)


# Which peer socket types each socket type talks to (23/ZMTP "The Socket Type property";
# libzmq's mechanism_t::check_socket_type); X-sockets as their plain forms.
COMPATIBLE: dict[bytes, frozenset[bytes]] = {
    b"REQ": frozenset({b"REP", b"ROUTER"}),
    b"REP": frozenset({b"REQ", b"DEALER"}),
    b"DEALER": frozenset({b"REP", b"DEALER", b"ROUTER"}),
    b"ROUTER": frozenset({b"REQ", b"DEALER", b"ROUTER"}),
    b"PUB": frozenset({b"SUB", b"XSUB"}),
    b"XPUB": frozenset({b"SUB", b"XSUB"}),
    b"SUB": frozenset({b"PUB", b"XPUB"}),
    b"XSUB": frozenset({b"PUB", b"XPUB"}),
    b"PUSH": frozenset({b"PULL"}),
    b"PULL": frozenset({b"PUSH"}),
    b"PAIR": frozenset({b"PAIR"}),
}


# --- the scanner ------------------------------------------------------------------------------


class ScanStatus(IntEnum):
    """Why :func:`scan` stopped."""

    NEED = 0  # the bytes end inside a frame (or its header): read more
    COMMAND = 1  # a command frame is whole at ``Scan.pos``: handle it, scan on after it
    TOO_LARGE = 2  # the message being received would pass ``max_message``
    BAD_COMMAND = 3  # a command over ``max_command``, or flagged MORE


class Scan(NamedTuple):
    """What :func:`scan` found.

    ``pos``: where it stopped (at a command: the command's header). ``complete``: the end of
    the last whole message (every byte before it belongs to whole messages or commands).
    ``messages``: whole messages completed by this call. ``partial``: wire bytes of the message
    in progress (frames so far, commands excluded). ``want``: with NEED, the end of the frame
    it stopped in, when its header is whole (else ``pos`` + 9), so the caller knows what room
    that frame needs. ``body``/``size``: with COMMAND, where its body starts and its size.
    """

    status: ScanStatus
    pos: int
    complete: int
    messages: int
    partial: int
    want: int
    body: int
    size: int


def scan(
    buf: bytes | bytearray | memoryview,
    pos: int,
    end: int,
    complete: int,
    partial: int,
    max_message: int,
    max_command: int,
) -> Scan:
    """Walk frame headers in ``buf[pos:end]``; ``complete`` and ``partial`` carry on from the
    previous call. Only headers are read: a frame's body is skipped by its size, and a size
    that would take the message past ``max_message`` wire bytes stops the walk at once
    (TOO_LARGE) -- before the caller makes room for it."""
    messages = 0
    while True:
        if end - pos < 2:
            return Scan(ScanStatus.NEED, pos, complete, messages, partial, pos + 9, 0, 0)
        flags = buf[pos]
        if flags & _F_LONG:
            if end - pos < 9:
                return Scan(ScanStatus.NEED, pos, complete, messages, partial, pos + 9, 0, 0)
            size = _LONG.unpack_from(buf, pos + 1)[0]
            head = 9
        else:
            size = buf[pos + 1]
            head = 2
        if flags & _F_COMMAND:
            if size > max_command or flags & _F_MORE:
                return Scan(ScanStatus.BAD_COMMAND, pos, complete, messages, partial, 0, 0, size)
            if end - pos - head < size:
                want = pos + head + size
                return Scan(ScanStatus.NEED, pos, complete, messages, partial, want, 0, 0)
            return Scan(ScanStatus.COMMAND, pos, complete, messages, partial, 0, pos + head, size)
        if partial + head + size > max_message:
            return Scan(ScanStatus.TOO_LARGE, pos, complete, messages, partial, 0, 0, size)
        if end - pos - head < size:
            want = pos + head + size
            return Scan(ScanStatus.NEED, pos, complete, messages, partial, want, 0, 0)
        pos += head + size
        if flags & _F_MORE:
            partial += head + size
        else:
            complete = pos
            partial = 0
            messages += 1


def take(
    buf: bytes | bytearray | memoryview,
    pos: int,
    complete: int,
    max_messages: int,
    max_frames: int,
    max_bytes: int,
    prefix: bytes | None,
) -> tuple[int, list[tuple[int, list[bytes]]], int]:
    """Whole messages from ``buf[pos:complete]`` (scanned already, so well formed), skipping
    commands: (the position after the last one taken, [(true frame count, kept frames)], bytes
    kept). ``prefix`` (a ROUTER's routing id) goes first in every message, as libzmq's ROUTER
    delivers it; at most ``max_frames`` frames are kept, the rest counted and dropped. Stops
    after ``max_messages`` or once the kept bytes reach ``max_bytes``."""
    out: list[tuple[int, list[bytes]]] = []
    size = 0
    head = [prefix] if prefix is not None else []
    frames, count, kept = list(head), len(head), sum(map(len, head))
    started = False  # a frame of the next message was walked
    base = pos
    data = bytes(buf[pos:complete])  # one copy; frames are slices of it
    pos, end, mark = 0, complete - base, 0
    long_size = _LONG.unpack_from
    while pos < end and len(out) < max_messages and size < max_bytes:
        flags = data[pos]
        if flags & _F_LONG:
            n = long_size(data, pos + 1)[0]
            pos += 9
        else:
            n = data[pos + 1]
            pos += 2
        if flags & _F_COMMAND:
            pos += n
            if not started:
                mark = pos  # a command between messages is consumed with them
            continue
        started = True
        count += 1
        if count <= max_frames:
            frames.append(data[pos : pos + n])
            kept += n
        pos += n
        if not flags & _F_MORE:
            out.append((count, frames))
            size += kept
            mark = pos
            frames, count, kept = list(head), len(head), sum(map(len, head))
            started = False
    return base + mark, out, size
