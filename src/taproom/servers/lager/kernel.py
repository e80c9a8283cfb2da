"""The forwarder's compiled row kernel (issue 32): a burst of tap data messages checked against
their taps' formats, their journal records written and their frames laid out as ZMTP wire for
the mugs, in C (``zmqburst/lager.c``: lg_run).

The kernel takes only rows of a (uuid, flags, version) the Python path has already resolved to
its record parts (:class:`~taproom.servers.lager.forwarder.DataRecords`, handed over with
:meth:`RowKernel.add`), in both framings, and lays each out twice: as received (the counted
output) and as a real Mug reads it (the plain output: a seed-framed row of several items split
per item). Every other message (bad header, unknown tap, wrong sizes) stops the run and goes
through the Python path, which is the kernel's pure-Python twin: both write the same
records and forward the same bytes (tests/protocols/test_lager_kernel.py with fuzzed bursts,
tests/servers/test_lager*.py on both paths).
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any

from ... import zmqburst

if TYPE_CHECKING:
    from .forwarder import DataRecords

__all__ = ["LG_END", "LG_FULL", "LG_PYTHON", "RowKernel", "tap_key"]

LG_END, LG_PYTHON, LG_FULL = 0, 1, 2  # lg_run's stops


def tap_key(raw_uuid: bytes, flags: bytes, version: bytes) -> bytes:
    """The record cache's key of a row header, as lg_run builds it (flags' length in it: no
    (flags, version) pair may read as another)."""
    return raw_uuid + bytes((len(flags),)) + flags + version


class RowKernel:
    """The C table of taps' record parts and the buffers of one lg_run: records, wire, where
    each message ends, and the runs of one uuid."""

    def __init__(self, ffi: Any, lib: Any, max_entries: int, max_messages: int) -> None:
        self.ffi, self.lib = ffi, lib
        taps = lib.lg_taps_new(max_entries)
        if taps == ffi.NULL:
            raise MemoryError("lg_taps_new")
        self.taps = ffi.gc(taps, lib.lg_taps_free)
        self.res = ffi.new("lg_ran *")
        self.max_messages = max_messages
        alloc = zmqburst.buffer
        self.ends = alloc("size_t[]", max_messages)
        self.plain_ends = alloc("size_t[]", max_messages)
        self.run_uuid = alloc("char[]", 16 * max_messages)
        self.run_rows = alloc("int[]", max_messages)
        self._out_cap = self._wire_cap = 0
        self.out: Any = None
        self.wire: Any = None
        self.plain: Any = None

    @classmethod
    def create(cls, max_entries: int, max_messages: int) -> RowKernel | None:
        """The kernel while the compiled path is selected, else None (the Python twin)."""
        ffi, lib = zmqburst.ffi_lib()
        if lib is None:
            return None
        return cls(ffi, lib, max_entries, max_messages)

    def add(self, key: bytes, tap: DataRecords) -> None:
        """The kernel takes this tap's rows from now on (until :meth:`clear`); a tap it cannot
        keep (its table is full) stays the Python path's."""
        self.lib.lg_taps_add(
            self.taps, key, len(key), tap.tail, len(tap.tail), tap.length, tap.row_size,
            self.ffi.new("uint32_t[]", tap.item_sizes), len(tap.item_sizes),
        )  # fmt: skip

    def clear(self) -> None:
        self.lib.lg_taps_clear(self.taps)

    def size(self, burst_bytes: int, frames: int) -> None:
        """Buffers for a burst of ``burst_bytes`` in ``frames`` frames: its wire is at most
        9 bytes a frame more (a seed row split per item more again); records are its rows plus
        their heads. A run that fills a buffer stops LG_FULL and goes on after the caller took
        what it wrote; one row bigger than a buffer grows it (:meth:`run`)."""
        wire = burst_bytes + 9 * frames
        if wire > self._wire_cap:
            self._grow(wire)
        if 2 * wire > self._out_cap:
            self.out = zmqburst.buffer("char[]", 2 * wire)
            self._out_cap = 2 * wire

    def _grow(self, wire: int) -> None:
        self.wire = zmqburst.buffer("char[]", wire)
        self.plain = zmqburst.buffer("char[]", wire)
        self._wire_cap = wire

    def run(self, burst: Any, start: int, start_frame: int, received_ns: int) -> Any:
        """lg_run of messages ``start..`` of a compiled burst: the result (next, next_frame,
        stop, rows, out_bytes, wire_bytes, runs, out_of_range, need)."""
        res = self.res
        while True:
            self.lib.lg_run(
                self.taps, burst.buf, burst.frame_end, burst.counts_c, burst._max_frames,
                start, start_frame, burst.n, received_ns, self.out, self._out_cap, self.wire,
                self._wire_cap, self.ends, self.max_messages, self.run_uuid, self.run_rows,
                self.max_messages, self.plain, self._wire_cap, self.plain_ends, res,
            )  # fmt: skip
            if res.stop == LG_FULL and not res.rows:  # one row bigger than a buffer: grow
                if res.need > self._out_cap:
                    self._out_cap = max(res.need, 2 * self._out_cap)
                    self.out = zmqburst.buffer("char[]", self._out_cap)
                if res.need > self._wire_cap:
                    self._grow(max(res.need, 2 * self._wire_cap))
                continue
            return res

    def taken(
        self,
    ) -> tuple[bytes, bytes, array[int], list[tuple[bytes, int]], tuple[bytes, array[int]] | None]:
        """What the last run wrote: records, wire, where each message ends in the wire, the
        (uuid, rows) of each run of one uuid, and the plain output's wire and ends when they
        differ (a seed row split per item; else None: the same as the wire). Copied: the
        buffers are the next run's."""
        ffi, res = self.ffi, self.res
        ends = array("Q")
        ends.frombytes(ffi.buffer(self.ends, 8 * res.rows))
        plain = None
        if res.reframed:
            plain_ends = array("Q")
            plain_ends.frombytes(ffi.buffer(self.plain_ends, 8 * res.rows))
            plain = (ffi.buffer(self.plain, res.plain_bytes)[:], plain_ends)
        uuids = ffi.buffer(self.run_uuid, 16 * res.runs)[:]
        runs = list(
            zip(
                [uuids[k : k + 16] for k in range(0, 16 * res.runs, 16)],
                ffi.unpack(self.run_rows, res.runs),
                strict=True,
            )
        )
        return (
            ffi.buffer(self.out, res.out_bytes)[:],
            ffi.buffer(self.wire, res.wire_bytes)[:],
            ends,
            runs,
            plain,
        )
