"""Receiving one whole ZeroMQ message cheaply in Python, for hot paths on both sides (servers,
clients) and for the pure-Python path of :mod:`taproom.zmqburst`.

pyzmq's Python-level wrappers and IntFlag constants cost more than the ZeroMQ call itself, and
``getsockopt(RCVMORE)`` builds an enum on every call. Reading frames uncopied through the
backend socket and asking each frame for its ``more`` flag costs about a third of that.
"""

from __future__ import annotations

from typing import Any

import zmq

__all__ = ["recv_counted", "recv_frames"]

_NOBLOCK = int(zmq.NOBLOCK)
_raw_recv = zmq.backend.Socket.recv


def recv_counted(sock: zmq.Socket[bytes], max_frames: int) -> tuple[int, list[bytes]]:
    """One whole message, NOBLOCK (raises ``zmq.Again`` when none is queued): its true frame
    count and its first ``max_frames`` frames (the rest is read and dropped, never kept)."""
    frame: Any = _raw_recv(sock, _NOBLOCK, False)
    frames = [frame.bytes]
    count = 1
    while frame.more:
        frame = _raw_recv(sock, 0, False)
        count += 1
        if count <= max_frames:
            frames.append(frame.bytes)
    return count, frames


def recv_frames(sock: zmq.Socket[bytes], max_frames: int) -> list[bytes] | None:
    """One whole message, NOBLOCK (raises ``zmq.Again`` when none is queued); None when it has
    more than ``max_frames`` frames (the rest is read and dropped, never kept)."""
    count, frames = recv_counted(sock, max_frames)
    return None if count > max_frames else frames
