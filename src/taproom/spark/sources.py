"""Where the ``taproom`` Spark source reads: journal directories and hubs, behind one face.

A :class:`JournalSource` is one journal, known by its identity (the UUID in its directory,
:mod:`taproom.journal.identity`), whether Spark reads its directory (:class:`LocalSource`:
shared storage every executor mounts) or asks its hub over the network (:class:`HubSource`:
the hub's read API, :mod:`taproom.web.journalapi`). Both give what the planner needs: the
first retained offset, the end a micro-batch may promise, the segments (sealed ones never
change: the parsed-segment cache keys on them), partitions of about a byte target, and a way
to report a streaming query's committed offsets back to the journal's cursors.

Partitions carry everything an executor needs (no driver state): a :class:`JournalSlice`
(directory, frame position to start at) or a :class:`HubSlice` (hub address, journal id,
offsets, request budget, token). :func:`read_partition` turns either into Arrow record batches
with the same decoder, so a hub's events and a directory's are the same rows.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import InputPartition

from ..errors import JournalError
from ..journal.cursors import CursorStore
from ..journal.identity import journal_id
from ..journal.remote import DEFAULT_BUDGET, HubJournal

__all__ = [
    "TOKEN_ENV",
    "HubSlice",
    "HubSource",
    "JournalSlice",
    "JournalSource",
    "LocalSource",
    "Segment",
    "SourceSpec",
    "read_partition",
]

log = logging.getLogger("taproom.spark")

# The hubs' [web] token, for readers that do not pass the ``token`` option (kept out of
# command lines, where every user of the machine can read it).
TOKEN_ENV = "TAPROOM_HUB_TOKEN"


@dataclass(frozen=True)
class Segment:
    """One segment of a journal: offsets ``[base, end)``; ``end`` None for the last."""

    base: int
    end: int | None
    size: int

    @property
    def sealed(self) -> bool:
        return self.end is not None

    @property
    def entry(self) -> str:
        """Its name in the parsed-segment cache: offsets and size pin its content."""
        return f"{self.base:020d}-{self.end:020d}-{self.size}"


@dataclass(frozen=True)
class JournalSlice(InputPartition):
    """Records ``[lo, hi)`` of a journal directory, starting at a known frame (no scanning)."""

    journal: str
    journal_id: str
    segment: int
    position: int
    base_offset: int
    lo: int
    hi: int


@dataclass(frozen=True)
class HubSlice(InputPartition):
    """Records ``[lo, hi)`` of the journal ``journal_id`` served by the hub at ``address``."""

    address: str
    journal_id: str
    lo: int
    hi: int
    budget: int
    token: str | None


class JournalSource:
    """One journal the source reads; ``name`` is what the user gave (path or hub address)."""

    name: str
    id: str

    def first_offset(self) -> int:
        raise NotImplementedError

    def available_end(self) -> int:
        """End of what a micro-batch may promise: committed, and verified where possible."""
        raise NotImplementedError

    def segments(self) -> list[Segment]:
        raise NotImplementedError

    def plan(self, lo: int, hi: int | None, target_bytes: int) -> list[InputPartition]:
        """Partitions of about ``target_bytes`` covering ``[lo, hi)`` (``hi`` None: the end)."""
        raise NotImplementedError

    def report_cursor(self, name: str, offset: int) -> None:
        """Record that reader ``name`` has committed everything below ``offset``."""
        raise NotImplementedError

    def knows(self, key: str) -> bool:
        """Whether ``key`` (an id, a path, a hub address) names this journal."""
        return key in (self.id, self.name)


class LocalSource(JournalSource):
    def __init__(self, path: str) -> None:
        if not os.path.isdir(path):
            # A mistyped path must not read as an empty journal (and write empty rollups).
            raise ValueError(f"taproom source: {path}: no journal directory here")
        self.name = os.path.abspath(path)
        try:
            self.id = journal_id(self.name)  # created here for a journal made before ids
        except OSError as exc:
            raise ValueError(
                f"taproom source: {path} has no journal.id yet and it cannot be created here "
                f"({exc.strerror}): let the hub open the journal once"
            ) from None
        self._verified: int | None = None  # verified end found so far (streaming)

    def first_offset(self) -> int:
        from .arrowdecode import journal_start

        return journal_start(self.name)

    def available_end(self) -> int:
        from .arrowdecode import scan_frames, verified_end

        known = self._verified if self._verified is not None else self.first_offset()
        end = verified_end(self.name, scan_frames(self.name, known))
        self._verified = max(known, end)
        return self._verified

    def segments(self) -> list[Segment]:
        from .arrowdecode import segment_bases

        bases = segment_bases(self.name)
        out = []
        for i, base in enumerate(bases):
            end = bases[i + 1] if i + 1 < len(bases) else None
            try:
                size = os.stat(os.path.join(self.name, f"{base:020d}.seg")).st_size
            except FileNotFoundError:  # retention got there first
                continue
            out.append(Segment(base, end, size))
        return out

    def plan(self, lo: int, hi: int | None, target_bytes: int) -> list[InputPartition]:
        """Runs of whole frames, planned from frame headers alone."""
        from .arrowdecode import scan_frames

        frames = scan_frames(self.name, lo, hi)
        slices: list[InputPartition] = []
        if not frames:
            return slices
        end = hi if hi is not None else frames[-1].base_offset + frames[-1].count
        start = frames[0]
        size = 0
        for i, frame in enumerate(frames):
            size += frame.length
            last = i == len(frames) - 1
            if size >= target_bytes or last:
                slice_hi = end if last else frame.base_offset + frame.count
                slice_lo = max(lo, start.base_offset)
                if slice_hi > slice_lo:
                    slices.append(
                        JournalSlice(
                            self.name,
                            self.id,
                            start.segment,
                            start.position,
                            start.base_offset,
                            slice_lo,
                            slice_hi,
                        )
                    )
                if not last:
                    start = frames[i + 1]
                    size = 0
        return slices

    def report_cursor(self, name: str, offset: int) -> None:
        CursorStore(self.name).save(name, offset)  # the hub's retention reads the same files


class HubSource(JournalSource):
    def __init__(self, address: str, token: str | None) -> None:
        self.name = address
        self.token = token
        self.client = HubJournal(address, token)
        info = self.client.info()  # HubUnavailable, naming the hub, if it cannot be reached
        self.id = info.id
        self._info = info

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "client": None}  # a connection does not travel

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.client = HubJournal(self.name, self.token)

    def _fresh(self) -> Any:
        info = self.client.info()
        if info.id != self.id:
            raise JournalError(f"hub {self.name} now serves journal {info.id}, not {self.id}")
        self._info = info
        return info

    def first_offset(self) -> int:
        return int(self._fresh().first_offset)

    def available_end(self) -> int:
        return int(self._fresh().end_offset)  # committed: durable under fsync = always

    def segments(self) -> list[Segment]:
        return [Segment(s.base, s.end, s.bytes) for s in self._fresh().segments]

    def plan(self, lo: int, hi: int | None, target_bytes: int) -> list[InputPartition]:
        """Offset ranges of about ``target_bytes``, from the segments' sizes (records of one
        segment are taken as equally large: the hub is never asked for frame positions)."""
        info = self._fresh()
        end = info.end_offset if hi is None else hi
        budget = min(DEFAULT_BUDGET, info.max_read_bytes)
        spans = _byte_spans(info.segments, info.end_offset, max(lo, 0), end, target_bytes)
        return [HubSlice(self.name, self.id, a, b, budget, self.token) for a, b in spans]

    def report_cursor(self, name: str, offset: int) -> None:
        self.client.report_cursor(name, offset)


def _byte_spans(
    segments: Sequence[Any], journal_end: int, lo: int, hi: int, target_bytes: int
) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into runs of about ``target_bytes``, bytes per offset taken from each
    segment's size over its offsets."""
    spans: list[tuple[int, int]] = []
    start = lo
    filled = 0.0
    for seg in segments:
        seg_end = journal_end if seg.end is None else seg.end
        a, b = max(lo, seg.base), min(hi, seg_end)
        if b <= a:
            continue
        per_offset = seg.bytes / max(1, seg_end - seg.base)
        at = a
        while at < b:
            room = max(1, int((target_bytes - filled) / per_offset)) if per_offset else b - at
            step = min(b, at + room)
            filled += (step - at) * per_offset
            at = step
            if filled >= target_bytes:
                spans.append((start, at))
                start, filled = at, 0.0
    if start < hi:
        spans.append((start, hi))
    return spans


