"""The COLLECTOR's compiled kernels (issue 32): a burst of the seed's PUB commands validated,
then recorded and laid out as BROADCASTs, in C (``zmqburst/eventbus.c``: eb_scan, eb_emit).

Python keeps what needs the bus's state: deduplication, the hashmap's admission, numbering,
and the hashmap entries. The pure-Python twin is the collector's own per-message path
(``parse_pub``, ``state.seed_record``), which also takes every message the kernel leaves to
it, so both paths store the same records and refuse the same messages for the same reasons
(tests/protocols/test_eventbus_kernel.py with fuzzed bursts, tests/servers on both paths).
"""

from __future__ import annotations

from typing import Any

from ... import zmqburst
from ...protocols.eventbus import Limits

__all__ = ["SeedKernel"]

# Bytes a BROADCAST adds to its PUB's frames: the 8-byte sequence for the sender's one (up to
# 8) and nothing else; the routing id is dropped. Records add their head, attrs and names.
_RECORD_EXTRA = 46 + 15 + 36 + 16
_BROADCAST_EXTRA = 8


class SeedKernel:
    """Buffers for one journal batch's worth of PUB commands (``max_burst`` of them, up to
    ``max_burst_bytes`` received) and the calls into eb_scan / eb_emit."""

    def __init__(self, ffi: Any, lib: Any, limits: Limits, max_burst: int, max_bytes: int):
        self.ffi, self.lib, self.limits = ffi, lib, limits
        self.cap = max_burst
        alloc = zmqburst.buffer
        self.ts_ns = alloc("int64_t[]", max_burst)
        self.uuids = alloc("char[]", 36 * max_burst)
        # a run's records; a batch's BROADCASTs (the batch reads up to max_bytes, and a
        # message bigger than that still arrives whole: the buffers grow for it)
        self._out_cap = self._bc_cap = 0
        self.out: Any = None
        self.bc: Any = None
        self.emitted = ffi.new("eb_emitted *")
        self._grow(max_bytes + max_burst * _RECORD_EXTRA)
        self.bc_end = alloc("size_t[]", 6 * max_burst)
        self.counts = ffi.new("int[]", [6] * max_burst)
        self.scanned = ffi.new("eb_scanned *")

    @classmethod
    def create(cls, limits: Limits, max_burst: int, max_bytes: int) -> SeedKernel | None:
        """The kernel while the compiled path is selected, else None (the Python twin)."""
        ffi, lib = zmqburst.ffi_lib()
        if lib is None:
            return None
        return cls(ffi, lib, limits, max_burst, max_bytes)

    def _grow(self, size: int) -> None:
        if size > self._out_cap:
            self.out = zmqburst.buffer("char[]", size)
            self._out_cap = size
        if size > self._bc_cap:
            bc = zmqburst.buffer("char[]", size)
            if self._bc_cap and self.emitted.bc_bytes:  # keep the batch's BROADCASTs so far
                self.ffi.memmove(bc, self.bc, self.emitted.bc_bytes)
            self.bc = bc
            self._bc_cap = size

    def start_batch(self) -> None:
        self.emitted.bc_bytes = self.emitted.bc_frames = 0

    def scan(self, burst: Any, start: int, start_frame: int) -> Any:
        """eb_scan of messages ``start..`` (first frame ``start_frame``): the result's next,
        next_frame, slow and scanned; items 0..scanned-1 in ts_ns and uuids."""
        limits, res = self.limits, self.scanned
        self.lib.eb_scan(
            burst.buf,
            burst.frame_end,
            burst.counts_c,
            burst._max_frames,
            start,
            start_frame,
            burst.n,
            limits.max_topic_bytes,
            limits.max_producer_bytes,
            limits.max_data_bytes,
            self.ts_ns,
            self.uuids,
            self.cap,
            res,
        )
        return res

    def emit(
        self,
        burst: Any,
        first_frames: list[int],
        seqs: list[int],
        items: list[int],
        received_ns: int,
        size: int,
    ) -> bytes:
        """eb_emit of the admitted messages (``size``: their frames' bytes): their records
        (returned), and their BROADCASTs appended to the batch's (:meth:`broadcasts`)."""
        ffi, res = self.ffi, self.emitted
        count = len(seqs)
        self._grow(max(size + count * _RECORD_EXTRA, res.bc_bytes + size + count * 16))
        res.out_bytes = 0
        self.lib.eb_emit(
            burst.buf,
            burst.frame_end,
            ffi.new("size_t[]", first_frames),
            ffi.new("uint64_t[]", seqs),
            ffi.new("int[]", items),
            count,
            self.ts_ns,
            self.uuids,
            received_ns,
            self.out,
            self._out_cap,
            self.bc,
            self._bc_cap,
            self.bc_end,
            6 * self.cap,
            res,
        )
        if res.error:
            raise RuntimeError("eb_emit: buffers too small")  # sized above: a bug
        return ffi.buffer(self.out, res.out_bytes)[:]

    def broadcasts(self) -> tuple[Any, Any, Any, int] | None:
        """The batch's BROADCASTs as ``send_prepared`` takes them (copied: the buffers are
        the next batch's), or None when there are none."""
        res = self.emitted
        messages = res.bc_frames // 6
        if not messages:
            return None
        ffi = self.ffi
        buf = zmqburst.buffer("char[]", res.bc_bytes)
        ffi.memmove(buf, self.bc, res.bc_bytes)
        ends = zmqburst.buffer("size_t[]", res.bc_frames)
        ffi.memmove(ends, self.bc_end, res.bc_frames * ffi.sizeof("size_t"))
        return buf, ends, self.counts, messages
