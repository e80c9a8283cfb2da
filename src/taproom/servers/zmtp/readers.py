"""Burst readers of a :class:`~taproom.servers.zmtp.transport.ZmtpSocket`: whole messages out
of its peers' buffers, in :mod:`taproom.zmqburst`'s ``Burst`` shapes (frame lists in Python;
one buffer plus frame offsets from ``zt_take`` in C, which the compiled kernels read)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ... import zmqburst
from ...protocols import zmtp as zp

if TYPE_CHECKING:
    from .connection import Connection
    from .transport import ZmtpSocket

__all__ = ["ExtReader", "PyReader"]

_TAKEN_FULL = 3  # zt_take: the next message does not fit the burst's buffers


def _ready_connections(sock: ZmtpSocket) -> Iterator[Connection]:
    """The connections with whole messages, each once, oldest first (a connection left with
    messages after its turn goes to the back: peers are served in turn)."""
    ready = sock._ready
    for _ in range(len(ready)):
        if not ready:
            return
        conn = ready[0]
        ready.rotate(-1)  # its turn is taken: behind the others if messages remain
        yield conn


class PyReader:
    def __init__(self, sock: ZmtpSocket, max_frames: int) -> None:
        self.sock = sock
        self.max_frames = max_frames

    def recv(self, max_messages: int, max_bytes: int) -> zmqburst.Burst:
        messages: list[tuple[int, list[bytes]]] = []
        size = 0
        for conn in _ready_connections(self.sock):
            if len(messages) >= max_messages or size >= max_bytes:
                break
            assert conn.buf is not None
            mark, taken, n = zp.take(
                conn.buf,
                conn.start,
                conn.complete,
                max_messages - len(messages),
                self.max_frames,
                max_bytes - size,
                conn.prefix,
            )
            messages += taken
            size += n
            conn.consumed(mark)
        return zmqburst._PyBurst(messages, size)


class ExtReader:
    """Bursts in the compiled shape (taproom.zmqburst._ExtBurst: buf, frame_end, counts)."""

    def __init__(self, sock: ZmtpSocket, max_frames: int) -> None:
        self.sock = sock
        self.max_frames = max_frames
        self._ffi, self._lib = sock._ffi, sock._lib
        self._taken = self._ffi.new("zt_taken *")
        self._messages = self._frames = self._cap = 0
        self.buf: Any = None
        self.frame_end: Any = None
        self.counts: Any = None

    def _size(self, max_messages: int, cap: int, frames: int) -> None:
        if max_messages > self._messages:
            self.counts = zmqburst.buffer("int[]", max_messages)
            self._messages = max_messages
        if frames > self._frames:
            self.frame_end = zmqburst.buffer("size_t[]", frames)
            self._frames = frames
        if cap != self._cap:
            self.buf = zmqburst.buffer("char[]", cap)
            self._cap = cap

    def recv(self, max_messages: int, max_bytes: int) -> zmqburst.Burst:
        base = max(min(max_bytes, 1 << 24), 1 << 20)
        frames = min(max_messages * self.max_frames, 8 * max_messages + self.max_frames)
        self._size(max_messages, base if self._cap > 2 * base or self._cap < base else self._cap,
                   frames)  # fmt: skip
        res = self._taken
        res.messages = res.frames = res.bytes = 0
        take = self._lib.zt_take
        null = self._ffi.NULL
        for conn in _ready_connections(self.sock):
            prefix = conn.prefix
            while True:
                take(
                    conn.cbuf,
                    conn.start,
                    conn.complete,
                    prefix if prefix is not None else null,
                    len(prefix) if prefix is not None else 0,
                    self.max_frames,
                    max_messages,
                    max_bytes,
                    self.buf,
                    self._cap,
                    self.frame_end,
                    self._frames,
                    self.counts,
                    res,
                )
                if (
                    res.status == _TAKEN_FULL and res.messages == 0
                ):  # one message bigger than the buffers
                    self._size(max_messages, max(res.need, 2 * self._cap),
                               max(self._frames, res.need_frames))  # fmt: skip
                    continue
                break
            conn.consumed(res.pos)
            if res.status != 0:
                break
        return zmqburst._ExtBurst(self, res.messages, res.frames, res.bytes)  # type: ignore[arg-type]
