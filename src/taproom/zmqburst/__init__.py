"""Whole ZeroMQ bursts per call: taproom's compiled hot path and its pure-Python twin.

pyzmq costs ~3 us per multi-part message in Python calls, more than libzmq itself. The compiled
module (``_burst``, C through cffi's API mode, built by ``pip install``; burst.c) receives
every message that is ready, up to a count and a byte budget, in one call without the GIL, into
one buffer plus frame offsets, and sends a prepared burst of multi-part messages in one call.
It calls the libzmq pyzmq loaded (looked up in the process, never linked), on the handles of
the ``zmq.Socket`` objects taproom already has.

The pure-Python twin does the same through pyzmq, message by message, with the same results.
It is used when the module is not built, cannot find pyzmq's libzmq, or ``TAPROOM_NO_EXT=1``;
tests run the ZeroMQ protocol tests on both (``select``).

A reader's :meth:`Reader.recv` returns a :class:`Burst`: ``n`` messages, their true frame
counts, and their frames (at most ``max_frames`` kept per message, the rest read and dropped).
"""

from __future__ import annotations

import os
import time
from array import array
from collections.abc import Iterator, Sequence
from itertools import accumulate, chain, pairwise
from typing import Any, Protocol

import zmq

from ..zmqframes import recv_counted

__all__ = [
    "Burst",
    "Reader",
    "Run",
    "active",
    "buffer_bytes",
    "bursts",
    "compiled",
    "drain",
    "ext_status",
    "ffi_lib",
    "reader",
    "select",
    "send_messages",
    "send_prepared",
    "send_routed",
    "uniform_run",
    "view",
    "zmtp_wire",
    "zmtp_wire_prepared",
]

_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_raw_send = zmq.backend.Socket.send

# What a reader's buffers start at; a single message bigger than this grows them for a burst.
_INITIAL_BYTES = 1 << 20


def _load() -> tuple[Any, Any, str]:
    """(ffi, lib, "") when the compiled module is usable, else (None, None, why not)."""
    if os.environ.get("TAPROOM_NO_EXT", "") not in ("", "0"):
        return None, None, "TAPROOM_NO_EXT is set"
    try:
        from . import _burst  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, None, f"not built ({exc})"
    ffi, lib = _burst.ffi, _burst.lib
    version = ffi.new("int[3]")
    if lib.tb_bind(version, version + 1, version + 2) != 0:
        return None, None, "pyzmq's libzmq not found in this process"
    if tuple(version) != zmq.zmq_version_info():
        return None, None, f"libzmq {tuple(version)} is not pyzmq's {zmq.zmq_version_info()}"
    return ffi, lib, ""


_FFI, _LIB, _WHY_NOT = _load()
_use_ext = _LIB is not None


def ext_status() -> str:
    """ "compiled" or why the pure-Python path is in use (for logs and /metrics)."""
    if _use_ext:
        return "compiled"
    return f"python ({_WHY_NOT or 'selected'})"


def select(kind: str) -> None:
    """Use the compiled path ("ext", when available) or the pure-Python one ("py") for
    readers made from now on (tests run both)."""
    global _use_ext
    if kind == "ext" and _LIB is None:
        raise RuntimeError(f"the compiled module is not usable: {_WHY_NOT}")
    _use_ext = kind == "ext"


def active() -> str:
    """ "ext" or "py": the path new readers take."""
    return "ext" if _use_ext else "py"


def ffi_lib() -> tuple[Any, Any]:
    """The compiled module's (ffi, lib) while the compiled path is selected, else (None, None),
    for protocol kernels built on it (the logjam ingest and PUB)."""
    return (_FFI, _LIB) if _use_ext else (None, None)


class Burst(Protocol):
    """Messages received in one call, oldest first."""

    n: int  # messages
    size: int  # bytes of the frames kept

    def counts(self) -> list[int]:
        """Each message's true frame count (frames past ``max_frames`` were dropped)."""
        ...

    def frames(self, i: int) -> list[bytes]:
        """The kept frames of message ``i``."""
        ...

    def messages(self) -> Iterator[tuple[int, list[bytes]]]:
        """(true frame count, kept frames) of every message."""
        ...


class Reader(Protocol):
    def recv(self, max_messages: int, max_bytes: int) -> Burst:
        """Every message that is ready, up to ``max_messages`` and until the kept frames reach
        ``max_bytes``; never blocks (an empty burst when nothing is queued)."""
        ...


def reader(sock: zmq.Socket[bytes], max_frames: int) -> Reader:
    """A burst reader of ``sock`` on the selected path; ``max_frames`` are kept per message."""
    if _use_ext:
        return _ExtReader(sock, max_frames)
    return _PyReader(sock, max_frames)


