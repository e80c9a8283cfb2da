"""PySpark Python data sources: ``taproom`` (journals) and ``keg`` (Lager *.lgr files).

``taproom`` reads one or more journal directories, in batch and as a Structured Streaming
source, and yields Arrow record batches built column-wise by :mod:`.arrowdecode` (never rows
one by one). Partitions are ranges of whole journal frames planned from frame headers alone,
balanced by bytes so both cores of ``local[2]`` (or all executors of a cluster) share the read.

Streaming offsets are ``{journal path: next offset}``. A micro-batch is the offset range
between two such maps, and Spark checkpoints both ends before it runs, so replaying a batch
after a crash reads exactly the same records: no duplicates, no gaps. Read limits
(``maxRecordsPerTrigger``) and ``Trigger.AvailableNow`` are honoured.

Options (``spark.read.format("taproom").option(...)``):

* ``path`` / ``paths`` (what ``load()`` passes) or ``journals``: journal directories,
  comma-separated in ``journals``;
* ``partitionBytes``: target bytes per partition (default 64 MiB);
* ``columns``: comma-separated event columns to read (default all): the others are never
  decoded nor sent to the JVM;
* ``ranges`` (batch only): JSON ``{journal: [[lo, hi], ...]}``, read only these offset
  ranges (``hi`` null: to the end); journals missing from it are not read;
* ``maxRecordsPerTrigger``: streaming read limit per micro-batch (default: none);
* ``startingOffsets``: ``earliest`` (default), ``latest`` or a JSON ``{path: offset}``.

Register both sources with :func:`register`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from .schemas import EVENT_SCHEMA

__all__ = ["JournalDataSource", "KegDataSource", "register"]

_DEFAULT_PARTITION_BYTES = 64 << 20


def _journal_paths(options: Any) -> list[str]:
    raw: list[str] = []
    if options.get("journals"):
        raw += [p for p in str(options["journals"]).split(",") if p]
    if options.get("paths"):
        value = options["paths"]
        raw += json.loads(value) if isinstance(value, str) else list(value)
    if options.get("path"):
        raw += [p for p in str(options["path"]).split(",") if p]
    if not raw:
        raise ValueError("taproom source: give journal directories with load(path) or journals=")
    seen: dict[str, None] = {}
    for path in raw:
        if not os.path.isdir(path):
            # A mistyped path must not read as an empty journal (and write empty rollups).
            raise ValueError(f"taproom source: {path}: no journal directory here")
        seen[os.path.abspath(path)] = None
    return list(seen)


@dataclass(frozen=True)
class JournalSlice(InputPartition):
    """Records ``[lo, hi)`` of one journal, starting at a known frame (no scanning)."""

    journal: str
    segment: int
    position: int
    base_offset: int
    lo: int
    hi: int


def _plan(journal: str, lo: int, hi: int | None, target_bytes: int) -> list[JournalSlice]:
    """Split the frames overlapping ``[lo, hi)`` into slices of about ``target_bytes``."""
    from .arrowdecode import scan_frames

    frames = scan_frames(journal, lo, hi)
    slices: list[JournalSlice] = []
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
                        journal,
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


def _columns(options: Any) -> list[str] | None:
    """The ``columns`` option: only these event columns are decoded and sent to Spark (the
    Python data source API has no column pruning of its own)."""
    raw = options.get("columns")
    if not raw:
        return None
    wanted = {c.strip() for c in str(raw).split(",") if c.strip()}
    unknown = wanted - set(EVENT_SCHEMA.fieldNames())
    if unknown:
        raise ValueError(f"taproom source: unknown columns {sorted(unknown)}")
    return [name for name in EVENT_SCHEMA.fieldNames() if name in wanted]


def _read_slice(part: JournalSlice, columns: list[str] | None) -> Iterator[Any]:
    from .arrowdecode import FrameRef, decode_records, iter_chunks

    start = FrameRef(part.segment, part.position, part.base_offset, 0, 0)
    for body, first in iter_chunks(part.journal, start, part.hi):
        batch = decode_records(body, first, part.lo, part.hi, part.journal, columns)
        if batch is not None and batch.num_rows:
            yield batch


def _ranges(options: Any) -> dict[str, list[tuple[int, int | None]]] | None:
    raw = options.get("ranges")
    if not raw:
        return None
    given = json.loads(str(raw))
    return {
        os.path.abspath(j): [(int(lo), None if hi is None else int(hi)) for lo, hi in spans]
        for j, spans in given.items()
    }


class _JournalBatchReader(DataSourceReader):
    def __init__(
        self,
        journals: list[str],
        target_bytes: int,
        columns: list[str] | None,
        ranges: dict[str, list[tuple[int, int | None]]] | None = None,
    ) -> None:
        self.journals = journals
        self.target_bytes = target_bytes
        self.columns = columns
        self.ranges = ranges

    def partitions(self) -> Sequence[InputPartition]:
        from .arrowdecode import journal_start

        slices: list[InputPartition] = []
        for journal in self.journals:
            if self.ranges is None:
                slices += _plan(journal, journal_start(journal), None, self.target_bytes)
                continue
            for lo, hi in self.ranges.get(journal, []):
                slices += _plan(journal, lo, hi, self.target_bytes)
        # Spark needs at least one partition; an empty slice reads nothing.
        return slices or [JournalSlice(self.journals[0], 0, 0, 0, 0, 0)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, JournalSlice)
        if partition.hi <= partition.lo:
            return iter(())
        return _read_slice(partition, self.columns)


class _JournalStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets ``{journal: next offset}``; one instance lives in the driver's planner."""

    def __init__(self, journals: list[str], options: Any) -> None:
        self.journals = journals
        self.target_bytes = int(options.get("partitionBytes", _DEFAULT_PARTITION_BYTES))
        limit = options.get("maxRecordsPerTrigger")
        self.max_records = int(limit) if limit else None
        if self.max_records is not None and self.max_records < 1:
            raise ValueError("maxRecordsPerTrigger must be at least 1")
        self.starting = str(options.get("startingOffsets", "earliest"))
        self.columns = _columns(options)
        self.target: dict[str, int] | None = None  # set by Trigger.AvailableNow
        # Verified end per journal: (end offset, frames already checked up to it).
        self._verified: dict[str, int] = {}

    def _available(self, journal: str) -> int:
        """End of the records whose frames verify: what a micro-batch may promise."""
        from .arrowdecode import journal_start, scan_frames, verified_end

        known = self._verified.get(journal, journal_start(journal))
        frames = scan_frames(journal, known)
        end = verified_end(journal, frames)
        if end < 0:
            end = known
        self._verified[journal] = end
        return end

    def initialOffset(self) -> dict:
        from .arrowdecode import journal_start

        if self.starting == "earliest":
            return {j: journal_start(j) for j in self.journals}
        if self.starting == "latest":
            return {j: self._available(j) for j in self.journals}
        given = json.loads(self.starting)
        return {j: int(given.get(j, journal_start(j))) for j in self.journals}

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.max_records is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.max_records)

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = {j: self._available(j) for j in self.journals}

    def _start_of(self, start: dict, journal: str) -> int:
        from .arrowdecode import journal_start

        # A journal added since the checkpoint starts at its beginning.
        return int(start[journal]) if journal in start else journal_start(journal)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        ends: dict[str, int] = {}
        for journal in self.journals:
            begin = self._start_of(start, journal)
            end = self.target[journal] if self.target is not None else self._available(journal)
            ends[journal] = max(begin, end)
        if isinstance(limit, ReadMaxRows):
            ends = self._limit(start, ends, int(limit.max_rows))
        # Keep journals the checkpoint knows but that are no longer configured, unchanged.
        for journal, offset in start.items():
            ends.setdefault(journal, int(offset))
        return ends

    def _limit(self, start: dict, ends: dict[str, int], budget: int) -> dict[str, int]:
        """At most ``budget`` records in all: an equal share each, the rest to whoever has more."""
        backlog = {j: ends[j] - self._start_of(start, j) for j in ends}
        take = {j: 0 for j in ends}
        share = max(1, budget // max(1, len(ends)))
        for j in ends:
            take[j] = min(backlog[j], share, budget - sum(take.values()))
        for j in ends:
            take[j] += min(backlog[j] - take[j], budget - sum(take.values()))
        return {j: self._start_of(start, j) + take[j] for j in ends}

    def reportLatestOffset(self) -> dict | None:
        return {j: self._verified.get(j, 0) for j in self.journals}

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        slices: list[InputPartition] = []
        for journal in self.journals:
            lo = self._start_of(start, journal)
            hi = int(end.get(journal, lo))
            if hi > lo:
                slices += _plan(journal, lo, hi, self.target_bytes)
        return slices

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, JournalSlice)
        return _read_slice(partition, self.columns)

    def commit(self, end: dict) -> None:
        # Nothing to release: journals are read-only here and retention belongs to the hub.
        return None


class JournalDataSource(DataSource):
    """``spark.read.format("taproom").load("/var/taproom/journal")``."""

    @classmethod
    def name(cls) -> str:
        return "taproom"

    def schema(self) -> StructType:
        columns = _columns(self.options)
        if columns is None:
            return EVENT_SCHEMA
        return StructType([f for f in EVENT_SCHEMA.fields if f.name in columns])

    def reader(self, schema: StructType) -> DataSourceReader:
        target = int(self.options.get("partitionBytes", _DEFAULT_PARTITION_BYTES))
        return _JournalBatchReader(
            _journal_paths(self.options), target, _columns(self.options), _ranges(self.options)
        )

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return _JournalStreamReader(_journal_paths(self.options), self.options)


def register(spark: Any) -> None:
    """Make ``format("taproom")`` and ``format("keg")`` available in ``spark``."""
    spark.dataSource.register(JournalDataSource)
    spark.dataSource.register(KegDataSource)


from .kegsource import KegDataSource  # noqa: E402  (defined beside its reader)
