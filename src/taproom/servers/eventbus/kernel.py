"""The collectors' compiled kernels (issue 32): a burst of the seed's PUB commands validated,
then recorded and laid out as BROADCASTs, in C (``zmqburst/eventbus.c``: eb_scan, eb_emit);
and a burst of the CHP dialect's kvmsg updates validated, then recorded and laid out as
BROADCASTs and kvmsgs (eb_kv_scan, eb_kv_emit).

Python keeps what needs the bus's state: deduplication, the hashmap's admission, numbering,
and the hashmap entries. The pure-Python twin is the collector's own per-message path
(``parse_pub``, ``state.seed_record``), which also takes every message the kernel leaves to
it, so both paths store the same records and refuse the same messages for the same reasons
(tests/protocols/test_eventbus_kernel.py with fuzzed bursts, tests/servers on both paths).
The CHP kernel's twin is ``kvmsg.parse_update`` and ``Acceptor._accept_one`` (the same tests
in tests/protocols/test_eventbus_chp_kernel.py).
"""

from __future__ import annotations

from typing import Any, Self

from ... import zmqburst
from ...protocols.eventbus import Limits

__all__ = ["ChpKernel", "SeedKernel"]

# Bytes a BROADCAST adds to its PUB's frames: the 8-byte sequence for the sender's one (up to
# 8) and nothing else; the routing id is dropped. Records add their head, attrs and names.
_RECORD_EXTRA = 46 + 15 + 36 + 16
_BROADCAST_EXTRA = 8


class _Kernel:
    """What both kernels keep: the compiled module, the limits, and a run's event times and
    uuid texts (``max_burst`` of them)."""

    def __init__(self, ffi: Any, lib: Any, limits: Limits, max_burst: int, max_bytes: int):
        self.ffi, self.lib, self.limits = ffi, lib, limits
        self.cap = max_burst
        self.ts_ns = zmqburst.buffer("int64_t[]", max_burst)
        self.uuids = zmqburst.buffer("char[]", 36 * max_burst)

    @classmethod
    def create(cls, limits: Limits, max_burst: int, max_bytes: int) -> Self | None:
        """The kernel while the compiled path is selected, else None (the Python twin)."""
        ffi, lib = zmqburst.ffi_lib()
        if lib is None:
            return None
        return cls(ffi, lib, limits, max_burst, max_bytes)


class SeedKernel(_Kernel):
    """Buffers for one journal batch's worth of PUB commands (``max_burst`` of them, up to
    ``max_burst_bytes`` received) and the calls into eb_scan / eb_emit."""

    def __init__(self, ffi: Any, lib: Any, limits: Limits, max_burst: int, max_bytes: int):
        super().__init__(ffi, lib, limits, max_burst, max_bytes)
        alloc = zmqburst.buffer
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
        return _prepared(
            self.ffi, self.bc, self.bc_end, self.counts, res.bc_bytes, res.bc_frames, 6
        )


def _prepared(
    ffi: Any, buf: Any, ends: Any, counts: Any, size: int, frames: int, per: int
) -> tuple[Any, Any, Any, int] | None:
    """Messages of ``per`` frames laid out in ``buf`` / ``ends``, copied as ``send_prepared``
    takes them (the kernel's buffers are the next batch's), or None when there are none."""
    messages = frames // per
    if not messages:
        return None
    copy = zmqburst.buffer("char[]", size)
    ffi.memmove(copy, buf, size)
    ends_copy = zmqburst.buffer("size_t[]", frames)
    ffi.memmove(ends_copy, ends, frames * ffi.sizeof("size_t"))
    return copy, ends_copy, counts, messages


# What a kvmsg's record, BROADCAST and kvmsg add to its frames' bytes at most, besides the
# timestamp's text when the server's receive time stands for it: the record's head, middle
# and attrs (at most 101 bytes with a ttl and its deadline), the uuid's text, the sequence,
# the bin's head and the properties' names.
_KV_EXTRA = 256


