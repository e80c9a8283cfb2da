"""On-disk format of journal segments, and walking them past damage.

A journal is a directory of segment files named ``<base offset, 20 digits>.seg``. Each segment
starts with a 16-byte header (``b"TAPROOM\\x01"`` + u64 base offset, little-endian) and holds
batch frames back to back::

    u32 body length   u32 CRC32C   u64 base offset   u32 record count   body

The CRC covers base offset, count and body. A frame is valid if its CRC matches, its count is
non-zero, its body fits in the file and its base offset continues the previous frame.

Damage is walked past, never allowed to take intact frames with it: where a frame does not
verify, :func:`walk_frames` resynchronises on the next position holding a valid frame (header
plausible, CRC matching, base offset no further ahead than the damaged bytes could have held)
and reports the bytes in between as a :class:`Damage` with the offsets they cost. Every frame
carries its own base offset, so frames after the damage keep the offsets they were acked with.
Damage with no valid frame after it is the segment's tail: in the active segment that is a
torn write (recovery cuts it), in a sealed segment it is quarantined like any other. A damaged
segment header costs no frames either: the base offset is also in the file name.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import crc32c
import numpy as np

from ..records import RECORD_HEAD, Record, iter_batch

__all__ = [
    "DAMAGE_REASONS",
    "FRAME",
    "MAX_BATCH_BODY",
    "SEGMENT_HEADER",
    "Damage",
    "FrameInfo",
    "ScanResult",
    "crc_of",
    "cut_segment",
    "encode_frame_header",
    "fsync_dir",
    "header_damage",
    "read_segment_header",
    "records_in_range",
    "scan_segment",
    "segment_base",
    "segment_bases",
    "segment_batches",
    "segment_frames",
    "segment_header",
    "segment_name",
    "walk_frames",
    "write_segment_header",
]

SEGMENT_MAGIC = b"TAPROOM\x01"
SEGMENT_HEADER = struct.Struct("<8sQ")
FRAME = struct.Struct("<IIQI")
# A single batch body above this is a corrupt length field, not data: group commits are capped
# well below (journal.max_commit_bytes), so anything larger is never allocated.
MAX_BATCH_BODY = 256 * 1024 * 1024
_CRC_PART = struct.Struct("<QI")
# Every record of a body takes at least its fixed head: bounds how many offsets damaged bytes
# can have held, which keeps resynchronisation from accepting a far-fetched "frame".
_MIN_RECORD_BYTES = RECORD_HEAD.size
# Resynchronisation reads this much at a time (its filter makes a few arrays of this length).
_RESYNC_CHUNK = 1 << 20
_U64_AT_EACH_BYTE = np.dtype("<u8")

# Why bytes were quarantined (the `reason` label of the journal's damage metrics).
DAMAGE_REASONS = ("crc_mismatch", "frame_header", "segment_header")


def segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}.seg"


def segment_base(name: str) -> int | None:
    """The base offset in a segment file name, or None if ``name`` is not a segment."""
    stem, dot, ext = name.partition(".")
    return int(stem) if dot and ext == "seg" and stem.isdigit() else None


def segment_bases(path: str) -> list[int]:
    """Base offsets of the segment files in the journal directory ``path``, oldest first."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    return sorted(base for base in map(segment_base, names) if base is not None)


def segment_header(base_offset: int) -> bytes:
    return SEGMENT_HEADER.pack(SEGMENT_MAGIC, base_offset)


