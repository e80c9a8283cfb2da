"""The durable journal: segmented, append-only, CRC-checked, recovered without crash loops.

One writer (the hub's commit thread) calls :meth:`Journal.commit`; any number of readers call
:meth:`Journal.read_batches` / :meth:`Journal.read` from any thread. Readers never go past
``end_offset`` as it was when they asked, so they never see a half-written batch.

Failure model (DESIGN.md decision 2):

* A torn tail of the active segment (damage with no valid frame after it) found on open is
  truncated, logged and counted; opening never fails because of it.
* Damage anywhere else (a corrupt frame with valid frames after it, in any segment; a damaged
  segment header) is quarantined, never cut: readers walk past it to the next valid frame,
  every later frame keeps its offset, and the lost offsets are a gap that is logged, counted
  (``taproom_journal_lost_events_total{reason}``) and listed by :meth:`Journal.damage`.
* ``ENOSPC`` while writing or while creating the next segment: nothing of the commit stays,
  :class:`DiskFull` is raised and the same offsets are handed out by the next attempt.
* A failed ``fsync`` (or other write error): the descriptor is closed and never trusted again;
  the file is reopened and truncated to the last position known durable, and
  :class:`JournalFailed` is raised so the caller rewrites its batches. Offsets already handed
  out for what was cut (acked under ``fsync = interval``) are never handed out again: the next
  segment starts after them and they are a counted gap.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import DiskFull, JournalError, JournalFailed, OffsetsDeleted
from ..metrics import Metrics
from ..records import EncodedBatch, Record
from .identity import journal_id
from .kinds import Frame, Kind, KindIndex, SegmentKinds, body_labels, declared_cover
from .segments import (
    FRAME,
    SEGMENT_HEADER,
    Damage,
    FrameInfo,
    cut_segment,
    encode_frame_header,
    fsync_dir,
    read_segment_header,
    records_in_range,
    scan_segment,
    segment_base,
    segment_bases,
    segment_frames,
    segment_header,
    segment_name,
    walk_frames,
    write_segment_header,
)

__all__ = ["FSYNC_POLICIES", "Journal", "SegmentInfo"]

log = logging.getLogger("taproom.journal")

try:
    _IOV_MAX = max(16, os.sysconf("SC_IOV_MAX"))
except (AttributeError, ValueError, OSError):  # no sysconf, or the name is unknown
    _IOV_MAX = 1024
FSYNC_POLICIES = ("always", "interval", "off")
# A segment is created under this suffix and renamed into place once its header is on disk.
_CREATING = ".tmp"
# /ready and logs name at most this many damaged regions, then say how many more there are.
_DAMAGE_SHOWN = 5
# Diagnostics (the test suite runs with it): check every batch's declared kinds against its
# records on the commit path. A producer declaring too few would let a restart miss records.
_VERIFY_KINDS = os.environ.get("TAPROOM_VERIFY_KINDS") == "1"


# Page cache behind the write end is dropped in steps of at least this (one fadvise a step).
_DROP_STEP = 4 * 1024 * 1024


@dataclass(slots=True)
class SegmentInfo:
    base_offset: int
    path: str
    size: int
    end_offset: int  # offset after its last record (the next segment's base once sealed)
    index: list[tuple[int, int]] | None = None  # sparse (base offset, position), built lazily
    kinds: SegmentKinds | None = None  # what it holds where (journal.kinds); loaded lazily


class Journal:
    """A directory of segments. Open with ``Journal(path)``; close with :meth:`close`."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: str = "always",
        segment_bytes: int = 128 * 1024 * 1024,
        cache_keep_bytes: int = 32 * 1024 * 1024,
        metrics: Metrics | None = None,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}")
        self.path = str(path)
        self.fsync_policy = fsync
        self.segment_bytes = segment_bytes
        # Durable bytes of the active segment further than this behind its end are dropped
        # from the page cache (0: never): see _drop_behind.
        self.cache_keep_bytes = cache_keep_bytes
        # Durable bytes past the dropped part that start a drop: the kept bytes and a step.
        self._drop_at = cache_keep_bytes + _DROP_STEP if cache_keep_bytes else 1 << 62
        self.metrics = metrics or Metrics()
        self._lock = threading.Lock()  # guards the segment list and the damage map for readers
        self._segments: list[SegmentInfo] = []
        self._damage: dict[tuple[str, int], Damage] = {}
        self._fd = -1
        self._written_pos = 0  # end of the active segment as written
        self._durable_pos = 0  # end of the active segment as known on disk
        self._dropped_pos = 0  # the active segment's page cache is dropped below this
        self._synced_offset = 0  # offset after the last record at _durable_pos
        self._durable_offset = 0  # offsets below are committed: readable, or a counted gap
        self._next_offset = 0
        self._unsynced = False
        self.failed: str | None = None  # why appends are refused, until recovery succeeds
        self._gap_reason = "cut_after_failure"  # why offsets past _synced_offset are lost
        self._m_truncated = self.metrics.counter(
            "journal", "truncated", "bytes", "Bytes cut from a torn tail on open"
        )
        self._m_recoveries = self.metrics.counter(
            "journal", "recoveries", "events", "Recoveries on open or after a failure", ("reason",)
        )
        self._m_lost = self.metrics.counter(
            "journal",
            "lost",
            "events",
            "Offsets with no readable event: quarantined frames, or data cut after a failure",
            ("reason",),
        )
        self._m_quarantined = self.metrics.counter(
            "journal", "quarantined", "bytes", "Damaged segment bytes readers skip", ("reason",)
        )
        # Tallies (taproom.metrics): counted on the write side, one writer (commit, sync)
        self._m_appended = self.metrics.tally(
            "journal", "appended", "events", "Events committed to the journal"
        )
        self._m_bytes = self.metrics.tally(
            "journal", "appended", "bytes", "Bytes committed to the journal (frames included)"
        )
        self._m_fsyncs = self.metrics.tally("journal", "fsync", "calls", "fsync calls made")
        self._m_dropped = self.metrics.tally(
            "journal",
            "cache_dropped",
            "bytes",
            "Durable bytes dropped from the page cache behind the write end (cache_keep_bytes)",
        )
        self._m_deleted = self.metrics.counter(
            "journal", "retention_deleted", "segments", "Sealed segments deleted by retention"
        )
        self._m_unread_deleted = self.metrics.counter(
            "journal",
            "unread_deleted",
            "events",
            "Events retention deleted before a registered cursor passed them (cap reached)",
        )
        os.makedirs(self.path, exist_ok=True)
        self.id = journal_id(self.path)  # created now for a journal made before identities
        self._kinds = KindIndex(self.path, self.id, self._lock)
        self._m_index_rebuilt = self.metrics.counter(
            "journal",
            "index_rebuilt",
            "segments",
            "Segments read whole to rebuild their index (what kinds of record they hold where)",
        )
        self._recover()
        # Offsets at or past this were not in the journal when it was opened: a service's
        # checkpoint from before covering them saw a tail the journal lost (fsync = interval
        # and a crash), so it must not be trusted.
        self.opened_end_offset = self._durable_offset
        self.metrics.gauge_fn(
            "journal", "segments", "count", "Segments on disk", lambda: len(self._segments)
        )
        self.metrics.gauge_fn("journal", "size", "bytes", "Bytes on disk", lambda: self.total_bytes)
        self.metrics.gauge_fn(
            "journal", "next", "offset", "Offset the next event will get", lambda: self._next_offset
        )
        self.metrics.gauge_fn(
            "journal",
            "damaged",
            "regions",
            "Quarantined regions found so far in segments still on disk",
            lambda: len(self._damage),
        )

    # --- opening and recovery ------------------------------------------------------------

    def _recover(self) -> None:
        for name in os.listdir(self.path):
            if name.endswith(".seg" + _CREATING):  # a roll interrupted before its rename
                os.unlink(os.path.join(self.path, name))
        bases = segment_bases(self.path)
        # Before segments were created under a temporary name, a crash while creating one
        # could leave a last file holding part of a header and nothing else.
        while bases:
            last = os.path.join(self.path, segment_name(bases[-1]))
            if os.path.getsize(last) > SEGMENT_HEADER.size or self._header_ok(last):
                break
            self._m_recoveries.labels(reason="torn_segment_header").inc()
            if len(bases) == 1:
                log.warning("journal: rewriting torn header of %s", segment_name(bases[-1]))
                write_segment_header(last, bases[-1])
                break
            log.warning("journal: removing segment %s with a torn header", segment_name(bases[-1]))
            self._m_truncated.inc(os.path.getsize(last))
            os.unlink(last)
            self._kinds.remove(bases[-1])
            fsync_dir(self.path)
            bases.pop()
        for base, next_base in itertools.pairwise(bases):
            path = os.path.join(self.path, segment_name(base))
            self._segments.append(SegmentInfo(base, path, os.path.getsize(path), next_base))
        handed_out = 0
        if bases:
            active, handed_out = self._recover_active(
                os.path.join(self.path, segment_name(bases[-1]))
            )
            self._segments.append(active)
        else:
            path = os.path.join(self.path, segment_name(0))
            self._create_segment(path, 0)
            active_new = SegmentInfo(0, path, SEGMENT_HEADER.size, 0, [])
            active_new.kinds = self._kinds.open_active(path, 0, 0, SEGMENT_HEADER.size)
            self._segments.append(active_new)
        self._next_offset = self._segments[-1].end_offset
        self._open_active()
        self._durable_offset = self._synced_offset = self._next_offset
        if handed_out > self._next_offset:
            # A whole last frame failed its CRC: a torn write, or acked data gone bad. Its
            # offsets may have been acked and fanned out, so new events start after them.
            self._next_offset = self._durable_offset = handed_out
            self._gap_reason = "crc_mismatch"
            try:
                self._continue_after_gap()
            except JournalError as exc:
                self.failed = str(exc)  # the next commit tries again

    @staticmethod
    def _header_ok(path: str) -> bool:
        fd = os.open(path, os.O_RDONLY)
        try:
            return read_segment_header(fd) == segment_base(os.path.basename(path))
        finally:
            os.close(fd)

    def _recover_active(self, path: str) -> tuple[SegmentInfo, int]:
        """Verify the active segment: quarantine damage, cut a torn tail, mend its header.

        Also returns the offset after the last frame whose header was whole (higher than the
        segment's end offset when the cut tail began with a complete frame).
        """
        name = os.path.basename(path)
        result = scan_segment(path)
        if result.header is not None:
            # Its frames are intact and the base is in the file name: write it back.
            log.warning("journal: %s; rewritten from the file name", result.header.describe())
            self._m_recoveries.labels(reason="segment_header").inc()
            write_segment_header(path, result.base_offset)
        for damage in result.damage:
            self._quarantine(damage)
        handed_out = result.next_offset
        if result.tail is not None:
            if result.tail.reason == "crc_mismatch":
                fd = os.open(path, os.O_RDONLY)
                try:
                    _len, _crc, base, count = FRAME.unpack(
                        os.pread(fd, FRAME.size, result.tail.position)
                    )
                finally:
                    os.close(fd)
                handed_out = base + count
            cut = result.file_size - result.tail.position
            log.warning(
                "journal: truncating %d bytes of torn tail in %s (%s at position %d)",
                cut,
                name,
                result.tail.detail,
                result.tail.position,
            )
            self._m_recoveries.labels(reason="torn_tail").inc()
            self._m_truncated.inc(cut)
            cut_segment(path, result.tail.position)
        active = SegmentInfo(
            result.base_offset, path, result.valid_end, result.next_offset, result.index
        )
        rebuilt = self._kinds.rebuilt
        active.kinds = self._kinds.open_active(
            path, result.base_offset, result.next_offset, result.valid_end
        )
        self._m_index_rebuilt.inc(self._kinds.rebuilt - rebuilt)
        return active, handed_out

    def _create_segment(self, path: str, base_offset: int) -> None:
        """Create a segment holding only its header, or nothing at all if that fails."""
        creating = path + _CREATING
        try:
            fd = os.open(creating, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                if os.write(fd, segment_header(base_offset)) != SEGMENT_HEADER.size:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(creating, path)
            fsync_dir(self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(creating)
            if exc.errno == errno.ENOSPC:
                raise DiskFull("no space left on the journal's device for a new segment") from exc
            raise JournalFailed(f"could not create segment {path}: {exc.strerror}") from exc

    def _open_active(self) -> None:
        active = self._segments[-1]
        self._fd = os.open(active.path, os.O_RDWR | os.O_APPEND)
        self._written_pos = self._durable_pos = os.fstat(self._fd).st_size
        self._dropped_pos = 0
        active.size = self._written_pos

    def _drop_behind(self, fd: int, upto: int) -> None:
        """Drop the page cache of the active segment's durable bytes below ``upto``.

        An append-only journal is written once and read back rarely (outputs take committed
        batches from memory; a reader behind by more than cache_keep_bytes is catching up,
        and reads from the disk as it would under memory pressure anyway). Left cached, the
        pages fill memory and each write takes fresh ones: the kernel's copy into newly
        allocated pages was a third of the hub's CPU under Lumberjack ingest on the bench
        machine (issue 32), about three times the cost of a copy into pages just freed.
        Only durable (clean) bytes are dropped: DONTNEED does not drop dirty pages.
        """
        start = self._dropped_pos
        if upto <= start:
            return
        # Advisory: a failure costs only memory, never data.
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, start, upto - start, os.POSIX_FADV_DONTNEED)
            self._m_dropped.inc(upto - start)
        self._dropped_pos = upto

    # --- damage ---------------------------------------------------------------------------

    def _quarantine(self, damage: Damage) -> None:
        """Record damage a reader walked past: logged and counted once per region."""
        key = (damage.segment, damage.position)
        with self._lock:
            if key in self._damage:
                return
            self._damage[key] = damage
        self._m_lost.labels(reason=damage.reason).inc(damage.lost_events)
        self._m_quarantined.labels(reason=damage.reason).inc(damage.nbytes)
        log.warning("journal: quarantined %s", damage.describe())

    def damage(self) -> list[Damage]:
        """Damaged regions found so far (on open, or by any read) in segments still on disk."""
        with self._lock:
            return sorted(self._damage.values(), key=lambda d: (d.segment, d.position))

    def damage_summary(self) -> list[str]:
        """One line per damaged region (at most a few, then a count), for /ready and logs."""
        found = self.damage()
        lines = [f"journal damage quarantined: {d.describe()}" for d in found[:_DAMAGE_SHOWN]]
        if len(found) > _DAMAGE_SHOWN:
            lines.append(f"journal damage quarantined: {len(found) - _DAMAGE_SHOWN} more regions")
        if lines:
            lines.append("run `taproom journal check` for the full list")
        return lines

    # --- writing (the commit thread only) -------------------------------------------------

    @property
    def next_offset(self) -> int:
        return self._next_offset

    @property
    def end_offset(self) -> int:
        """Offsets below this are committed: readable, or a counted gap."""
        return self._durable_offset

    @property
    def first_offset(self) -> int:
        return self._segments[0].base_offset

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self._segments)

    def _roll(self) -> None:
        """Seal the active segment and start a new one at ``next_offset``.

        The new segment is complete on disk before the old one is let go, so a failure here
        (disk full) leaves the active segment as it was and the next commit simply retries.
        """
        if self._unsynced:
            self.sync()
        path = os.path.join(self.path, segment_name(self._next_offset))
        self._create_segment(path, self._next_offset)
        try:
            fd = os.open(path, os.O_RDWR | os.O_APPEND)
        except OSError as exc:
            raise JournalFailed(f"could not open new segment: {exc.strerror}") from exc
        old_fd = self._fd
        sealed = self._segments[-1]
        fresh = SegmentInfo(self._next_offset, path, SEGMENT_HEADER.size, self._next_offset, [])
        fresh.kinds = self._kinds.start_segment(self._next_offset)
        with self._lock:
            sealed.end_offset = self._next_offset
            self._segments.append(fresh)
        assert sealed.kinds is not None
        self._kinds.seal(sealed.kinds, sealed.size)
        if self.cache_keep_bytes:
            # All of the sealed segment (durable: synced above); a reader within the last
            # cache_keep_bytes reads that much of it from the disk once.
            self._drop_behind(old_fd, self._durable_pos)
        self._fd = fd
        self._written_pos = self._durable_pos = SEGMENT_HEADER.size
        self._dropped_pos = 0
        self._synced_offset = self._next_offset
        with contextlib.suppress(OSError):
            os.close(old_fd)

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
        frames: list[Frame] = []
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
            size = len(header) + len(batch.body)
            kinds = batch.kinds if batch.kinds is not None else body_labels(batch.body)
            if _VERIFY_KINDS and not declared_cover(kinds, body_labels(batch.body)):
                raise ValueError(
                    f"a batch declares kinds {sorted(kinds)} but holds "
                    f"{sorted(body_labels(batch.body))}"
                )
            frames.append(Frame(offset, pos, offset + batch.count, pos + size, kinds))
            pos += size
            nbytes += size
            offset += batch.count
            events += batch.count
        self._before_write(active, frames)
        start = self._written_pos
        try:
            self._write_all(parts)
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
            self._durable_to(pos, offset)
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

    def _before_write(self, active: SegmentInfo, frames: list[Frame]) -> None:
        """The index first (journal.kinds): the summary must never miss a kind the segment
        holds, so it is grown, durably, before frames of a new kind are written."""
        assert active.kinds is not None  # always known for the active segment
        try:
            self._kinds.before_write(active.kinds, frames)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DiskFull("no space left on the journal's device for its index") from exc
            raise JournalFailed(f"could not write the journal's index: {exc.strerror}") from exc

    def _write_all(self, parts: list[bytes]) -> None:
        # writev takes at most IOV_MAX pieces (1024 on Linux; more is EINVAL, which would
        # fail the same commit group on every retry): a group of many small batches is
        # written IOV_MAX pieces a call.
        for first in range(0, len(parts), _IOV_MAX):
            chunk = parts[first : first + _IOV_MAX]
            written = os.writev(self._fd, chunk)
            if written != sum(map(len, chunk)):  # short write: finish from one buffer
                rest = memoryview(b"".join(chunk))[written:]
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
        self._gap_reason = "cut_after_failure"
        try:
            os.close(self._fd)
        except OSError:
            pass
        self._fd = -1

    def _try_reopen(self) -> None:
        """Reopen the active segment and cut it back to the last position known durable."""
        active = self._segments[-1]
        if self._fd < 0:
            try:
                fd = os.open(active.path, os.O_RDWR | os.O_APPEND)
                os.ftruncate(fd, self._durable_pos)
                os.fsync(fd)
            except OSError as exc:
                raise JournalFailed(f"journal still failing: {exc.strerror}") from exc
            self._fd = fd
            self._written_pos = self._durable_pos
            self._unsynced = False
            with self._lock:
                active.size = self._durable_pos
                active.end_offset = self._synced_offset
                active.index = None
                if active.kinds is not None:  # it described the frames written ahead
                    active.kinds.truncate(self._synced_offset, self._durable_pos)
        self._continue_after_gap()
        self._m_recoveries.labels(reason="reopen_after_failure").inc()
        log.warning("journal: recovered after failure (%s)", self.failed)
        self.failed = None

    def _continue_after_gap(self) -> None:
        """If offsets were handed out past what the active segment holds (acked already under
        ``fsync = interval``, seen by outputs), start a new segment after them: they stay a
        counted gap and are never handed out again for other events."""
        lost = self._next_offset - self._synced_offset
        if not lost:
            return
        self._roll()  # DiskFull here leaves `failed` set: the next commit tries again
        self._m_lost.labels(reason=self._gap_reason).inc(lost)
        log.error(
            "journal: offsets %d-%d are lost (%s); new events continue at %d",
            self._next_offset - lost,
            self._next_offset - 1,
            self._gap_reason,
            self._next_offset,
        )

    def sync(self) -> None:
        """fsync unsynced writes (policy ``interval``/``off``, and before close)."""
        if self._unsynced and self._fd >= 0:
            try:
                os.fsync(self._fd)
            except OSError as exc:
                # Data written since the last good fsync may be gone from the page cache.
                self._fail(f"fsync failed: {exc.strerror}")
                raise JournalFailed(f"fsync failed: {exc.strerror}") from exc
            self._m_fsyncs.inc()
            self._unsynced = False
            self._durable_to(self._written_pos, self._next_offset)

    def _durable_to(self, pos: int, offset: int) -> None:
        """After a good fsync: the active segment is durable up to byte ``pos`` (offsets below
        ``offset``), and its page cache is dropped behind that once it is a step past
        cache_keep_bytes (one place for the commit path and :meth:`sync`)."""
        self._durable_pos = pos
        self._synced_offset = offset
        if pos - self._dropped_pos > self._drop_at:
            self._drop_behind(self._fd, pos - self.cache_keep_bytes)

    def enforce_retention(
        self,
        retention_bytes: int,
        retention_age_s: float,
        now: float | None = None,
        *,
        unread: Mapping[str, int] | None = None,
        unread_max_bytes: int = 0,
    ) -> int:
        """Delete whole sealed segments over the byte or age bound; how many were deleted.

        ``unread`` (cursor name -> the next offset that reader wants) keeps every segment a
        cursor has not passed while the journal holds at most ``unread_max_bytes``; past that
        cap the oldest go anyway, and the events deleted unread are logged with the cursors
        that lose them and counted (``taproom_journal_unread_deleted_events_total``).
        """
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
            name = os.path.basename(oldest.path)
            behind = {c: o for c, o in (unread or {}).items() if o < oldest.end_offset}
            if behind:
                if self.total_bytes <= unread_max_bytes:
                    break  # a registered reader has not passed it yet
                first_unread = max(oldest.base_offset, min(behind.values()))
                self._m_unread_deleted.inc(oldest.end_offset - first_unread)
                log.error(
                    "journal: retention deleted %s before %s read it: offsets %d-%d lost to "
                    "them (the journal reached retain_unread_max_bytes, %d bytes)",
                    name,
                    ", ".join(sorted(behind)),
                    first_unread,
                    oldest.end_offset - 1,
                    unread_max_bytes,
                )
            with self._lock:
                self._segments.pop(0)
                for key in [k for k in self._damage if k[0] == name]:
                    del self._damage[key]
            try:
                os.unlink(oldest.path)
            except FileNotFoundError:
                pass
            self._kinds.remove(oldest.base_offset)
            deleted += 1
            self._m_deleted.inc()
            log.info("journal: retention deleted %s", name)
        if deleted:
            fsync_dir(self.path)
        return deleted

    def close(self) -> None:
        self._kinds.close()
        if self._fd >= 0:
            try:
                self.sync()
            finally:
                if self._fd >= 0:
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
            name = os.path.basename(seg.path)
            for item in walk_frames(
                fd, name, SEGMENT_HEADER.size, seg.base_offset, size, verify=False
            ):
                if isinstance(item, Damage):
                    continue  # reads walk it again with CRCs checked, and report it
                if item.base_offset >= limit:
                    break
                index.append((item.base_offset, item.position))
            seg.index = index
        return seg.index

    def kinds_of(self, seg: SegmentInfo, next_base: int | None) -> SegmentKinds:
        """What ``seg`` holds where (journal.kinds): a copy for the active segment, else from
        its index files, or read from the segment when they are missing or stale (kept for
        next time). ``next_base``: the next segment's base (None for the active segment)."""
        with self._lock:
            kinds = seg.kinds
            if kinds is not None:
                return kinds.copy() if seg is self._segments[-1] else kinds
        assert next_base is not None  # the active segment's index is always in memory
        rebuilt = self._kinds.rebuilt
        kinds = self._kinds.load_sealed(seg.path, seg.base_offset, next_base, seg.size)
        self._m_index_rebuilt.inc(self._kinds.rebuilt - rebuilt)
        with self._lock:
            seg.kinds = kinds
        return kinds

    def read_frames(
        self,
        from_offset: int = 0,
        end_offset: int | None = None,
        *,
        kind: Kind | None = None,
        skip_deleted: bool = True,
    ) -> Iterator[FrameInfo]:
        """Committed frames, verified (``body`` read, CRC checked, ``header`` as stored), from
        the one holding ``from_offset`` up to ``end_offset`` (default: the end when called).
        With ``kind``, only the frames that may hold records of that kind are read: the index
        (journal.kinds) skips segments, and runs of frames, that hold none, without reading
        them. Other records can still be in the frames given: filter records.

        The first frame may start before ``from_offset``. Quarantined damage is skipped (and
        reported, see :meth:`damage`): its offsets are a gap between the frames yielded. A
        segment that retention deletes before the walk reaches it is skipped too, unless
        ``skip_deleted`` is False: then :class:`OffsetsDeleted` is raised instead (a reader
        that must never skip silently, such as the network read API).
        """
        end = self._durable_offset if end_offset is None else min(end_offset, self._durable_offset)
        segments = self.segments()
        bases = [s.base_offset for s in segments]
        first = max(bisect.bisect_right(bases, from_offset) - 1, 0)
        for i in range(first, len(segments)):
            seg = segments[i]
            if seg.base_offset >= end:
                return
            next_base = bases[i + 1] if i + 1 < len(bases) else None
            if kind is not None:
                yield from self._read_kind(seg, next_base, kind, from_offset, end, skip_deleted)
                continue
            try:
                fd = os.open(seg.path, os.O_RDONLY)
            except FileNotFoundError:
                if skip_deleted:
                    continue  # deleted by retention while we read: move on to newer data
                raise OffsetsDeleted(
                    f"segment {os.path.basename(seg.path)} was deleted by retention while "
                    "being read",
                    requested=max(from_offset, seg.base_offset),
                    first_offset=self.first_offset,
                ) from None
            try:
                index = self._segment_index(seg, fd, end)
                start = (seg.base_offset, SEGMENT_HEADER.size)
                k = bisect.bisect_right(index, (from_offset, float("inf"))) - 1
                if k >= 0:
                    start = index[k]
                yield from segment_frames(
                    fd,
                    seg.path,
                    start,
                    from_offset,
                    end,
                    sealed_end=next_base,
                    on_damage=self._quarantine,
                )
            finally:
                os.close(fd)

    def _read_kind(
        self,
        seg: SegmentInfo,
        next_base: int | None,
        kind: Kind,
        from_offset: int,
        end: int,
        skip_deleted: bool,
    ) -> Iterator[FrameInfo]:
        """The frames of ``seg`` in ``[from_offset, end)`` that may hold ``kind``."""
        try:
            spans = list(self.kinds_of(seg, next_base).spans(kind, from_offset, end))
        except FileNotFoundError:
            spans = []  # deleted by retention: the open below says how to take it
        if not spans:
            return
        try:
            fd = os.open(seg.path, os.O_RDONLY)
        except FileNotFoundError:
            if skip_deleted:
                return
            raise OffsetsDeleted(
                f"segment {os.path.basename(seg.path)} was deleted by retention while being read",
                requested=max(from_offset, seg.base_offset),
                first_offset=self.first_offset,
            ) from None
        index = seg.index  # the frames' positions, when known: start near from_offset
        try:
            for first, position, span_end in spans:
                if index and from_offset > first:
                    k = bisect.bisect_right(index, (from_offset, float("inf"))) - 1
                    if k >= 0 and index[k][0] > first:
                        first, position = index[k]
                yield from segment_frames(
                    fd,
                    seg.path,
                    (first, position),
                    from_offset,
                    min(span_end, end),
                    sealed_end=next_base,
                    on_damage=self._quarantine,
                )
        finally:
            os.close(fd)

    def read_batches(
        self, from_offset: int = 0, end_offset: int | None = None, *, kind: Kind | None = None
    ) -> Iterator[tuple[int, int, bytes]]:
        """:meth:`read_frames` as ``(base offset, count, body)``; use :meth:`read` for records."""
        for frame in self.read_frames(from_offset, end_offset, kind=kind):
            assert frame.body is not None
            yield frame.base_offset, frame.count, frame.body

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
            "id": self.id,
            "fsync": self.fsync_policy,
            "damaged_regions": len(self._damage),
        }
