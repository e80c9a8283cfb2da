"""The journal drops the page cache of durable bytes behind its write end (cache_keep_bytes):
checked with mincore(2) on the segment files, on the real filesystem under tmp_path."""

from __future__ import annotations

import ctypes
import mmap
import os

from taproom.journal import Journal
from taproom.journal.journal import _DROP_STEP
from taproom.records import BatchBuilder, EncodedBatch

MiB = 1024 * 1024
_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


def resident(path: str) -> list[bool]:
    """Whether each page of the file is in the page cache (mapping it reads nothing)."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer((size + _PAGE - 1) // _PAGE)
            assert _libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return [bool(b & 1) for b in vec.raw]


def big_batch(tag: int, size: int = 256 * 1024) -> EncodedBatch:
    b = BatchBuilder(received_ns=1)
    b.add("test", bytes([tag % 251]) * size, stream="s", seq=tag)
    return b.build()


def dropped(j: Journal) -> float:
    value = j.metrics.registry.get_sample_value("taproom_journal_cache_dropped_bytes_total")
    return value or 0.0


def write(j: Journal, batches: int) -> None:
    for i in range(batches):
        j.commit([big_batch(i)])


def expected(batches: int) -> list[bytes]:
    return [bytes([i % 251]) * (256 * 1024) for i in range(batches)]


def test_durable_bytes_behind_the_kept_tail_leave_the_page_cache(tmp_path):
    keep = 1 * MiB
    j = Journal(tmp_path, segment_bytes=1 << 30, cache_keep_bytes=keep)
    # keep + a drop step + 2 MiB: one drop at least, of everything but the kept tail then
    batches = (keep + _DROP_STEP + 2 * MiB) // (256 * 1024)
    write(j, batches)
    path = j.segments()[-1].path
    size = os.path.getsize(path)
    gone = int(dropped(j))
    assert _DROP_STEP <= gone <= size - keep
    pages = resident(path)
    assert not any(pages[: gone // _PAGE]), "dropped bytes are still cached"
    assert pages[-1], "the last page written is cached (the kept tail)"
    # Nothing is lost: every event reads back (from the disk where dropped), and after a
    # reopen too.
    assert [r.payload for r in j.read(0)] == expected(batches)
    j.close()
    assert [r.payload for r in Journal(tmp_path).read(0)] == expected(batches)


def test_a_sealed_segment_leaves_the_page_cache_at_the_roll(tmp_path):
    j = Journal(tmp_path, segment_bytes=2 * MiB, cache_keep_bytes=8 * MiB)
    write(j, 12)  # 3 MiB: one roll, no drop inside a segment (keep is larger)
    sealed, active = j.segments()[0].path, j.segments()[-1].path
    assert sealed != active
    assert dropped(j) == os.path.getsize(sealed)
    assert not any(resident(sealed))
    assert resident(active)[-1]
    assert [r.payload for r in j.read(0)] == expected(12)


def test_zero_keeps_everything_cached(tmp_path):
    # The control: the same writes with cache_keep_bytes = 0 drop nothing, so the pages the
    # tests above find gone were dropped by the journal.
    j = Journal(tmp_path, segment_bytes=2 * MiB, cache_keep_bytes=0)
    write(j, (1 * MiB + _DROP_STEP + 2 * MiB) // (256 * 1024))
    assert dropped(j) == 0
    for seg in j.segments():
        assert all(resident(seg.path)), "a page the journal wrote was dropped"
