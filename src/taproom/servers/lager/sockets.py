"""pyzmq helpers shared by the registrar and the forwarder: binding ports at offsets from a
base (nasa/lager's layout; libzmq sockets and taproom's own, servers.zmtp, alike), and cheap
NOBLOCK sends and receives for the hot paths."""

from __future__ import annotations

import contextlib
import errno
from typing import Any

import zmq
import zmq.asyncio
import zmq.backend

from ..zmtp import ZmtpPublisher, ZmtpSocket

__all__ = [
    "MORE_NOBLOCK",
    "NOBLOCK",
    "Bindable",
    "bind_offsets",
    "endpoint",
    "raw_send",
    "readable",
    "recv_bounded",
    "send",
]


def endpoint(host: str, port: int | str) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


Bindable = zmq.asyncio.Socket | ZmtpSocket | ZmtpPublisher


async def _bind(sock: Bindable, host: str, port: int) -> tuple[int, str]:
    """(the port bound, what unbinds it); ``port`` 0: any free one."""
    if isinstance(sock, ZmtpSocket | ZmtpPublisher):
        await sock.bind(host, port)
        return sock.port, ""
    sock.bind(endpoint(host, port or "*"))
    address = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(address, bytes)
    return int(address.decode().rsplit(":", 1)[1]), address.decode()


def _unbind(sock: Bindable, address: str) -> None:
    if isinstance(sock, ZmtpSocket | ZmtpPublisher):
        sock.close()  # bound again on the next try
    else:
        with contextlib.suppress(zmq.ZMQError):
            sock.unbind(address)


async def bind_offsets(
    placed: list[tuple[Bindable, int]], host: str, port: int, retries: int
) -> int:
    """Bind each socket to ``port + offset`` (the first one's offset is 0). With ``port`` 0 the
    first binds to any free port and the rest follow it, retried from a new base when one of
    them is taken. Returns the base port."""
    if port:
        for sock, offset in placed:
            await _bind(sock, host, port + offset)
        return port
    last: Exception | None = None
    highest = max(offset for _, offset in placed)
    for _ in range(retries):
        bound: list[tuple[Bindable, str]] = []
        try:
            base, address = await _bind(placed[0][0], host, 0)
            bound.append((placed[0][0], address))
            if base + highest > 65535:
                raise OSError(errno.EADDRINUSE, "past the last port")
            for sock, offset in placed[1:]:
                _, address = await _bind(sock, host, base + offset)
                bound.append((sock, address))
            return base
        except (zmq.ZMQError, OSError) as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            last = exc
            for sock, address in bound:
                _unbind(sock, address)
    raise OSError(errno.EADDRINUSE, f"no free ports at offsets up to {highest}: {last}")


# Hot paths call the backend socket methods with plain ints: pyzmq's Python-level wrappers and
# its IntFlag constants cost more than the ZeroMQ call itself (measured ~2x per frame).
NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
MORE_NOBLOCK = NOBLOCK | _SNDMORE
_raw_recv = zmq.backend.Socket.recv
raw_send = zmq.backend.Socket.send
_raw_get = zmq.backend.Socket.get


def recv_bounded(sock: zmq.Socket[bytes], max_frames: int) -> list[bytes] | None:
    """One whole message (NOBLOCK; raises zmq.Again); None if it had more than ``max_frames``
    frames (the rest is read and discarded so the next message starts clean)."""
    frames = [_raw_recv(sock, NOBLOCK)]
    while _raw_get(sock, _RCVMORE):
        frame = _raw_recv(sock, 0)
        if len(frames) < max_frames:
            frames.append(frame)
        else:
            frames = [b""] * (max_frames + 1)
    return None if len(frames) > max_frames else frames


def readable(sock: zmq.Socket[bytes]) -> bool:
    events: Any = sock.getsockopt(zmq.EVENTS)
    return bool(events & zmq.POLLIN)


def send(sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, zmq.NOBLOCK | zmq.SNDMORE if i < last else zmq.NOBLOCK)
