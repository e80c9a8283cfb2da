"""The durable journal: segmented, append-only, CRC-checked, recovered without crash loops.

One writer (the hub's commit thread) calls :meth:`Journal.commit`; any number of readers call
:meth:`Journal.read_batches` / :meth:`Journal.read` from any thread. Readers never go past
``end_offset`` as it was when they asked, so they never see a half-written batch.

Failure model (DESIGN.md decision 2):

* A torn or corrupt tail found on open is truncated, logged and counted; opening never fails
  because of it.
* ``ENOSPC`` while writing: the partial write is cut off again, :class:`DiskFull` is raised and
  the offsets are handed out again by the next attempt. Nothing was acknowledged.
* A failed ``fsync`` (or other write error): the descriptor is closed and never trusted again;
  the file is reopened and truncated to the last position known durable, and
  :class:`JournalFailed` is raised so the caller rewrites the batches.
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DiskFull, JournalError, JournalFailed
from ..metrics import Metrics
from ..records import EncodedBatch, Record
from .segments import (
    SEGMENT_HEADER,
    SEGMENT_MAGIC,
    encode_frame_header,
    iter_frames,
    read_segment_header,
    records_in_range,
    scan_segment,
    segment_batches,
    segment_name,
)

__all__ = ["FSYNC_POLICIES", "Journal", "SegmentInfo"]

log = logging.getLogger("taproom.journal")
FSYNC_POLICIES = ("always", "interval", "off")


@dataclass(slots=True)
class SegmentInfo:
    base_offset: int
    path: str
    size: int
    end_offset: int  # offset after its last record (known for sealed and active segments)
    index: list[tuple[int, int]] | None = None  # sparse (base offset, position), built lazily


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """A directory of segments. Open with ``Journal(path)``; close with :meth:`close`."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: str = "always",
        segment_bytes: int = 128 * 1024 * 1024,
        metrics: Metrics | None = None,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}")
        self.path = str(path)
        self.fsync_policy = fsync
        self.segment_bytes = segment_bytes
        self.metrics = metrics or Metrics()
        self._lock = threading.Lock()  # guards the segment list for readers
        self._segments: list[SegmentInfo] = []
        self._fd = -1
        self._written_pos = 0  # end of the active segment as written
        self._durable_pos = 0  # end of the active segment as known on disk
        self._durable_offset = 0
        self._next_offset = 0
        self._unsynced = False
        self.failed: str | None = None  # why appends are refused, until recovery succeeds
        self._m_truncated = self.metrics.counter(
            "journal", "truncated", "bytes", "Bytes cut from a torn or corrupt tail on open"
        )
        self._m_recoveries = self.metrics.counter(
            "journal", "recoveries", "events", "Recoveries on open or after a failure", ("reason",)
        )
        self._m_appended = self.metrics.counter(
            "journal", "appended", "events", "Events committed to the journal"
        )
        self._m_bytes = self.metrics.counter(
            "journal", "appended", "bytes", "Bytes committed to the journal (frames included)"
        )
        self._m_fsyncs = self.metrics.counter("journal", "fsync", "calls", "fsync calls made")
        self._m_deleted = self.metrics.counter(
            "journal", "retention_deleted", "segments", "Sealed segments deleted by retention"
        )
        os.makedirs(self.path, exist_ok=True)
        self._recover()
        self.metrics.gauge_fn(
            "journal", "segments", "count", "Segments on disk", lambda: len(self._segments)
        )
        self.metrics.gauge_fn("journal", "size", "bytes", "Bytes on disk", lambda: self.total_bytes)
        self.metrics.gauge_fn(
            "journal", "next", "offset", "Offset the next event will get", lambda: self._next_offset
        )

    # --- opening and recovery ------------------------------------------------------------

    def _list_segment_files(self) -> list[str]:
        names = [n for n in os.listdir(self.path) if n.endswith(".seg") and n[:-4].isdigit()]
        return sorted(names, key=lambda n: int(n[:-4]))

    def _recover(self) -> None:
        names = self._list_segment_files()
        # A crash while creating a segment can leave a file with a torn header at the end.
        while names:
            last = os.path.join(self.path, names[-1])
            result = scan_segment(last)
            if result.problem == "torn or foreign header" and len(names) > 1:
                log.warning("journal: removing segment %s with a torn header", names[-1])
                self._m_truncated.inc(result.file_size)
                self._m_recoveries.labels(reason="torn_segment_header").inc()
                os.unlink(last)
                _fsync_dir(self.path)
                names.pop()
                continue
            break
        for name in names[:-1]:
            base = int(name[:-4])
            size = os.path.getsize(os.path.join(self.path, name))
            self._segments.append(SegmentInfo(base, os.path.join(self.path, name), size, -1))
        # End offsets of sealed segments: the next segment's base.
        for i, seg in enumerate(self._segments):
            nxt = self._segments[i + 1].base_offset if i + 1 < len(self._segments) else None
            seg.end_offset = nxt if nxt is not None else -1
        if names:
            last_path = os.path.join(self.path, names[-1])
            result = scan_segment(last_path)
            if self._segments:
                self._segments[-1].end_offset = result.base_offset
            if result.problem is not None:
                cut = result.file_size - result.valid_end
                if result.problem == "torn or foreign header":
                    log.warning("journal: rewriting torn header of %s", names[-1])
                    self._m_recoveries.labels(reason="torn_segment_header").inc()
                    self._write_new_segment_file(last_path, result.base_offset, truncate=True)
                    result.valid_end = SEGMENT_HEADER.size
                else:
                    log.warning(
                        "journal: truncating %d bytes of torn tail in %s (%s)",
                        cut,
                        names[-1],
                        result.problem,
                    )
                    self._m_recoveries.labels(reason="torn_tail").inc()
                    fd = os.open(last_path, os.O_RDWR)
                    try:
                        os.ftruncate(fd, result.valid_end)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                self._m_truncated.inc(max(cut, 0))
            active = SegmentInfo(
                result.base_offset, last_path, result.valid_end, result.next_offset, result.index
            )
            self._segments.append(active)
            self._next_offset = result.next_offset
        else:
            path = os.path.join(self.path, segment_name(0))
            self._write_new_segment_file(path, 0)
            self._segments.append(SegmentInfo(0, path, SEGMENT_HEADER.size, 0, []))
            self._next_offset = 0
        self._open_active()
        self._durable_offset = self._next_offset

    def _write_new_segment_file(
        self, path: str, base_offset: int, *, truncate: bool = False
    ) -> None:
        flags = os.O_RDWR | os.O_CREAT | (os.O_TRUNC if truncate else os.O_EXCL)
        fd = os.open(path, flags, 0o644)
        try:
            os.write(fd, SEGMENT_HEADER.pack(SEGMENT_MAGIC, base_offset))
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(self.path)

    def _open_active(self) -> None:
        active = self._segments[-1]
        self._fd = os.open(active.path, os.O_RDWR | os.O_APPEND)
        self._written_pos = self._durable_pos = os.fstat(self._fd).st_size
        active.size = self._written_pos

    # --- writing (the commit thread only) -------------------------------------------------

    @property
    def next_offset(self) -> int:
        return self._next_offset

    @property
    def end_offset(self) -> int:
        """Offsets below this are committed and readable."""
        return self._durable_offset

    @property
    def first_offset(self) -> int:
        return self._segments[0].base_offset

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self._segments)

    def _roll(self) -> None:
        """Seal the active segment and start a new one at ``next_offset``."""
        if self._unsynced:
            os.fsync(self._fd)
            self._m_fsyncs.inc()
            self._unsynced = False
        os.close(self._fd)
        self._fd = -1
        path = os.path.join(self.path, segment_name(self._next_offset))
        self._write_new_segment_file(path, self._next_offset)
        with self._lock:
            self._segments[-1].end_offset = self._next_offset
            self._segments.append(
                SegmentInfo(self._next_offset, path, SEGMENT_HEADER.size, self._next_offset, [])
            )
        self._open_active()

    def commit(self, batches: Sequence[EncodedBatch]) -> list[int]:
        """Write ``batches`` and make them durable per the fsync policy; their base offsets.

        All or nothing: on error nothing of this call is in the journal and the same offsets
        will be handed out again.
        """
        if self.failed is not None:
            self._try_reopen()
        if not batches:
            return []
        active = self._segments[-1]
        if active.size >= self.segment_bytes and active.end_offset > active.base_offset:
            self._roll()
            active = self._segments[-1]
        parts: list[bytes] = []
        bases: list[int] = []
        offset = self._next_offset
        index_add: list[tuple[int, int]] = []
        pos = self._written_pos
        nbytes = 0
        events = 0
        for batch in batches:
            if batch.count <= 0:
                raise ValueError("empty batch")
            header = encode_frame_header(offset, batch.count, batch.body)
            parts += (header, batch.body)
            bases.append(offset)
            index_add.append((offset, pos))
            pos += len(header) + len(batch.body)
            nbytes += len(header) + len(batch.body)
            offset += batch.count
            events += batch.count
        start = self._written_pos
        try:
            self._write_all(parts, nbytes)
        except OSError as exc:
            self._rollback_write(start, exc)
        self._written_pos = pos
        try:
            if self.fsync_policy == "always":
                os.fsync(self._fd)
                self._m_fsyncs.inc()
            else:
                self._unsynced = True
        except OSError as exc:
            self._fail(f"fsync failed: {exc.strerror}")
            raise JournalFailed(f"fsync failed: {exc.strerror}") from exc
        if self.fsync_policy == "always":
            self._durable_pos = pos
        self._next_offset = offset
        with self._lock:
            active.size = pos
            active.end_offset = offset
            if active.index is not None:
                active.index.extend(index_add)
        self._durable_offset = offset
        self._m_appended.inc(events)
        self._m_bytes.inc(nbytes)
        return bases

    def _write_all(self, parts: list[bytes], nbytes: int) -> None:
        written = os.writev(self._fd, parts)
        if written != nbytes:  # short write: finish the rest from one buffer
            rest = memoryview(b"".join(parts))[written:]
            while rest:
                n = os.write(self._fd, rest)
                rest = rest[n:]

    def _rollback_write(self, start: int, exc: OSError) -> None:
        try:
            os.ftruncate(self._fd, start)
        except OSError:
            self._fail(f"write failed and could not be cut back: {exc.strerror}")
            raise JournalFailed(f"write failed: {exc.strerror}") from exc
        if exc.errno == errno.ENOSPC:
            raise DiskFull("no space left on the journal's device") from exc
        self._fail(f"write failed: {exc.strerror}")
        raise JournalFailed(f"write failed: {exc.strerror}") from exc

    def _fail(self, reason: str) -> None:
        """Stop trusting the descriptor: it is closed and reopened before the next write."""
        log.error(
            "journal: %s; descriptor dropped, will reopen and truncate to durable data", reason
        )
        self.failed = reason
        try:
            os.close(self._fd)
        except OSError:
            pass
        self._fd = -1

    def _try_reopen(self) -> None:
        """Reopen the active segment and cut it back to the last position known durable."""
        active = self._segments[-1]
        try:
            fd = os.open(active.path, os.O_RDWR | os.O_APPEND)
            os.ftruncate(fd, self._durable_pos)
            os.fsync(fd)
        except OSError as exc:
            raise JournalFailed(f"journal still failing: {exc.strerror}") from exc
        self._fd = fd
        self._written_pos = self._durable_pos
        self._next_offset = self._durable_offset
        with self._lock:
            active.size = self._durable_pos
            active.end_offset = self._durable_offset
            active.index = None
        self._m_recoveries.labels(reason="reopen_after_failure").inc()
        log.warning("journal: recovered after failure (%s)", self.failed)
        self.failed = None

    def sync(self) -> None:
        """fsync unsynced writes (policy ``interval``/``off``, and before close)."""
        if self._unsynced and self._fd >= 0:
            try:
                os.fsync(self._fd)
            except OSError as exc:
                # Data written since the last good fsync may be gone from the page cache.
                self._durable_offset = min(self._durable_offset, self._next_offset)
                self._fail(f"fsync failed: {exc.strerror}")
                raise JournalFailed(f"fsync failed: {exc.strerror}") from exc
            self._m_fsyncs.inc()
            self._unsynced = False
            self._durable_pos = self._written_pos

    def enforce_retention(
        self, retention_bytes: int, retention_age_s: float, now: float | None = None
    ) -> int:
        """Delete whole sealed segments over the byte or age bound; how many were deleted."""
        now = time.time() if now is None else now
        deleted = 0
        while len(self._segments) > 1:
            oldest = self._segments[0]
            over_size = retention_bytes > 0 and self.total_bytes > retention_bytes
            try:
                mtime = os.stat(oldest.path).st_mtime
            except FileNotFoundError:
                mtime = 0.0
            over_age = retention_age_s > 0 and mtime < now - retention_age_s
            if not (over_size or over_age):
                break
            with self._lock:
                self._segments.pop(0)
            try:
                os.unlink(oldest.path)
            except FileNotFoundError:
                pass
            deleted += 1
            self._m_deleted.inc()
            log.info("journal: retention deleted %s", os.path.basename(oldest.path))
        if deleted:
            _fsync_dir(self.path)
        return deleted

    def close(self) -> None:
        if self._fd >= 0:
            try:
                self.sync()
            finally:
                os.close(self._fd)
                self._fd = -1

    # --- reading (any thread) -------------------------------------------------------------

    def segments(self) -> list[SegmentInfo]:
        with self._lock:
            return list(self._segments)

    def _segment_index(self, seg: SegmentInfo, fd: int, limit: int) -> list[tuple[int, int]]:
        if seg.index is None:
            index = []
            size = os.fstat(fd).st_size
            for info, _body, problem in iter_frames(
                fd, SEGMENT_HEADER.size, seg.base_offset, size, verify=False
            ):
                if problem is not None or info.base_offset >= limit:
                    break
                index.append((info.base_offset, info.position))
            seg.index = index
        return seg.index

    def read_batches(
        self, from_offset: int = 0, end_offset: int | None = None
    ) -> Iterator[tuple[int, int, bytes]]:
        """Committed batches as ``(base offset, count, body)``, from the one holding
        ``from_offset`` up to ``end_offset`` (default: the end when called).

        The first batch may start before ``from_offset``; use :meth:`read` for records.
        Raises :class:`CorruptSegment` if a committed batch fails its CRC.
        """
        end = self._durable_offset if end_offset is None else min(end_offset, self._durable_offset)
        segments = self.segments()
        bases = [s.base_offset for s in segments]
        i = max(bisect.bisect_right(bases, from_offset) - 1, 0)
        for seg in segments[i:]:
            if seg.base_offset >= end:
                return
            try:
                fd = os.open(seg.path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # deleted by retention while we read: move on to newer data
            try:
                index = self._segment_index(seg, fd, end)
                start = (seg.base_offset, SEGMENT_HEADER.size)
                k = bisect.bisect_right(index, (from_offset, float("inf"))) - 1
                if k >= 0:
                    start = index[k]
                yield from segment_batches(
                    fd, seg.path, start, from_offset, end, unfinished_ok=False
                )
            finally:
                os.close(fd)

    def read(self, from_offset: int = 0, end_offset: int | None = None) -> Iterator[Record]:
        """Committed records with ``from_offset <= offset < end_offset``."""
        return records_in_range(self.read_batches(from_offset, end_offset), from_offset, end_offset)

    # --- inspection -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        segments = self.segments()
        return {
            "path": self.path,
            "segments": len(segments),
            "bytes": sum(s.size for s in segments),
            "first_offset": segments[0].base_offset,
            "next_offset": self._next_offset,
            "events": self._next_offset - segments[0].base_offset,
            "fsync": self.fsync_policy,
        }


def check_journal(path: str | os.PathLike[str], *, repair: bool = False) -> dict[str, Any]:
    """Verify every CRC of every segment without opening the journal for writing.

    Returns a report; with ``repair`` a segment is truncated at its first bad frame (a sealed
    segment cut this way leaves a gap in offsets, which readers skip and the report states).
    """
    root = Path(path)
    if not root.is_dir():
        raise JournalError(f"{path}: not a journal directory")
    names = sorted(
        (n.name for n in root.iterdir() if n.suffix == ".seg" and n.stem.isdigit()),
        key=lambda n: int(n[:-4]),
    )
    report: dict[str, Any] = {"segments": len(names), "batches": 0, "events": 0, "problems": []}
    expected: int | None = None
    for name in names:
        seg_path = str(root / name)
        result = scan_segment(seg_path, verify=True)
        report["batches"] += len(result.index)
        report["events"] += result.next_offset - result.base_offset
        if expected is not None and result.base_offset != expected:
            report["problems"].append(
                {
                    "segment": name,
                    "problem": f"gap: expected base {expected}, found {result.base_offset}",
                }
            )
        expected = result.next_offset
        if result.problem is not None:
            entry: dict[str, Any] = {
                "segment": name,
                "problem": result.problem,
                "valid_bytes": result.valid_end,
                "bytes_after": result.file_size - result.valid_end,
            }
            if repair and result.valid_end >= SEGMENT_HEADER.size:
                fd = os.open(seg_path, os.O_RDWR)
                try:
                    os.ftruncate(fd, result.valid_end)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                entry["repaired"] = True
            report["problems"].append(entry)
    report["ok"] = not report["problems"]
    return report


# re-exported for tests that want to look at a header directly
__all__ += ["check_journal", "read_segment_header"]
