"""Parsed-segment cache: each sealed journal segment is parsed once and kept as Parquet.

A sealed segment (every segment but a journal's last) never changes: the hub appends only
to the last one, and retention deletes whole segments. So the rollup job parses a sealed
segment's events once (:func:`~taproom.spark.transforms.parse_events`: JSON payloads, the
importer's defaults) and stores the parsed rows (:data:`PARSED_EVENT_SCHEMA`, narrow and
typed) under the cache directory; later runs read them with Spark's own vectorised Parquet
reader instead of decoding and parsing again. The last segment of each journal is always
read live through the ``taproom`` source.

Layout: ``<cache>/v<CACHE_VERSION>/<journal id>/<first offset>-<end offset>-<bytes>/``, where
the journal id is a hash of the journal's absolute path (its ``JOURNAL`` file names it) and
the entry name pins the segment's offsets and size: a segment cut back by ``journal check
--repair`` gets a new entry. An entry is built in a temporary directory and renamed into
place, so a run killed half-way leaves no half entry; entries of segments that retention
deleted are removed. Builders take an exclusive lock on ``<cache>/.lock``, so two jobs never
build the same entries. Bump :data:`CACHE_VERSION` whenever ``parse_events`` or the parsed
schema changes: old entries are then ignored (and can be deleted).

The cache is plain files: the directory must be a local path or a POSIX mount every executor
can read (like the journals themselves, see docs/spark.md).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .arrowdecode import segment_bases
from .schemas import PARSED_EVENT_SCHEMA

__all__ = ["CACHE_VERSION", "CacheStats", "Segment", "journal_segments", "parsed_events"]

CACHE_VERSION = 2  # 2: parsed rows carry the request's resources
# What parse_events needs from the source: producer, seq and event_id are never decoded.
PARSE_COLUMNS = "journal,offset,received,ts,protocol,stream,topic,content_type,payload,attrs"


@dataclass(frozen=True)
class Segment:
    """One segment file of a journal: offsets ``[base, end)``; ``end`` None for the last."""

    journal: str
    base: int
    end: int | None
    size: int

    @property
    def sealed(self) -> bool:
        return self.end is not None

    @property
    def entry(self) -> str:
        return f"{self.base:020d}-{self.end:020d}-{self.size}"


@dataclass
class CacheStats:
    """What one run took from the cache and what it had to parse."""

    cached: int = 0  # sealed segments read from the cache
    built: int = 0  # sealed segments parsed and added to the cache this run
    live: int = 0  # segments read through the source (the last of each journal)
    removed: int = 0  # entries of segments no longer in their journal
    persisted: list[Any] = field(default_factory=list)  # frames to unpersist after the run

    def release(self) -> None:
        for frame in self.persisted:
            frame.unpersist()
        self.persisted.clear()


def journal_segments(journal: str) -> list[Segment]:
    bases = segment_bases(journal)
    out = []
    for i, base in enumerate(bases):
        end = bases[i + 1] if i + 1 < len(bases) else None
        try:
            size = os.stat(os.path.join(journal, f"{base:020d}.seg")).st_size
        except FileNotFoundError:  # retention got there first
            continue
        out.append(Segment(journal, base, end, size))
    return out


def _journal_dir(root: str, journal: str) -> str:
    digest = hashlib.sha256(os.path.abspath(journal).encode()).hexdigest()[:16]
    return os.path.join(root, f"v{CACHE_VERSION}", digest)


@contextmanager
def _locked(root: str) -> Iterator[None]:
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _source(spark: Any, journals: list[str], ranges: dict[str, list[list[int | None]]]) -> Any:
    from .transforms import parse_events

    return (
        spark.read.format("taproom")
        .option("journals", ",".join(journals))
        .option("columns", PARSE_COLUMNS)
        .option("ranges", json.dumps(ranges))
        .load()
        .transform(parse_events)
    )


def _build(spark: Any, root: str, missing: list[Segment]) -> None:
    """Parse ``missing`` sealed segments in one Spark job and move each into its entry."""
    from pyspark.sql import functions as F

    journals = sorted({s.journal for s in missing})
    # Partition value of each segment's rows: "<journal id>.<entry>", unique across journals.
    names = {
        seg: f"{os.path.basename(_journal_dir(root, seg.journal))}.{seg.entry}" for seg in missing
    }
    ranges: dict[str, list[list[int | None]]] = {}
    entry = F.lit(None).cast("string")
    for seg in missing:
        ranges.setdefault(seg.journal, []).append([seg.base, seg.end])
        where = (F.col("journal") == seg.journal) & F.col("offset").between(
            seg.base, int(seg.end or 0) - 1
        )
        entry = F.when(where, F.lit(names[seg])).otherwise(entry)
    tmp = os.path.join(root, f".tmp-{uuid.uuid4().hex}")
    try:
        (
            _source(spark, journals, ranges)
            .select(*PARSED_EVENT_SCHEMA.fieldNames(), entry.alias("entry"))
            .write.partitionBy("entry")
            .parquet(tmp)
        )
        for seg in missing:
            final = os.path.join(_journal_dir(root, seg.journal), seg.entry)
            built = os.path.join(tmp, f"entry={names[seg]}")
            if not os.path.isdir(built):  # a segment with no records
                os.makedirs(built)
            os.rename(built, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def parsed_events(
    spark: Any, journals: list[str], cache: str | None, *, persist_live: bool = False
) -> tuple[Any, CacheStats]:
    """Parsed rows (:data:`PARSED_EVENT_SCHEMA`) of every event in ``journals``.

    With ``cache`` None every segment is read and parsed through the source. Otherwise
    sealed segments come from the cache (built first where missing) and only the last
    segment of each journal is parsed live. ``persist_live`` keeps the live rows in memory
    (spilling to disk) for a job that reads them several times; ``stats.release()`` frees
    them.
    """
    from pyspark import StorageLevel

    def parsed_live(frame: Any) -> Any:
        frame = frame.select(*PARSED_EVENT_SCHEMA.fieldNames())
        if persist_live:
            frame = frame.persist(StorageLevel.MEMORY_AND_DISK)
            stats.persisted.append(frame)
        return frame

    journals = [os.path.abspath(j) for j in journals]
    stats = CacheStats()
    if cache is None:
        stats.live = sum(len(journal_segments(j)) for j in journals)
        ranges = {j: [[0, None]] for j in journals}
        return parsed_live(_source(spark, journals, ranges)), stats
    root = os.path.abspath(cache)
    entries: list[str] = []
    live: dict[str, list[list[int | None]]] = {}
    with _locked(root):
        for name in os.listdir(root):
            if name.startswith(".tmp-"):  # left by a job that died while building
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        missing: list[Segment] = []
        for journal in journals:
            jdir = _journal_dir(root, journal)
            os.makedirs(jdir, exist_ok=True)
            with open(os.path.join(jdir, "JOURNAL"), "w") as f:
                f.write(journal + "\n")
            segments = journal_segments(journal)
            wanted = {s.entry for s in segments if s.sealed}
            for name in os.listdir(jdir):
                if name != "JOURNAL" and name not in wanted:
                    shutil.rmtree(os.path.join(jdir, name), ignore_errors=True)
                    stats.removed += 1
            for seg in segments:
                if not seg.sealed:
                    live.setdefault(journal, []).append([seg.base, None])
                    stats.live += 1
                elif os.path.isdir(os.path.join(jdir, seg.entry)):
                    stats.cached += 1
                else:
                    missing.append(seg)
            entries += [os.path.join(jdir, s.entry) for s in segments if s.sealed]
        if missing:
            _build(spark, root, missing)
            stats.built = len(missing)
    frames = []
    if entries:
        frames.append(spark.read.schema(PARSED_EVENT_SCHEMA).parquet(*entries))
    if live or not frames:
        live_journals = sorted(live) or journals
        frames.append(_source(spark, live_journals, live).select(*PARSED_EVENT_SCHEMA.fieldNames()))
    out = frames[0]
    for frame in frames[1:]:
        out = out.unionByName(frame)
    return out, stats
