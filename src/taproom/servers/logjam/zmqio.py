"""The pyzmq calls the logjam loops make per frame, made cheap, and the helpers they share.

pyzmq's Socket.send is a Python wrapper (routing ids, groups) around the Cython send; the hot
loops call the Cython method directly, which halves the cost of a frame (DESIGN.md decision 3).
pyzmq's IntFlag constants cost an __index__ call per use, so the loops use plain ints.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import zmq
import zmq.asyncio
import zmq.backend

__all__ = [
    "NOBLOCK",
    "RCVMORE",
    "SNDMORE",
    "RcvMore",
    "raw_send",
    "rcvmore_reader",
    "readable",
    "recv_message",
]

# routing id + empty delimiter + four frames; anything longer is refused without keeping it.
MAX_FRAMES = 6

raw_send = zmq.backend.Socket.send
NOBLOCK = int(zmq.NOBLOCK)
SNDMORE = int(zmq.SNDMORE)
RCVMORE = int(zmq.RCVMORE)
_ZMQ_TYPE = int(zmq.TYPE)


def _libzmq() -> Any:
    """pyzmq's own libzmq through cffi (ABI mode), or None.

    Why: a frame's "more" flag is the one thing the ingest loops need per frame, and pyzmq
    makes it expensive: ``getsockopt(RCVMORE)`` builds a SocketOption enum (~1.5 us) and
    ``recv(copy=False)`` builds a Frame object (~1 us). ``zmq_getsockopt`` through cffi is
    ~0.5 us. The library must be the very one pyzmq loaded (the socket handle is a pointer
    into it), so it is found in this process's memory map; with no cffi, no /proc, or any
    doubt, the loops use pyzmq's getsockopt (slower, same results).
    """
    try:
        import cffi  # installed with cryptography (a dependency); optional here
    except ImportError:
        return None
    paths = set()
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            for line in maps:
                name = line.rsplit(None, 1)[-1]
                if os.path.basename(name).startswith("libzmq"):
                    paths.add(name)
    except OSError:
        return None
    if len(paths) != 1:
        return None
    ffi = cffi.FFI()
    ffi.cdef("int zmq_getsockopt(void *s, int option, void *optval, size_t *optvallen);")
    try:
        return ffi, ffi.dlopen(paths.pop())
    except OSError:
        return None


_LIBZMQ: Any = None
_LIBZMQ_LOADED = False


class RcvMore(NamedTuple):
    """ZMQRCVMORE of one socket, for the ingest loops: they call
    ``getsockopt(handle, RCVMORE, flag, size)`` inline and read ``flag[0]`` (a Python call
    fewer per frame than calling this object, which does the same)."""

    getsockopt: Callable[[Any, int, Any, Any], int]
    handle: Any
    flag: Any  # cffi int* or a one-item list: flag[0] is the answer
    size: Any
    fast: bool  # zmq_getsockopt through cffi; False: pyzmq's getsockopt

    def __call__(self) -> int:
        self.getsockopt(self.handle, RCVMORE, self.flag, self.size)
        return int(self.flag[0])


def rcvmore_reader(sock: zmq.Socket[bytes]) -> RcvMore:
    """The cheapest way to read ZMQRCVMORE of ``sock`` after each recv."""
    global _LIBZMQ, _LIBZMQ_LOADED
    if not _LIBZMQ_LOADED:
        _LIBZMQ, _LIBZMQ_LOADED = _libzmq(), True

    def pyzmq_getsockopt(_handle: Any, option: int, out: list[int], _size: Any) -> int:
        out[0] = int(sock.get(option))
        return 0

    slow = RcvMore(pyzmq_getsockopt, None, [0], None, False)
    if _LIBZMQ is None:
        return slow
    ffi, lib = _LIBZMQ
    fast = RcvMore(
        lib.zmq_getsockopt,
        ffi.cast("void *", sock.underlying),
        ffi.new("int *"),
        ffi.new("size_t *", ffi.sizeof("int")),
        True,
    )
    # The same socket seen both ways, or the slow path: the handle must be pyzmq's.
    kind = ffi.new("int *")
    if (
        lib.zmq_getsockopt(fast.handle, _ZMQ_TYPE, kind, ffi.new("size_t *", ffi.sizeof("int")))
        != 0
        or kind[0] != sock.get(_ZMQ_TYPE)
        or fast() != slow()
    ):
        return slow
    return fast


def recv_message(sock: zmq.Socket) -> tuple[list[bytes], bool]:
    """One multipart message without blocking; frames past the bound are read and dropped."""
    frames = [sock.recv(zmq.NOBLOCK)]
    overflow = False
    while sock.get(zmq.RCVMORE):
        frame = sock.recv()
        if len(frames) < MAX_FRAMES:
            frames.append(frame)
        else:
            overflow = True
    return frames, overflow


async def readable(asock: zmq.asyncio.Socket, sock: zmq.Socket) -> None:
    """Return when ``sock`` has input. ZMQ_FD is edge-triggered and replies sent on the
    same socket (acks) can consume the edge, so the wait re-checks every 100 ms."""
    while not int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
        await asock.poll(100, zmq.POLLIN)  # type: ignore[call-arg]