@dataclass(frozen=True)
class SourceSpec:
    """What to read: journal directories and hub addresses (and the hubs' token)."""

    journals: tuple[str, ...] = ()
    hubs: tuple[str, ...] = ()
    token: str | None = None

    @classmethod
    def of(cls, value: SourceSpec | Sequence[str]) -> SourceSpec:
        """A spec, or a list of journal directories (what the jobs took before hubs)."""
        return value if isinstance(value, SourceSpec) else cls(journals=tuple(value))

    def options(self) -> dict[str, str]:
        """The ``taproom`` source's options for this spec."""
        out = {}
        if self.journals:
            out["journals"] = ",".join(self.journals)
        if self.hubs:
            out["hubs"] = ",".join(self.hubs)
        if self.token:
            out["token"] = self.token
        return out

    def open(self) -> list[JournalSource]:
        """One source per journal (contacting each hub); a journal named twice is an error."""
        if not self.journals and not self.hubs:
            raise ValueError(
                "taproom source: give journal directories (load(path), journals=) or hubs="
            )
        token = self.token or os.environ.get(TOKEN_ENV) or None
        sources: list[JournalSource] = []
        for path in dict.fromkeys(self.journals):
            sources.append(LocalSource(path))
        for address in dict.fromkeys(self.hubs):
            sources.append(HubSource(address, token))
        seen: dict[str, str] = {}
        for source in sources:
            if source.id in seen:
                raise ValueError(
                    f"taproom source: {seen[source.id]} and {source.name} are the same journal "
                    f"({source.id}): read it once"
                )
            seen[source.id] = source.name
        return sources


def read_partition(partition: InputPartition, columns: list[str] | None) -> Iterator[Any]:
    """Arrow record batches of one partition (on an executor)."""
    from .arrowdecode import FrameRef, decode_records, iter_batches, join_batches

    if not isinstance(partition, JournalSlice | HubSlice):
        raise TypeError(f"not a taproom partition: {partition!r}")
    lo, hi = partition.lo, partition.hi
    if hi <= lo:
        return
    client: HubJournal | None = None
    batches: Iterator[tuple[int, int, bytes]]
    if isinstance(partition, JournalSlice):
        start = FrameRef(partition.segment, partition.position, partition.base_offset, 0, 0)
        batches = iter_batches(partition.journal, start, hi)
    else:
        client = HubJournal(partition.address, partition.token)
        batches = client.read_batches(
            lo, hi, journal_id=partition.journal_id, budget=partition.budget
        )
    try:
        for body, first in join_batches(batches, hi):
            batch = decode_records(body, first, lo, hi, partition.journal_id, columns)
            if batch is not None and batch.num_rows:
                yield batch
    finally:
        if client is not None:
            client.close()
