"""Which kinds of record each part of the journal holds, so that a reader looking for one kind
(a service rebuilding its state at start) skips in O(1) what holds none of it.

A record's kind is its protocol and content type. A *label* names kinds: ``"eventbus/msgpack"``
(that pair), ``"eventbus/*"`` (any content type of the protocol), ``"*"`` (anything: not known).
Batches declare their labels (``EncodedBatch.kinds``: the ``BatchBuilder`` and the hot paths
that write records directly know them); a batch declaring none is classified by reading its
records (:func:`body_labels`). Nothing on the commit path reads records.

Each segment has two files in ``<journal>/index``, both derived data:

* ``<base:020d>.kinds``, the *summary*: every label the segment may hold (magic line, CRC-32,
  JSON ``base``, ``journal`` id, ``labels``; ``size`` once sealed). It is written **ahead of the
  data** and fsynced: before the commit thread writes a frame whose labels the summary lacks, the
  grown summary is on disk. So it names every kind the segment can hold whatever happens to the
  segment later (torn tail, crash, power loss): it may name a kind no longer there, never miss
  one. It grows a few times per segment, so it costs a few fsyncs per segment.
* ``<base:020d>.runs``, the *runs*: the segment's frames as runs of consecutive frames with the
  same labels, each with its first offset and file position, so a reader jumps from one run of
  its kind to the next. Appended (not fsynced) before each group commit's write: one chunk with
  the group's new labels and runs and the offset and position the group ends at, CRC-checked. A
  chunk describes the segment from its first frame on and replaces whatever the log said from
  there (a commit retried after a failed write rewrites the same frames). Its header names the
  segment's base and the journal's id.

Trust: the summary is a superset by construction; the runs are checked against the segment.
A torn or missing chunk ends the log; what it no longer describes is read from the segment
(at open for the active segment: the frames of the last group or two; on first use for a sealed
one, which must be described to its last byte). A summary that is missing, fails its CRC, names
another journal or base, or was sealed at another size (the file was replaced) is *stale*: both
files are rebuilt by reading the segment once. So a journal written before summaries existed
costs one read of each segment, once; deleting ``index/`` costs the same.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import orjson

from ..checkpoint import load_checkpoint, save_checkpoint
from ..records import RECORD_HEAD
from .segments import SEGMENT_HEADER, Damage, fsync_dir, walk_frames

__all__ = [
    "ANY",
    "Kind",
    "KindIndex",
    "SegmentKinds",
    "body_labels",
    "covers",
    "declared_cover",
    "label",
]

log = logging.getLogger("taproom.journal")

ANY = "*"
_SUMMARY_MAGIC = b"TAPROOM-SEGMENT-KINDS-1\n"
_RUNS_MAGIC = b"TAPROOM-SEGMENT-RUNS-1\n"
_BASE = struct.Struct("<Q")
_CHUNK = struct.Struct("<II")  # payload length, CRC-32 of the payload
_RUN = np.dtype([("offset", "<u8"), ("position", "<u8"), ("mask", "<u8")])
_RUN_STRUCT = struct.Struct("<QQQ")
_SPAN = struct.Struct("<QQ")  # (offset, position)
_COUNT = struct.Struct("<I")
_LABEL_COUNT = struct.Struct("<H")
_HEAD = RECORD_HEAD.size
_LENGTH = struct.Struct("<I")
_LP_AT = 28  # RECORD_HEAD: len(protocol), then len(content_type), after u32 i64 i64 u64
_MAX_LABELS = 63  # labels one segment's runs can name; past it, the rest share ANY's bit
# A group of frames that changes no run is logged with the next chunk, at most this far on.
_LOG_EVERY_BYTES = 4 << 20


class Kind(NamedTuple):
    """What a reader looks for: a protocol, and one content type of it (None: any)."""

    protocol: str
    content_type: str | None = None


def label(protocol: str, content_type: str | None = None) -> str:
    """The label of records of ``protocol`` with ``content_type`` (None: any content type)."""
    return f"{protocol}/{ANY if content_type is None else content_type}"


def covers(labels: Iterable[str], kind: Kind) -> bool:
    """Whether records of ``kind`` may be among those ``labels`` name."""
    return any(_covers(name, kind) for name in labels)


def _covers(name: str, kind: Kind) -> bool:
    if name == ANY:
        return True
    protocol, _, content_type = name.partition("/")
    return protocol == kind.protocol and (
        kind.content_type is None or content_type in (ANY, kind.content_type)
    )


def declared_cover(declared: Iterable[str], actual: Iterable[str]) -> bool:
    """Whether the ``declared`` labels of a batch name every label it really holds."""
    declared = set(declared)
    if ANY in declared:
        return True
    for name in actual:
        protocol, _, _content_type = name.partition("/")
        if name not in declared and f"{protocol}/{ANY}" not in declared:
            return False
    return True


def body_labels(body: bytes | memoryview) -> frozenset[str]:
    """The labels of the records of one batch body, read record by record (a batch that did
    not declare its kinds). A body that does not parse is labelled ``*``."""
    seen: set[bytes] = set()
    found: set[str] = set()
    unpack = _LENGTH.unpack_from
    pos = 0
    end = len(body)
    try:
        while pos < end:
            lp = body[pos + _LP_AT]
            lc = body[pos + _LP_AT + 1]
            q = pos + _HEAD
            raw = bytes(body[q : q + lp + lc])
            if raw not in seen:
                seen.add(raw)
                found.add(
                    label(
                        raw[:lp].decode("utf-8", "surrogateescape"),
                        raw[lp:].decode("utf-8", "surrogateescape"),
                    )
                )
            pos += 4 + unpack(body, pos)[0]
    except (IndexError, struct.error):
        return frozenset({ANY})
    return frozenset(found)


@dataclass
class SegmentKinds:
    """One segment's summary and runs.

    ``runs`` describe the frames below ``end_offset`` (whose bytes end at ``end_position``);
    frames after it, if any, are known only by the summary. Run ``i`` holds frames from
    ``offsets[i]`` to the next run's offset; its labels are the bits of ``masks[i]`` over
    ``labels``.
    """

    base: int
    summary: frozenset[str]
    labels: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    masks: list[int] = field(default_factory=list)
    end_offset: int = 0
    end_position: int = SEGMENT_HEADER.size
    # The bits of each label set met so far (the commit path looks each batch's up once).
    masks_of: dict[frozenset[str], int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.end_offset:
            self.end_offset = self.base

    def mask_of(self, labels: frozenset[str], new: list[str]) -> int:
        """The bits of ``labels``, appending labels not seen yet to the table and to ``new``
        (past the table's size, a new label shares the bit of ``*``)."""
        mask = self.masks_of.get(labels)
        if mask is not None:
            return mask
        mask = 0
        for name in labels:
            if name not in self.labels:
                if len(self.labels) >= _MAX_LABELS - 1:
                    name = ANY
                if name not in self.labels:
                    self.labels.append(name)
                    new.append(name)
            mask |= 1 << self.labels.index(name)
        self.masks_of[labels] = mask
        return mask

    def cut(self, offset: int) -> None:
        """Forget what the runs say from ``offset`` on (a chunk rewriting it follows)."""
        k = np.searchsorted(np.asarray(self.offsets, dtype=np.uint64), offset, side="left")
        del self.offsets[k:], self.positions[k:], self.masks[k:]

    def truncate(self, end_offset: int, end_position: int) -> None:
        """The segment was cut at ``end_offset`` (bytes end at ``end_position``): the runs
        still hold for the frames left, and say nothing past them."""
        if end_offset < self.end_offset:
            self.cut(end_offset)
            self.end_offset, self.end_position = end_offset, end_position

    def spans(self, kind: Kind, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """``(first offset, position, end offset)`` of each stretch of runs that may hold
        ``kind`` and overlaps ``[lo, hi)``; then, if frames after the runs overlap, one span
        for them (known only by the summary)."""
        if not covers(self.summary, kind):
            return
        wanted = 0
        for bit, name in enumerate(self.labels):
            if _covers(name, kind):
                wanted |= 1 << bit
        offsets = np.asarray(self.offsets, dtype=np.uint64)
        n = len(offsets)
        if n and wanted and lo < self.end_offset:
            masks = np.asarray(self.masks, dtype=np.uint64)
            ends = np.append(offsets[1:], np.uint64(self.end_offset))
            hit = (masks & np.uint64(wanted)) != 0
            hit &= (ends > np.uint64(lo)) & (offsets < np.uint64(hi))
            # Maximal stretches of consecutive hits: read as one walk each.
            edges = np.flatnonzero(np.diff(np.concatenate(([0], hit.view(np.int8), [0]))))
            for first, stop in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
                yield int(offsets[first]), int(self.positions[first]), int(ends[stop - 1])
        if hi > self.end_offset:
            yield self.end_offset, self.end_position, hi

    def copy(self) -> SegmentKinds:
        """A snapshot a reader can use while the commit thread goes on appending."""
        return SegmentKinds(
            self.base,
            self.summary,
            list(self.labels),
            list(self.offsets),
            list(self.positions),
            list(self.masks),
            self.end_offset,
            self.end_position,
        )


class Frame(NamedTuple):
    """A frame as the index sees it: where it starts and ends, and what it holds."""

    offset: int
    position: int
    end_offset: int
    end_position: int
    labels: frozenset[str]


def _read_frames(
    path: str, base: int, end_bound: int | None, start: tuple[int, int]
) -> list[Frame]:
    """The verified frames of a segment from ``start`` on, with their labels (damage holds
    nothing readable, and is reported by the readers that meet it)."""
    frames: list[Frame] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        name = os.path.basename(path)
        for item in walk_frames(
            fd, name, start[1], start[0], size, verify=True, end_bound=end_bound
        ):
            if isinstance(item, Damage):
                continue
            assert item.body is not None
            frames.append(
                Frame(
                    item.base_offset,
                    item.position,
                    item.end_offset,
                    item.end_position,
                    body_labels(item.body),
                )
            )
    finally:
        os.close(fd)
    return frames


class KindIndex:
    """The summaries and runs of one journal's segments, in ``<journal>/index``."""

    def __init__(self, journal_dir: str, journal_id: str, lock: threading.Lock) -> None:
        self.dir = os.path.join(journal_dir, "index")
        self.journal_id = journal_id
        # The journal's lock: readers copy the active segment's runs under it while the commit
        # thread appends to them.
        self._lock = lock
        self.rebuilt = 0  # segments read for their index (metrics, tests)
        self._log_fd = -1  # the active segment's runs log, open for appending
        self._log_base = -1
        # What the log on disk says: up to where, and how many labels it has defined.
        self._logged_end = (0, 0)
        self._logged_labels = 0

    def _runs_header(self, base: int) -> bytes:
        return _RUNS_MAGIC + _BASE.pack(base) + self.journal_id.encode()

    def _path(self, base: int, ext: str) -> str:
        return os.path.join(self.dir, f"{base:020d}.{ext}")

    # --- summaries --------------------------------------------------------------------------

    def load_summary(self, base: int, sealed_size: int | None = None) -> frozenset[str] | None:
        """The summary of the segment at ``base``; None when missing or stale."""
        path = self._path(base, "kinds")
        body = load_checkpoint(path, _SUMMARY_MAGIC, instead="reading the segment")
        if body is None:
            return None
        problem = ""
        labels: frozenset[str] = frozenset()
        try:
            doc = orjson.loads(body)
            labels = frozenset(str(x) for x in doc["labels"])
            if doc["base"] != base or doc["journal"] != self.journal_id:
                problem = "is of another segment or journal"
            elif sealed_size is not None and doc.get("size", sealed_size) != sealed_size:
                problem = f"was sealed at {doc['size']} bytes, the segment has {sealed_size}"
        except (ValueError, KeyError, TypeError) as exc:
            problem = f"is unreadable ({exc})"
        if problem:
            log.warning("journal: segment summary %s %s; reading the segment", path, problem)
            return None
        return labels

    def save_summary(
        self, base: int, labels: Iterable[str], *, size: int | None = None, durable: bool = True
    ) -> None:
        """Write a summary. ``durable``: fsynced before it returns (one written ahead of the
        frames it covers must be); ``size``: the size the segment was sealed at."""
        doc: dict[str, Any] = {"base": base, "journal": self.journal_id, "labels": sorted(labels)}
        if size is not None:
            doc["size"] = size
        save_checkpoint(
            self._path(base, "kinds"), _SUMMARY_MAGIC, [orjson.dumps(doc)], durable=durable
        )

    def _write_file(self, path: str, blob: bytes, durable: bool) -> None:
        os.makedirs(self.dir, exist_ok=True)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if os.write(fd, blob) != len(blob):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if durable:
            fsync_dir(self.dir)

    # --- runs log ---------------------------------------------------------------------------

    @staticmethod
    def _chunk(
        new_labels: list[str],
        runs: list[tuple[int, int, int]],
        start: tuple[int, int],
        end: tuple[int, int],
    ) -> bytes:
        parts = [_LABEL_COUNT.pack(len(new_labels))]
        for name in new_labels:
            raw = name.encode("utf-8", "surrogateescape")
            parts += (_LABEL_COUNT.pack(len(raw)), raw)
        parts += (_SPAN.pack(*start), _COUNT.pack(len(runs)))
        if len(runs) > 32:
            parts.append(np.array(runs, dtype=_RUN).tobytes())
        else:  # a group commit's few runs: cheaper than a numpy array
            parts += [_RUN_STRUCT.pack(*run) for run in runs]
        parts.append(_SPAN.pack(*end))
        payload = b"".join(parts)
        return _CHUNK.pack(len(payload), zlib.crc32(payload)) + payload

    def load_runs(self, kinds: SegmentKinds) -> bool:
        """Fill ``kinds`` (empty, summary set) from the segment's runs log, as far as it is
        whole and continuous. False when there is no usable log at all."""
        try:
            with open(self._path(kinds.base, "runs"), "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return False
        header = self._runs_header(kinds.base)
        if not blob.startswith(header):
            return False  # not a runs log, or of another segment or journal
        head = len(header)
        pos = head
        while pos + _CHUNK.size <= len(blob):
            length, crc = _CHUNK.unpack_from(blob, pos)
            payload = blob[pos + _CHUNK.size : pos + _CHUNK.size + length]
            if len(payload) != length or zlib.crc32(payload) != crc:
                break  # a torn append: the log ends here
            if not self._apply_chunk(kinds, payload):
                break
            pos += _CHUNK.size + length
        return True

    @staticmethod
    def _apply_chunk(kinds: SegmentKinds, payload: bytes) -> bool:
        """One chunk onto ``kinds``; False (and ``kinds`` unchanged) when it does not continue
        what the log said (a chunk before it is missing) or does not parse."""
        try:
            (n_labels,) = _LABEL_COUNT.unpack_from(payload, 0)
            at = _LABEL_COUNT.size
            names = []
            for _ in range(n_labels):
                (size,) = _LABEL_COUNT.unpack_from(payload, at)
                at += _LABEL_COUNT.size
                names.append(payload[at : at + size].decode("utf-8", "surrogateescape"))
                at += size
            start = _SPAN.unpack_from(payload, at)
            at += _SPAN.size
            (n_runs,) = _COUNT.unpack_from(payload, at)
            at += _COUNT.size
            runs = np.frombuffer(payload, dtype=_RUN, count=n_runs, offset=at)
            at += n_runs * _RUN.itemsize
            end = _SPAN.unpack_from(payload, at)
        except (struct.error, ValueError):
            return False
        if start[0] > kinds.end_offset or end[0] < start[0] or end[1] < start[1]:
            return False
        if start[0] == kinds.end_offset and start[1] != kinds.end_position:
            return False
        if len(kinds.labels) + len(names) > _MAX_LABELS:
            return False
        offsets = runs["offset"].tolist()
        if offsets and (offsets[0] < start[0] or offsets != sorted(offsets)):
            return False
        masks = runs["mask"].tolist()
        if any(m >> (len(kinds.labels) + len(names)) for m in masks):
            return False
        kept = int(np.searchsorted(np.asarray(kinds.offsets, dtype=np.uint64), start[0], "left"))
        if not kept and not offsets:
            return False  # frames with no run: only possible if a chunk is missing
        kinds.cut(start[0])  # a chunk rewrites from its first frame on (a retried commit)
        kinds.labels += names
        kinds.masks_of.clear()
        kinds.offsets += offsets
        kinds.positions += runs["position"].tolist()
        kinds.masks += masks
        kinds.end_offset, kinds.end_position = end
        return True

    def _open_log(self, kinds: SegmentKinds, *, durable: bool) -> None:
        """(Re)write the active segment's log from ``kinds`` and keep it open for appends."""
        self.close()
        runs = list(zip(kinds.offsets, kinds.positions, kinds.masks, strict=True))
        chunk = (
            self._chunk(
                list(kinds.labels),
                runs,
                (kinds.base, SEGMENT_HEADER.size),
                (kinds.end_offset, kinds.end_position),
            )
            if runs
            else b""
        )
        path = self._path(kinds.base, "runs")
        self._write_file(path, self._runs_header(kinds.base) + chunk, durable)
        self._log_fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._log_base = kinds.base
        self._logged_end = (kinds.end_offset, kinds.end_position)
        self._logged_labels = len(kinds.labels)

    def close(self) -> None:
        if self._log_fd >= 0:
            os.close(self._log_fd)
        self._log_fd = -1
        self._log_base = -1

    # --- the journal's hooks ----------------------------------------------------------------

    def open_active(self, path: str, base: int, end_offset: int, end_position: int) -> SegmentKinds:
        """The active segment's index at open, after recovery cut it to ``end_offset`` (whose
        bytes end at ``end_position``): from its files where they still describe it, the rest
        read from the segment; written back (durably, if anything was dropped) for appends."""
        if end_offset == base:  # empty: whatever files an older segment left are moot
            kinds = SegmentKinds(base, frozenset())
            self.save_summary(base, ())
            self._open_log(kinds, durable=True)
            return kinds
        summary = self.load_summary(base)
        if summary is None:
            kinds = self._rebuild(path, base, None)
            self._open_log(kinds, durable=True)
            return kinds
        kinds = SegmentKinds(base, summary)
        loaded = self.load_runs(kinds)
        dropped = kinds.end_offset > end_offset  # the log outlived a cut tail
        kinds.truncate(end_offset, end_position)
        if kinds.end_offset < end_offset:
            # Frames the log does not describe (it was lost, or missed the last appends):
            # read them from the segment.
            new: list[str] = []
            for frame in _read_frames(path, base, None, (kinds.end_offset, kinds.end_position)):
                self._add_frame(kinds, frame, new)
        self._open_log(kinds, durable=dropped or not loaded)
        return kinds

    @staticmethod
    def _add_frame(kinds: SegmentKinds, frame: Frame, new: list[str]) -> None:
        mask = kinds.mask_of(frame.labels, new)
        if not kinds.masks or kinds.masks[-1] != mask:
            kinds.offsets.append(frame.offset)
            kinds.positions.append(frame.position)
            kinds.masks.append(mask)
        kinds.end_offset, kinds.end_position = frame.end_offset, frame.end_position

    def before_write(self, kinds: SegmentKinds, frames: list[Frame]) -> None:
        """Before the commit thread writes ``frames`` to the active segment: grow its summary
        (durably) if they hold a new kind, and append their runs to its log. Raises OSError
        (nothing is written to the segment then; the commit is retried).

        A group that starts no run and names no new label is not written to the log until
        ``_LOG_EVERY_BYTES`` of frames have gone by (the next chunk covers it): a long run of
        one kind then costs one write per few MiB, and an open reads at most that much of the
        segment for what the log does not say."""
        masks_of = kinds.masks_of
        if any(frame.labels not in masks_of for frame in frames):  # label sets not met yet
            labels: set[str] = set()
            for frame in frames:
                labels |= frame.labels
            if not kinds.summary.issuperset(labels):
                grown = kinds.summary | labels
                self.save_summary(kinds.base, grown)
                kinds.summary = grown
        first = frames[0]
        new: list[str] = []
        retry = first.offset < kinds.end_offset
        with self._lock:
            if retry:
                kinds.cut(first.offset)  # a retry writes the same frames again
            offsets, positions, masks = kinds.offsets, kinds.positions, kinds.masks
            k = len(offsets)
            last = masks[-1] if masks else -1
            for frame in frames:
                mask = masks_of.get(frame.labels)
                if mask is None:
                    mask = kinds.mask_of(frame.labels, new)
                if mask != last:
                    offsets.append(frame.offset)
                    positions.append(frame.position)
                    masks.append(mask)
                    last = mask
            kinds.end_offset, kinds.end_position = frames[-1].end_offset, frames[-1].end_position
        if self._log_base != kinds.base:
            self._open_log(kinds, durable=False)
            return
        # Frames the log already describes are written again (a retry, or frames cut back
        # after a failure): the chunk starts at them and replaces what the log said.
        rewrite = first.offset < self._logged_end[0]
        if (
            not rewrite
            and len(offsets) == k
            and len(kinds.labels) == self._logged_labels
            and kinds.end_position - self._logged_end[1] < _LOG_EVERY_BYTES
        ):
            return
        # The chunk starts where the log stopped, or at the frames written again.
        start = (first.offset, first.position) if rewrite else self._logged_end
        j = int(np.searchsorted(np.asarray(offsets, dtype=np.uint64), start[0], "left"))
        runs = list(zip(offsets[j:], positions[j:], masks[j:], strict=True))
        chunk = self._chunk(
            kinds.labels[self._logged_labels :],
            runs,
            start,
            (kinds.end_offset, kinds.end_position),
        )
        try:
            os.write(self._log_fd, chunk)
        except OSError as exc:
            # The runs log is not the truth: without it the segment is read at open.
            log.warning("journal: runs log of segment %d not written: %s", kinds.base, exc)
            self.close()
            return
        self._logged_end = (kinds.end_offset, kinds.end_position)
        self._logged_labels = len(kinds.labels)

    def start_segment(self, base: int) -> SegmentKinds:
        """A new active segment: no summary or runs yet (any left by an older one go)."""
        self.close()
        kinds = SegmentKinds(base, frozenset())
        for ext in ("kinds", "runs"):
            self._remove(base, ext)
        return kinds

    def seal(self, kinds: SegmentKinds, size: int) -> None:
        """The segment is sealed at ``size`` bytes: record it in the summary (not fsynced: if
        it is lost, the summary written ahead of the data still holds)."""
        self.close()
        try:
            self.save_summary(kinds.base, kinds.summary, size=size, durable=False)
        except OSError as exc:
            log.warning("journal: summary of segment %d not sealed: %s", kinds.base, exc)

    def remove(self, base: int) -> None:
        if base == self._log_base:
            self.close()
        for ext in ("kinds", "runs"):
            self._remove(base, ext)

    def _remove(self, base: int, ext: str) -> None:
        try:
            os.unlink(self._path(base, ext))
        except FileNotFoundError:
            pass

    def load_sealed(self, path: str, base: int, end_bound: int, size: int) -> SegmentKinds:
        """A sealed segment's index: its files if they describe it to its last byte, else
        read from the segment (and kept)."""
        summary = self.load_summary(base, sealed_size=size)
        if summary is not None:
            kinds = SegmentKinds(base, summary)
            if self.load_runs(kinds) and kinds.end_position == size:
                return kinds
            log.warning("journal: runs of segment %d do not reach its end; reading it", base)
        kinds = self._rebuild(path, base, end_bound)
        try:
            self.save_summary(base, kinds.summary, size=size, durable=False)
            runs = list(zip(kinds.offsets, kinds.positions, kinds.masks, strict=True))
            chunk = self._chunk(
                list(kinds.labels),
                runs,
                (base, SEGMENT_HEADER.size),
                (kinds.end_offset, kinds.end_position),
            )
            self._write_file(self._path(base, "runs"), self._runs_header(base) + chunk, False)
        except OSError as exc:
            log.warning("journal: index of segment %d not kept: %s", base, exc)
        return kinds

    def _rebuild(self, path: str, base: int, end_bound: int | None) -> SegmentKinds:
        """Both files' content, read from the segment (its verified frames)."""
        self.rebuilt += 1
        kinds = SegmentKinds(base, frozenset())
        new: list[str] = []
        summary: set[str] = set()
        for frame in _read_frames(path, base, end_bound, (base, SEGMENT_HEADER.size)):
            self._add_frame(kinds, frame, new)
            summary |= frame.labels
        kinds.summary = frozenset(summary)
        if end_bound is None:  # the active segment: written ahead of the frames to come
            self.save_summary(base, kinds.summary)
        return kinds
