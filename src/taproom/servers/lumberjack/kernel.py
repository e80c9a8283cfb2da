"""The Lumberjack window kernel (issue 32): runs of ``J`` frames recorded in C
(``zmqburst/lumberjack.c``: ``lw_run``).

The decoder (:class:`taproom.protocols.lumberjack.ServerConnection`) hands a run of frames to
the kernel and gets back the journal records of the ``J`` frames it was certain of, then handles
the frame the kernel stopped before (another frame type, a payload it was not certain of, no
room, the end of the window or the batch) with its own Python path: refusals, stalls, resend
recognition and the window's bookkeeping keep one implementation. The protocol core stays
sans-I/O: the glue gives it a kernel made here (``WindowKernels.create()``: None while the
pure-Python path is selected, ``taproom.zmqburst.select``), and the tests run both
(tests/protocols/test_lumberjack_kernel.py with fuzzed windows, test_lumberjack.py on both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ... import zmqburst

__all__ = ["PathKernel", "WindowKernels"]

# The one output buffer of a listener's kernels (bytes): the records of one call, copied out at
# once. A window of Filebeat's ordinary events fits in a call or a few; a record larger than
# this (an event of about 1 MiB) does not fit at all and is left to the Python path, so the
# buffer stays this size whatever max_event_bytes is.
_OUT_BYTES = 1 << 20


class PathKernel:
    """The kernel for one set of stream and topic paths (what a connection calls)."""

    __slots__ = ("_ffi", "_lib", "_paths", "_res", "_shared")

    def __init__(self, shared: WindowKernels, paths: Any) -> None:
        self._shared = shared
        self._ffi = shared.ffi
        self._lib = shared.lib
        self._paths = paths
        self._res = shared.ffi.new("lw_ran *")

    def run(
        self,
        view: bytes,
        pos: int,
        end: int,
        version: int,
        max_event: int,
        tail: bytes,
        producer_len: int,
        received_ns: int,
        max_events: int,
        batch_room: int,
        room: int,
        count: int,
        high: int,
    ) -> Any:
        """``lw_run`` from ``pos``: the result (``pos``, ``events``, ``stop``, ``count``,
        ``high``, ``out_bytes``); the records are :meth:`records` until the next call."""
        shared = self._shared
        res = self._res
        res.pos = pos
        res.count = count
        res.high = high
        self._lib.lw_run(
            self._paths,
            self._ffi.from_buffer(view),
            end,
            version,
            max_event,
            tail,
            producer_len,
            len(tail),
            received_ns,
            max_events,
            batch_room,
            room,
            shared.out,
            shared.out_cap,
            res,
        )
        return res

    def records(self) -> bytes:
        """The records the last call wrote (a copy: the buffer is the next call's)."""
        return self._ffi.buffer(self._shared.out, self._res.out_bytes)[:]


class WindowKernels:
    """The compiled module's calls and one output buffer, shared by a listener's connections
    (the event loop runs one at a time; each copies its records out at once)."""

    def __init__(self, ffi: Any, lib: Any) -> None:
        self.ffi, self.lib = ffi, lib
        self.out = zmqburst.buffer("char[]", _OUT_BYTES)  # not zeroed: touched as written
        self.out_cap = _OUT_BYTES
        self._paths: dict[tuple[tuple[str, ...], tuple[str, ...]], Any] = {}

    @classmethod
    def create(cls) -> WindowKernels | None:
        """The kernels while the compiled path is selected, else None (the Python twin)."""
        ffi, lib = zmqburst.ffi_lib()
        if lib is None:
            return None
        return cls(ffi, lib)

    def for_paths(
        self, stream_fields: Sequence[str], topic_fields: Sequence[str]
    ) -> PathKernel | None:
        """The kernel for these dotted paths (as the decoder reads them: empty ones skipped),
        or None when they do not fit it (too many, too deep, not encodable)."""
        key = (tuple(p for p in stream_fields if p), tuple(p for p in topic_fields if p))
        paths = self._paths.get(key)
        if paths is None:
            parts: list[int] = []
            ends: list[int] = []
            text = bytearray()
            try:
                for path in (*key[0], *key[1]):
                    components = path.split(".")
                    parts.append(len(components))
                    for component in components:
                        text += component.encode("utf-8")
                        ends.append(len(text))
            except UnicodeEncodeError:
                return None
            ffi = self.ffi
            made = self.lib.lw_paths_new(
                len(key[0]),
                len(key[1]),
                ffi.new("int[]", parts or [0]),
                ffi.from_buffer(bytes(text) or b"\0"),
                ffi.new("size_t[]", ends or [0]),
            )
            if made == ffi.NULL:
                return None
            paths = ffi.gc(made, self.lib.lw_paths_free)
            if len(self._paths) >= 64:  # configurations are few; bounded all the same
                self._paths.clear()
            self._paths[key] = paths
        return PathKernel(self, paths)