class ChpKernel(_Kernel):
    """Buffers for one journal batch's worth of kvmsg updates (``max_burst`` of them, up to
    ``max_burst_bytes`` received) and the calls into eb_kv_scan / eb_kv_emit."""

    def __init__(self, ffi: Any, lib: Any, limits: Limits, max_burst: int, max_bytes: int):
        super().__init__(ffi, lib, limits, max_burst, max_bytes)
        alloc = zmqburst.buffer
        self.items = alloc("eb_kv_item[]", max_burst)
        self._cap = 0
        self.out: Any = None
        self.bc: Any = None
        self.kv: Any = None
        self.emitted = ffi.new("eb_kv_emitted *")
        self.received = b""
        self.received_c: Any = ffi.new("char[]", 1)
        self.received_ns = 0
        self._grow(max_bytes + max_burst * _KV_EXTRA)
        self.bc_end = alloc("size_t[]", 6 * max_burst)
        self.kv_end = alloc("size_t[]", 5 * max_burst)
        self.bc_counts = ffi.new("int[]", [6] * max_burst)
        self.kv_counts = ffi.new("int[]", [5] * max_burst)
        self.scanned = ffi.new("eb_scanned *")
        # the items as 8-byte words: every field of eb_kv_item is one (item_fields)
        self._words = ffi.sizeof("eb_kv_item") // 8
        self._fields = tuple(
            ffi.offsetof("eb_kv_item", name) // 8 for name in ("entry", "ttl_len", "expires_ms")
        )

    def _grow(self, size: int) -> None:
        """Room for ``size`` more bytes in each buffer (the batch's BROADCASTs and kvmsgs so
        far are kept; a message bigger than the batch's bound still arrives whole)."""
        res = self.emitted
        if res.bc_bytes + size <= self._cap and res.kv_bytes + size <= self._cap:
            return
        cap = max(2 * self._cap, max(res.bc_bytes, res.kv_bytes) + size)
        alloc, ffi = zmqburst.buffer, self.ffi
        self.out = alloc("char[]", cap)
        bc, kv = alloc("char[]", cap), alloc("char[]", cap)
        if res.bc_bytes:
            ffi.memmove(bc, self.bc, res.bc_bytes)
        if res.kv_bytes:
            ffi.memmove(kv, self.kv, res.kv_bytes)
        self.bc, self.kv = bc, kv
        self._cap = cap

    def start_batch(self, received: bytes, received_ns: int) -> None:
        """A new batch, whose updates without a timestamp take ``received`` (ISO text) and
        ``received_ns``."""
        res = self.emitted
        res.bc_bytes = res.bc_frames = res.kv_bytes = res.kv_frames = 0
        if received != self.received:
            self.received = received
            self.received_c = self.ffi.new("char[]", received)
        self.received_ns = received_ns

    def scan(self, burst: Any, start: int, start_frame: int) -> Any:
        """eb_kv_scan of updates ``start..`` (first frame ``start_frame``): the result's next,
        next_frame, slow and scanned; items 0..scanned-1 in ts_ns, uuids and items."""
        limits = self.limits
        self.lib.eb_kv_scan(
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
            limits.max_properties_bytes,
            self.received_ns,
            len(self.received),
            self.ts_ns,
            self.uuids,
            self.items,
            self.cap,
            self.scanned,
        )
        return self.scanned

    def item_fields(self, scanned: int) -> tuple[list[int], list[int], list[int]]:
        """The entry size, ttl length and expiry (ms) of items 0..scanned-1, as three lists
        read in one step (a cffi struct per item and field cost ~0.2 us each)."""
        words = memoryview(self.ffi.buffer(self.items, 8 * self._words * scanned))
        values = words.cast("q").tolist()
        step = self._words
        entry, ttl_len, expires_ms = self._fields
        return values[entry::step], values[ttl_len::step], values[expires_ms::step]

    def emit(
        self, burst: Any, first_frames: list[int], seqs: list[int], items: list[int], size: int
    ) -> tuple[bytes, bytes, list[int], bytes, list[int]]:
        """eb_kv_emit of the admitted updates (``size``: at least their frames' bytes): their
        records, and their BROADCASTs and kvmsgs appended to the batch's (:meth:`wires`);
        returned with the new BROADCASTs' and kvmsgs' bytes and frame ends (from 0 in them)
        for the hashmap's entries."""
        ffi, res = self.ffi, self.emitted
        count = len(seqs)
        self._grow(size + count * (_KV_EXTRA + 2 * len(self.received)))
        res.out_bytes = 0
        bc0, bcf0, kv0, kvf0 = res.bc_bytes, res.bc_frames, res.kv_bytes, res.kv_frames
        self.lib.eb_kv_emit(
            burst.buf,
            burst.frame_end,
            ffi.new("size_t[]", first_frames),
            ffi.new("uint64_t[]", seqs),
            ffi.new("int[]", items),
            count,
            self.ts_ns,
            self.uuids,
            self.items,
            self.received_c,
            len(self.received),
            self.received_ns,
            self.out,
            self._cap,
            self.bc,
            self._cap,
            self.bc_end,
            6 * self.cap,
            self.kv,
            self._cap,
            self.kv_end,
            5 * self.cap,
            res,
        )
        if res.error:
            raise RuntimeError("eb_kv_emit: buffers too small")  # sized above: a bug
        bc = ffi.buffer(self.bc + bc0, res.bc_bytes - bc0)[:]
        bc_ends = [e - bc0 for e in ffi.unpack(self.bc_end + bcf0, res.bc_frames - bcf0)]
        kv = ffi.buffer(self.kv + kv0, res.kv_bytes - kv0)[:]
        kv_ends = [e - kv0 for e in ffi.unpack(self.kv_end + kvf0, res.kv_frames - kvf0)]
        return ffi.buffer(self.out, res.out_bytes)[:], bc, bc_ends, kv, kv_ends

    def wires(self) -> tuple[tuple[Any, Any, Any, int] | None, tuple[Any, Any, Any, int] | None]:
        """The batch's BROADCASTs and kvmsgs as ``send_prepared`` takes them (copied), each
        None when there are none."""
        res, ffi = self.emitted, self.ffi
        return (
            _prepared(ffi, self.bc, self.bc_end, self.bc_counts, res.bc_bytes, res.bc_frames, 6),
            _prepared(ffi, self.kv, self.kv_end, self.kv_counts, res.kv_bytes, res.kv_frames, 5),
        )
