"""The accepting side of a ZMTP 3 connection, from the first byte to READY.

taproom only binds: every peer connects to it. :class:`Handshake` takes the bytes a peer
sends (``receive_data``), returns the bytes to send back, and ends with the peer's
:class:`Peer` (socket type, identity, ZMTP minor version) once both READY commands are
exchanged. Everything it holds is bounded by ``max_bytes`` (greeting + the peer's READY); the
mechanism is NULL, or CURVE through a :class:`Mechanism` the caller hands in
(``protocols/zmtp/curve.py``).

Order of events, as libzmq peers expect it: our whole greeting goes out at once (a libzmq
peer sends its signature first and waits for ours; it takes a whole greeting as well), the
peer's greeting is checked (ZMTP 3.x, the same mechanism), then the mechanism's commands;
for NULL, our READY and theirs, in either order.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from .wire import (
    COMPATIBLE,
    GREETING_SIZE,
    SIGNATURE_SIZE,
    Flag,
    Greeting,
    ZmtpError,
    check_signature,
    encode_command,
    encode_metadata,
    parse_command,
    parse_metadata,
)

__all__ = ["Handshake", "Mechanism", "Peer", "read_command"]


class Peer(NamedTuple):
    """What the handshake learned about the peer."""

    socket_type: bytes
    identity: bytes  # its Identity property (a ROUTER may route by it), b"" when none
    minor: int  # ZMTP 3.<minor>: 1 and later have PING/PONG and SUBSCRIBE commands
    metadata: dict[bytes, bytes]
    client_key: bytes = b""  # CURVE: the peer's long-term public key


class Mechanism(Protocol):
    """A security mechanism's server side after the greetings (NULL is built in)."""

    name: bytes

    def command(self, name: bytes, data: bytes) -> tuple[bytes, bool]:
        """One command from the peer: (bytes to send, True once the peer's READY / INITIATE
        with its metadata was taken). Raises ZmtpError."""
        ...

    def metadata(self) -> dict[bytes, bytes]:
        """The peer's metadata, once done."""
        ...

    def client_key(self) -> bytes: ...


def read_command(buf: bytearray, max_bytes: int) -> tuple[bytes, bytes, int] | None:
    """A whole command frame at the start of ``buf``: (name, data, its wire size), or None
    when more bytes are needed. A data frame or an oversized one is an error."""
    if len(buf) < 2:
        return None
    flags = buf[0]
    if not flags & Flag.COMMAND or flags & Flag.MORE:
        raise ZmtpError("a message before the handshake ended", reason="bad_handshake")
    if flags & Flag.LONG:
        if len(buf) < 9:
            return None
        size, head = int.from_bytes(buf[1:9], "big"), 9
    else:
        size, head = buf[1], 2
    if size > max_bytes:
        raise ZmtpError(f"a {size}-byte handshake command", reason="handshake_too_large")
    if len(buf) < head + size:
        return None
    name, data = parse_command(memoryview(buf)[head : head + size])
    return name, data, head + size


class _Null:
    """NULL (23/ZMTP "The NULL Security Mechanism"): READY both ways, no secrets."""

    name = b"NULL"

    def __init__(self, ready: bytes) -> None:
        self._ready = ready
        self._metadata: dict[bytes, bytes] = {}

    def start(self) -> bytes:
        return self._ready

    def command(self, name: bytes, data: bytes) -> tuple[bytes, bool]:
        if name == b"ERROR":
            raise ZmtpError("the peer sent ERROR", reason="peer_error")
        if name != b"READY":
            raise ZmtpError(f"{name!r} where READY was due", reason="bad_handshake")
        self._metadata = parse_metadata(data)
        return b"", True

    def metadata(self) -> dict[bytes, bytes]:
        return self._metadata

    def client_key(self) -> bytes:
        return b""


class Handshake:
    """One accepted connection's handshake (see the module docstring).

    ``socket_type`` is what taproom's socket is (b"ROUTER", b"PULL", ...); ``mechanism``
    None means NULL. ``initial`` is what to send as soon as the connection is accepted.
    """

    def __init__(
        self,
        socket_type: bytes,
        *,
        max_bytes: int = 16384,
        mechanism: Mechanism | None = None,
    ) -> None:
        if socket_type not in COMPATIBLE:
            raise ValueError(f"unknown socket type {socket_type!r}")
        self.socket_type = socket_type
        self.max_bytes = max_bytes
        ready = encode_command(b"READY", encode_metadata({b"Socket-Type": socket_type}))
        self._null = _Null(ready) if mechanism is None else None
        self._mechanism: Mechanism = self._null if self._null is not None else mechanism  # type: ignore[assignment]
        self._buf = bytearray()
        self._greeted = False
        self.received = 0
        self.peer: Peer | None = None
        self.leftover = b""  # traffic that came in the same read as the peer's READY
        self.initial = Greeting(3, 1, self._mechanism.name, True).serialize()

    @property
    def done(self) -> bool:
        return self.peer is not None

    @property
    def greeted(self) -> bool:
        """The peer's greeting was read: it understands commands now (an ERROR, say)."""
        return self._greeted

    def receive_data(self, data: bytes) -> bytes:
        """Bytes from the peer; returns bytes to send. Raises ZmtpError (close the
        connection; once ``greeted``, after sending ``error_command(reason)``)."""
        if self.peer is not None:
            raise RuntimeError("the handshake is over")
        self.received += len(data)
        if self.received > self.max_bytes:
            raise ZmtpError("the handshake is too long", reason="handshake_too_large")
        buf = self._buf
        buf += data
        out = b""
        if not self._greeted:
            if len(buf) >= SIGNATURE_SIZE:
                check_signature(bytes(buf[:SIGNATURE_SIZE]))
            if len(buf) >= 11 and buf[10] < 3:
                raise ZmtpError(f"ZMTP {buf[10]}.x is not supported", reason="bad_version")
            if len(buf) < GREETING_SIZE:
                return out
            greeting = Greeting.parse(bytes(buf[:GREETING_SIZE]))
            if greeting.mechanism != self._mechanism.name:
                raise ZmtpError(
                    f"mechanism {greeting.mechanism!r}, this listener wants "
                    f"{self._mechanism.name!r}",
                    reason="mechanism",
                )
            self._greeted = True
            self._minor = greeting.minor
            del buf[:GREETING_SIZE]
            if self._null is not None:
                out += self._null.start()
        while self.peer is None:
            found = read_command(buf, self.max_bytes)
            if found is None:
                return out
            name, body, size = found
            del buf[:size]
            reply, ready = self._mechanism.command(name, body)
            out += reply
            if ready:
                self._finish()
        self.leftover = bytes(buf)
        buf.clear()
        return out

    def _finish(self) -> None:
        meta = self._mechanism.metadata()
        theirs = meta.get(b"socket-type", b"")
        if theirs not in COMPATIBLE.get(self.socket_type, ()):
            raise ZmtpError(
                f"a {theirs.decode('latin-1')!r} peer cannot talk to a {self.socket_type.decode()}",
                reason="socket_type",
            )
        self.peer = Peer(
            theirs,
            meta.get(b"identity", b""),
            self._minor,
            meta,
            self._mechanism.client_key(),
        )