def bursts(
    reader: Reader, max_messages: int, max_bytes: int, max_seconds: float
) -> Iterator[Burst]:
    """Bursts read one after another while messages are ready, up to ``max_messages`` and
    ``max_bytes`` in all, and no new burst once ``max_seconds`` have passed (each is handled
    before the next is read: it lives in the reader's buffers). A socket with a small receive
    HWM holds few messages at a time, and libzmq's I/O thread refills it while the last burst
    is handled: one journal batch then spans several bursts rather than one small one, but
    under a steady stream it would go on to the budgets while its first message waits, hence
    the time bound."""
    deadline = time.monotonic() + max_seconds
    while max_messages > 0 and max_bytes > 0:
        burst = reader.recv(max_messages, max_bytes)
        if not burst.n:
            return
        max_messages -= burst.n
        max_bytes -= burst.size
        yield burst
        if time.monotonic() >= deadline:
            return


def drain(
    reader: Reader, max_messages: int, max_bytes: int, max_seconds: float
) -> Iterator[tuple[int, list[bytes]]]:
    """(true frame count, kept frames) of the messages of :func:`bursts`."""
    for burst in bursts(reader, max_messages, max_bytes, max_seconds):
        yield from burst.messages()


def compiled(burst: Burst) -> bool:
    """Whether ``burst`` is in the compiled shape (buf, frame_end, counts_c) a protocol kernel
    reads; a burst of the pure-Python path is its kernel's Python twin's."""
    return isinstance(burst, _ExtBurst)


def view(burst: Burst) -> tuple[Any, list[int], list[int]] | None:
    """``(burst, ends, starts)`` of a compiled burst for a protocol kernel, or None for a
    burst of the pure-Python path (which the Python twin of every kernel handles)."""
    if not isinstance(burst, _ExtBurst):
        return None
    starts, ends = burst._index()
    return burst, ends, starts


def buffer_bytes(burst: Any) -> bytes:
    """The whole of a compiled burst's buffer as one bytes object (frames sliced from it)."""
    return _FFI.buffer(burst.buf, burst.size)[:]


def send_prepared(sock: zmq.Socket[bytes], buf: Any, frame_end: Any, counts: Any, n: int) -> int:
    """Send ``n`` messages a protocol kernel laid out in C arrays (``tb_send``'s shape):
    compiled path only. Returns the number sent whole."""
    if sock.closed:
        return 0
    return int(_LIB.tb_send(handle(sock), buf, frame_end, counts, n))


class Run:
    """Messages ``lo``..``lo + n`` of a list of ``per``-frame tuples, for :func:`send_routed`
    (the list keeps the frames alive: hold the run no longer than the list), and how far
    sending has got."""

    __slots__ = ("lo", "messages", "n", "next", "per")

    def __init__(self, messages: Sequence[Sequence[bytes]], per: int) -> None:
        self.messages, self.per = messages, per
        self.lo = self.n = 0
        self.next = 0  # the first message not sent yet, from lo


def _send_fn() -> Any:
    """``eb_snap_send`` of the compiled module called through ctypes, which holds the GIL (it
    reads the tuples with the C API as it sends, no Python object made a frame); cffi cannot
    pass a Python object."""
    import ctypes

    from . import _burst  # type: ignore[attr-defined]

    fn = ctypes.PyDLL(_burst.__file__).eb_snap_send
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                   ctypes.c_size_t, ctypes.py_object, ctypes.c_long, ctypes.c_long,
                   ctypes.c_int, ctypes.POINTER(ctypes.c_int)]  # fmt: skip
    return fn, ctypes.c_int, ctypes.byref


_snap_send: Any = None


def uniform_run(messages: Sequence[Sequence[bytes]], per: int, run_size: int) -> Iterator[Run]:
    """``messages`` (a list of tuples of ``per`` bytes) ``run_size`` at a time, for
    :func:`send_routed`: compiled path only. Each run is the last one moved on: send it whole
    before taking the next."""
    run = Run(messages, per)
    for lo in range(0, len(messages), run_size):
        run.lo, run.n, run.next = lo, min(run_size, len(messages) - lo), 0
        yield run


def send_routed(sock: zmq.Socket[bytes], identity: bytes, head: bytes | None, run: Run) -> int:
    """The rest of ``run`` out of a ROUTER to the peer ``identity``, each message with ``head``
    before its frames, in one C call (``eb_snap_send``, GIL held: bound the run): compiled
    path only. Returns 0 when all of it is sent, else the errno that stopped it (EAGAIN: the
    peer's pipe is full, under ``ROUTER_MANDATORY``; ``run.next`` is where to go on); a
    ValueError (the messages before it sent) at an item that is not a tuple of ``per`` bytes."""
    global _snap_send
    if _snap_send is None:
        _snap_send = _send_fn()
    if sock.closed:
        return int(zmq.ENOTSOCK)
    fn, c_int, byref = _snap_send
    error = c_int(0)
    lo = run.lo
    run.next = fn(
        int(_FFI.cast("uintptr_t", handle(sock))), identity, len(identity), head,
        0 if head is None else len(head), run.messages, lo + run.next, lo + run.n, run.per,
        byref(error),
    ) - lo  # fmt: skip
    if error.value == -1:
        raise ValueError(f"every message must be a tuple of {run.per} bytes")
    return int(error.value)


