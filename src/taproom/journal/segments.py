"""On-disk format of journal segments, and scanning them.

A journal is a directory of segment files named ``<base offset, 20 digits>.seg``. Each segment
starts with a 16-byte header (``b"TAPROOM\\x01"`` + u64 base offset, little-endian) and holds
batch frames back to back::

    u32 body length   u32 CRC32C   u64 base offset   u32 record count   body

The CRC covers base offset, count and body. A frame is valid only if its CRC matches, its base
offset continues the previous frame, its count is non-zero and its body fits in the file: a torn
or zero-filled tail fails one of these and is where recovery truncates.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import crc32c

from ..records import Record, iter_batch

__all__ = [
    "FRAME",
    "MAX_BATCH_BODY",
    "SEGMENT_HEADER",
    "FrameInfo",
    "ScanResult",
    "crc_of",
    "encode_frame_header",
    "iter_frames",
    "records_in_range",
    "scan_segment",
    "segment_batches",
    "segment_name",
]

SEGMENT_MAGIC = b"TAPROOM\x01"
SEGMENT_HEADER = struct.Struct("<8sQ")
FRAME = struct.Struct("<IIQI")
# A single batch body above this is a corrupt length field, not data: group commits are capped
# well below (journal.max_commit_bytes), so anything larger is never allocated.
MAX_BATCH_BODY = 256 * 1024 * 1024
_CRC_PART = struct.Struct("<QI")


def segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}.seg"


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


@dataclass(slots=True)
class ScanResult:
    """Where the valid part of a segment ends and why scanning stopped there."""

    base_offset: int
    valid_end: int  # file position just past the last valid frame
    next_offset: int  # offset after the last valid record
    file_size: int
    index: list[tuple[int, int]] = field(default_factory=list)  # (base offset, position)
    problem: str | None = None  # None: the file ends exactly at a frame boundary


def read_segment_header(fd: int) -> int | None:
    """The base offset in a segment header, or None if the header is torn or foreign."""
    raw = os.pread(fd, SEGMENT_HEADER.size, 0)
    if len(raw) < SEGMENT_HEADER.size:
        return None
    magic, base = SEGMENT_HEADER.unpack(raw)
    return base if magic == SEGMENT_MAGIC else None


def iter_frames(
    fd: int, start_position: int, expected_offset: int, file_size: int, *, verify: bool
) -> Iterator[tuple[FrameInfo, bytes | None, str | None]]:
    """Walk frames from ``start_position``; yields (frame, body or None, problem or None).

    Stops after the first problem. With ``verify`` the body is read and its CRC checked;
    without, only headers are read (fast index building).
    """
    pos = start_position
    expected = expected_offset
    while pos < file_size:
        if file_size - pos < FRAME.size:
            yield FrameInfo(pos, expected, 0, 0), None, "torn frame header"
            return
        length, crc, base, count = FRAME.unpack(os.pread(fd, FRAME.size, pos))
        info = FrameInfo(pos, base, count, length)
        if length > MAX_BATCH_BODY or pos + FRAME.size + length > file_size:
            yield info, None, "frame runs past end of file"
            return
        if count == 0 or base != expected:
            yield info, None, f"frame base {base} count {count}, expected base {expected}"
            return
        body = None
        if verify:
            body = os.pread(fd, length, pos + FRAME.size)
            if len(body) != length or crc_of(base, count, body) != crc:
                yield info, None, "CRC mismatch"
                return
        yield info, body, None
        pos += FRAME.size + length
        expected = base + count


def segment_batches(
    fd: int,
    path: str,
    start: tuple[int, int],
    from_offset: int,
    end_offset: int | None,
    *,
    unfinished_ok: bool,
) -> Iterator[tuple[int, int, bytes]]:
    """Verified ``(base, count, body)`` of one open segment overlapping the offset range.

    ``start`` is a (base offset, file position) to begin the walk at (from a sparse index or
    the segment header). A bad frame raises :class:`CorruptSegment`, unless ``unfinished_ok``
    (the last segment as seen by another process), where it is taken as still being written.
    """
    from ..errors import CorruptSegment  # local: keeps this module free of the error tree

    size = os.fstat(fd).st_size
    for info, body, problem in iter_frames(fd, start[1], start[0], size, verify=True):
        if end_offset is not None and info.base_offset >= end_offset:
            return
        if problem is not None:
            if unfinished_ok:
                return
            raise CorruptSegment(
                f"{os.path.basename(path)}: {problem} at {info.position}",
                segment=path,
                position=info.position,
            )
        if info.base_offset + info.count <= from_offset:
            continue
        assert body is not None
        yield info.base_offset, info.count, body


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


def scan_segment(path: str, *, verify: bool = True) -> ScanResult:
    """Find the valid prefix of one segment file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        name_base = int(os.path.basename(path).split(".")[0])
        base = read_segment_header(fd)
        if base is None or base != name_base:
            return ScanResult(name_base, 0, name_base, size, problem="torn or foreign header")
        result = ScanResult(base, SEGMENT_HEADER.size, base, size)
        for info, _body, problem in iter_frames(fd, SEGMENT_HEADER.size, base, size, verify=verify):
            if problem is not None:
                result.problem = f"{problem} at position {info.position}"
                break
            result.index.append((info.base_offset, info.position))
            result.valid_end = info.position + FRAME.size + info.body_length
            result.next_offset = info.base_offset + info.count
        return result
    finally:
        os.close(fd)