def fsync_dir(path: str) -> None:
    """fsync a directory: makes a file created, renamed or deleted in it durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def cut_segment(path: str, size: int) -> None:
    """Truncate a segment file to ``size`` bytes, durably (cutting a torn tail)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_segment_header(path: str, base_offset: int) -> None:
    """Write (or mend) the header of an existing segment file in place, durably."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, segment_header(base_offset), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def crc_of(base_offset: int, count: int, body: bytes | memoryview) -> int:
    return crc32c.crc32c(body, crc32c.crc32c(_CRC_PART.pack(base_offset, count)))


def encode_frame_header(base_offset: int, count: int, body: bytes) -> bytes:
    return FRAME.pack(len(body), crc_of(base_offset, count, body), base_offset, count)


@dataclass(slots=True)
class FrameInfo:
    position: int
    base_offset: int
    count: int
    body_length: int
    body: bytes | None = None  # read and CRC-checked when walked with ``verify``
    crc: int = 0  # as stored: the frame header is FRAME.pack(body_length, crc, base, count)

    @property
    def header(self) -> bytes:
        """The frame header exactly as stored (the network read API sends frames as stored)."""
        return FRAME.pack(self.body_length, self.crc, self.base_offset, self.count)

    @property
    def end_position(self) -> int:
        return self.position + FRAME.size + self.body_length

    @property
    def end_offset(self) -> int:
        return self.base_offset + self.count


@dataclass(frozen=True, slots=True)
class Damage:
    """Bytes of one segment that hold no valid frame, and the offsets they cost.

    ``end_offset`` is None when the damage runs to the end of the file and the offset after it
    is not known (the last segment); ``at_end`` says no valid frame follows in this file.
    """

    segment: str  # file name
    position: int
    nbytes: int
    first_offset: int
    end_offset: int | None
    reason: str  # one of DAMAGE_REASONS
    detail: str
    at_end: bool = False

    @property
    def lost_events(self) -> int:
        return 0 if self.end_offset is None else self.end_offset - self.first_offset

    def describe(self) -> str:
        lost = (
            f"offsets {self.first_offset}-{self.end_offset - 1} lost"
            if self.end_offset is not None and self.end_offset > self.first_offset
            else "no offsets lost"
        )
        return (
            f"{self.segment} bytes {self.position}-{self.position + self.nbytes - 1}: "
            f"{self.detail}; {lost}"
        )


def _frame_problem(
    fd: int, pos: int, expected: int, file_size: int, verify: bool
) -> tuple[FrameInfo, str | None, str]:
    """The frame at ``pos`` and what is wrong with it: (frame, problem or None, reason)."""
    if file_size - pos < FRAME.size:
        return FrameInfo(pos, expected, 0, 0), "torn frame header", "frame_header"
    length, crc, base, count = FRAME.unpack(os.pread(fd, FRAME.size, pos))
    info = FrameInfo(pos, base, count, length, crc=crc)
    if length > MAX_BATCH_BODY or pos + FRAME.size + length > file_size:
        return info, "frame runs past end of file", "frame_header"
    if count == 0 or base != expected:
        return info, f"frame base {base} count {count}, expected base {expected}", "frame_header"
    if verify:
        body = os.pread(fd, length, pos + FRAME.size)
        if len(body) != length or crc_of(base, count, body) != crc:
            return info, "CRC mismatch", "crc_mismatch"
        info.body = body
    return info, None, ""


def _resync(
    fd: int, bad_position: int, expected: int, file_size: int, end_bound: int | None
) -> FrameInfo | None:
    """The first valid frame at or after ``bad_position`` that can follow ``expected``.

    A candidate must have a matching CRC, a base offset in ``[expected, expected + the records
    the bytes since bad_position could hold]``, a non-zero count whose records fit in its body,
    and (in a sealed segment) end at or before ``end_bound``. Base offsets are filtered with
    numpy over a chunk at a time; only the few candidates left are checked one by one.
    """
    pos = bad_position
    while file_size - pos >= FRAME.size:
        buf = os.pread(fd, min(_RESYNC_CHUNK, file_size - pos), pos)
        starts = len(buf) - FRAME.size + 1
        if starts <= 0:
            return None
        furthest = expected + (pos + starts - bad_position) // _MIN_RECORD_BYTES
        bases = np.ndarray((starts,), _U64_AT_EACH_BYTE, buf, 8, (1,))
        for i in np.flatnonzero((bases >= expected) & (bases <= furthest)).tolist():
            length, crc, base, count = FRAME.unpack_from(buf, i)
            at = pos + i
            if (
                count == 0
                or base - expected > (at - bad_position) // _MIN_RECORD_BYTES
                or length < count * _MIN_RECORD_BYTES
                or length > MAX_BATCH_BODY
                or at + FRAME.size + length > file_size
                or (end_bound is not None and base + count > end_bound)
            ):
                continue
            body = os.pread(fd, length, at + FRAME.size)
            if len(body) == length and crc_of(base, count, body) == crc:
                return FrameInfo(at, base, count, length, body, crc)
        pos += starts
    return None


def walk_frames(
    fd: int,
    segment: str,
    start_position: int,
    expected_offset: int,
    file_size: int,
    *,
    verify: bool,
    end_bound: int | None = None,
) -> Iterator[FrameInfo | Damage]:
    """Frames from ``start_position`` on, with a :class:`Damage` for every stretch of bytes
    that holds none. After a damage that is ``at_end`` nothing more is yielded.

    With ``verify`` each body is read and its CRC checked; without, only headers are read (fast
    index building and planning), so a frame whose body alone is damaged passes. Candidates
    after damage are always CRC-checked. ``end_bound`` is the next segment's base offset.
    """
    pos = start_position
    expected = expected_offset
    while pos < file_size:
        info, problem, reason = _frame_problem(fd, pos, expected, file_size, verify)
        if problem is None:
            yield info
            pos, expected = info.end_position, info.end_offset
            continue
        found = _resync(fd, pos, expected, file_size, end_bound)
        if found is None:
            yield Damage(
                segment, pos, file_size - pos, expected, end_bound, reason, problem, at_end=True
            )
            return
        yield Damage(
            segment, pos, found.position - pos, expected, found.base_offset, reason, problem
        )
        if not verify:
            found.body = None
        yield found
        pos, expected = found.end_position, found.end_offset


def read_segment_header(fd: int) -> int | None:
    """The base offset in a segment header, or None if the header is torn or foreign."""
    raw = os.pread(fd, SEGMENT_HEADER.size, 0)
    if len(raw) < SEGMENT_HEADER.size:
        return None
    magic, base = SEGMENT_HEADER.unpack(raw)
    return base if magic == SEGMENT_MAGIC else None


def header_damage(fd: int, name: str, base: int, file_size: int) -> Damage | None:
    """A :class:`Damage` for a header that does not name ``base`` (its frames are unharmed)."""
    found = read_segment_header(fd)
    if found == base:
        return None
    nbytes = min(file_size, SEGMENT_HEADER.size)
    detail = "torn segment header" if found is None else f"segment header names base {found}"
    return Damage(name, 0, nbytes, base, base, "segment_header", detail)


def segment_frames(
    fd: int,
    path: str,
    start: tuple[int, int],
    from_offset: int,
    end_offset: int | None,
    *,
    sealed_end: int | None,
    on_damage: Callable[[Damage], None],
) -> Iterator[FrameInfo]:
    """Verified frames (body read, CRC checked) of one open segment overlapping the range.

    ``start`` is a (base offset, file position) to begin the walk at (from a sparse index, or
    the base and the header size); ``sealed_end`` is the next segment's base, None for the last
    segment. Damage is reported to ``on_damage`` and walked past. In the last segment, damage
    that nothing valid follows is a batch still being written (or a torn tail) and ends the
    walk unreported; so does damage at or after ``end_offset``.
    """
    name = os.path.basename(path)
    size = os.fstat(fd).st_size
    if start[1] <= SEGMENT_HEADER.size:
        if sealed_end is None and size <= SEGMENT_HEADER.size:
            return  # being created
        damage = header_damage(fd, name, start[0], size)
        if damage is not None:
            on_damage(damage)
    for item in walk_frames(fd, name, start[1], start[0], size, verify=True, end_bound=sealed_end):
        if isinstance(item, Damage):
            if end_offset is not None and item.first_offset >= end_offset:
                return
            if item.at_end and sealed_end is None:
                return
            on_damage(item)
            continue
        if end_offset is not None and item.base_offset >= end_offset:
            return
        if item.end_offset <= from_offset:
            continue
        yield item


def segment_batches(
    fd: int,
    path: str,
    start: tuple[int, int],
    from_offset: int,
    end_offset: int | None,
    *,
    sealed_end: int | None,
    on_damage: Callable[[Damage], None],
) -> Iterator[tuple[int, int, bytes]]:
    """:func:`segment_frames` as ``(base, count, body)``."""
    for item in segment_frames(
        fd, path, start, from_offset, end_offset, sealed_end=sealed_end, on_damage=on_damage
    ):
        assert item.body is not None
        yield item.base_offset, item.count, item.body


def records_in_range(
    batches: Iterator[tuple[int, int, bytes]], from_offset: int, end_offset: int | None
) -> Iterator[Record]:
    """The records of ``batches`` with ``from_offset <= offset < end_offset``."""
    for base, _count, body in batches:
        for record in iter_batch(body, base):
            if record.offset < from_offset:
                continue
            if end_offset is not None and record.offset >= end_offset:
                return
            yield record


@dataclass(slots=True)
class ScanResult:
    """One segment walked end to end: its valid frames, its damage, where its data ends."""

    base_offset: int  # from the file name
    valid_end: int  # file position just past the last valid frame (or the header)
    next_offset: int  # offset after the last valid record
    file_size: int
    index: list[tuple[int, int]] = field(default_factory=list)  # (base offset, position)
    events: int = 0  # records in valid frames
    header: Damage | None = None  # a damaged segment header (no frames lost by it)
    damage: list[Damage] = field(default_factory=list)  # stretches with valid frames after
    tail: Damage | None = None  # damage nothing valid follows (a torn tail if last)


def scan_segment(path: str, *, verify: bool = True, end_bound: int | None = None) -> ScanResult:
    """Walk one segment file; ``end_bound`` is the next segment's base (sealed segments)."""
    name = os.path.basename(path)
    base = segment_base(name)
    if base is None:
        raise ValueError(f"{path}: not a segment file name")
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        result = ScanResult(base, min(size, SEGMENT_HEADER.size), base, size)
        result.header = header_damage(fd, name, base, size)
        for item in walk_frames(
            fd, name, SEGMENT_HEADER.size, base, size, verify=verify, end_bound=end_bound
        ):
            if isinstance(item, Damage):
                if item.at_end:
                    result.tail = item
                else:
                    result.damage.append(item)
                continue
            result.index.append((item.base_offset, item.position))
            result.valid_end = item.end_position
            result.next_offset = item.end_offset
            result.events += item.count
        return result
    finally:
        os.close(fd)