def zmtp_wire(messages: Sequence[Sequence[bytes]]) -> tuple[bytearray, array[int]]:
    """Whole messages as ZMTP wire bytes (every frame with its header, MORE on all but a
    message's last) and where each message ends, in C (``zt_wire``): compiled path only.
    What taproom's publishers write (servers/zmtp/publisher.py); ``protocols.zmtp.pubsub.
    Burst.encode`` is the pure-Python twin."""
    frames = list(chain.from_iterable(messages))
    data = b"".join(frames)
    frame_end = array("Q", accumulate(map(len, frames)))
    counts = array("i", map(len, messages))
    return zmtp_wire_prepared(
        data, _FFI.from_buffer("size_t[]", frame_end), _FFI.from_buffer("int[]", counts),
        len(messages), len(frames), len(data),
    )  # fmt: skip


def zmtp_wire_prepared(
    buf: Any, frame_end: Any, counts: Any, n: int, frames: int, size: int
) -> tuple[bytearray, array[int]]:
    """:func:`zmtp_wire` of messages already laid out in C arrays (``tb_send``'s shape: the
    Event BUS collector's BROADCASTs): ``frames`` frames of ``size`` bytes in all."""
    out = bytearray(size + 9 * frames)
    ends = array("Q", bytes(8 * n))
    written = _LIB.zt_wire(
        buf, frame_end, counts, n, _FFI.from_buffer(out), len(out),
        _FFI.from_buffer("size_t[]", ends),
    )  # fmt: skip
    if n and not written:
        raise RuntimeError("zt_wire: the buffer is sized for every frame's header")
    del out[written:]  # shrinks in place; publishers share it from now on
    return out, ends


def send_messages(sock: zmq.Socket[bytes], messages: Sequence[Sequence[bytes]]) -> int:
    """Send multi-part messages, every frame NOBLOCK; a message a frame of which fails is
    skipped (a ROUTER's peer went away). Returns the number sent whole."""
    if _use_ext and messages:
        return _ext_send(sock, messages)
    sent = 0
    for message in messages:
        last = len(message) - 1
        try:
            for j, frame in enumerate(message):
                _raw_send(sock, frame, _NOBLOCK | _SNDMORE if j < last else _NOBLOCK)
        except zmq.ZMQError:
            continue
        sent += 1
    return sent


# --- pure Python -----------------------------------------------------------------------------


class _PyBurst:
    __slots__ = ("_messages", "n", "size")

    def __init__(self, messages: list[tuple[int, list[bytes]]], size: int) -> None:
        self._messages = messages
        self.n = len(messages)
        self.size = size

    def counts(self) -> list[int]:
        return [count for count, _ in self._messages]

    def frames(self, i: int) -> list[bytes]:
        return self._messages[i][1]

    def messages(self) -> Iterator[tuple[int, list[bytes]]]:
        return iter(self._messages)


class _PyReader:
    def __init__(self, sock: zmq.Socket[bytes], max_frames: int) -> None:
        self.sock = sock
        self.max_frames = max_frames

    def recv(self, max_messages: int, max_bytes: int) -> _PyBurst:
        sock, max_frames = self.sock, self.max_frames
        messages: list[tuple[int, list[bytes]]] = []
        size = 0
        for _ in range(max_messages):
            try:
                count, frames = recv_counted(sock, max_frames)
            except zmq.Again:
                break
            messages.append((count, frames))
            for frame in frames:
                size += len(frame)
            if size >= max_bytes:
                break
        return _PyBurst(messages, size)


# --- compiled ----------------------------------------------------------------------------------

_TB_NEED, _TB_ERROR = 4, -1


class _ExtBurst:
    """A burst in the reader's buffers: valid until the reader's next ``recv``."""

    __slots__ = (
        "_counts",
        "_ends",
        "_max_frames",
        "_starts",
        "buf",
        "counts_c",
        "frame_end",
        "frames_kept",
        "n",
        "size",
    )

    def __init__(self, rd: _ExtReader, n: int, frames: int, size: int) -> None:
        self.buf, self.frame_end, self.counts_c = rd.buf, rd.frame_end, rd.counts
        self.n, self.frames_kept, self.size = n, frames, size
        self._max_frames = rd.max_frames
        self._counts: list[int] | None = None
        self._starts: list[int] | None = None
        self._ends: list[int] | None = None

    def counts(self) -> list[int]:
        if self._counts is None:
            self._counts = _FFI.unpack(self.counts_c, self.n) if self.n else []
        return self._counts

    def _index(self) -> tuple[list[int], list[int]]:
        if self._starts is None:
            m = self._max_frames
            starts, j = [], 0
            for count in self.counts():
                starts.append(j)
                j += count if count < m else m
            starts.append(j)
            self._starts = starts
            self._ends = [0, *_FFI.unpack(self.frame_end, self.frames_kept)]
        assert self._ends is not None
        return self._starts, self._ends

    def frames(self, i: int) -> list[bytes]:
        starts, ends = self._index()
        data = _FFI.buffer(self.buf, self.size)
        return [data[ends[j] : ends[j + 1]] for j in range(starts[i], starts[i + 1])]

    def messages(self) -> Iterator[tuple[int, list[bytes]]]:
        starts, ends = self._index()
        data = _FFI.buffer(self.buf, self.size)[:]
        # every frame in one pass, then a list slice a message (not a comprehension each)
        frames = [data[a:b] for a, b in pairwise(ends)]
        return zip(
            self.counts(), map(frames.__getitem__, map(slice, starts, starts[1:])), strict=False
        )


def handle(sock: zmq.Socket[bytes]) -> Any:
    """libzmq's handle of ``sock`` as the compiled module takes it (checked: same socket type),
    or a ValueError."""
    ptr = _FFI.cast("void *", sock.underlying)
    if _LIB.tb_socket_type(ptr) != sock.get(zmq.TYPE):
        raise ValueError("the socket handle is not pyzmq's libzmq socket")
    return ptr


_alloc = None


def buffer(kind: str, size: int) -> Any:
    """A cffi array, not zeroed (every byte read was written first)."""
    global _alloc
    if _alloc is None:
        _alloc = _FFI.new_allocator(should_clear_after_alloc=False)
    return _alloc(kind, size)


class _ExtReader:
    def __init__(self, sock: zmq.Socket[bytes], max_frames: int) -> None:
        self.sock = sock
        self.max_frames = max_frames
        reader_ptr = _LIB.tb_reader_new(handle(sock), max_frames)
        if reader_ptr == _FFI.NULL:
            raise ValueError(f"max_frames {max_frames} out of range")
        self._reader = _FFI.gc(reader_ptr, _LIB.tb_reader_free)
        self._result = _FFI.new("tb_result *")
        self._messages = self._frames = 0
        self._cap = 0
        self.buf: Any = None
        self.frame_end: Any = None
        self.counts: Any = None

    def _size(self, max_messages: int, cap: int) -> None:
        if max_messages > self._messages:
            self.counts = buffer("int[]", max_messages)
            # room for a whole message always; past that, messages that do not fit wait for
            # the next call (a reader of 1028-frame messages must not hold 8192 x 1028 slots)
            self._frames = min(max_messages * self.max_frames, 8 * max_messages + self.max_frames)
            self.frame_end = buffer("size_t[]", self._frames)
            self._messages = max_messages
        if cap != self._cap:
            self.buf = buffer("char[]", cap)
            self._cap = cap

    def recv(self, max_messages: int, max_bytes: int) -> _ExtBurst:
        if self.sock.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        base = max(min(max_bytes, _INITIAL_BYTES * 16), _INITIAL_BYTES)
        # a buffer grown for one big message goes back to its usual size afterwards
        self._size(max_messages, base if self._cap > 2 * base or self._cap < base else self._cap)
        res = self._result
        recv = _LIB.tb_recv
        while True:
            recv(
                self._reader,
                self.buf,
                self._cap,
                self.frame_end,
                self._frames,
                self.counts,
                max_messages,
                max_bytes,
                res,
            )
            if res.status == _TB_NEED:  # one message bigger than the buffer: grow, read it
                self._size(max_messages, max(res.need, 2 * self._cap))
                continue
            if res.status == _TB_ERROR and not res.messages:
                raise zmq.ZMQError(res.error)
            return _ExtBurst(self, res.messages, res.frames, res.bytes)


def _ext_send(sock: zmq.Socket[bytes], messages: Sequence[Sequence[bytes]]) -> int:
    if sock.closed:
        return 0
    frames = [frame for message in messages for frame in message]
    data = b"".join(frames)
    ends = list(accumulate(map(len, frames)))
    return int(
        _LIB.tb_send(
            handle(sock),
            data,
            _FFI.new("size_t[]", ends),
            _FFI.new("int[]", [len(m) for m in messages]),
            len(messages),
        )
    )
