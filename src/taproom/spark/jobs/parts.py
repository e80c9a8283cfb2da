"""The drill-down tables written once per sealed journal segment (issue 30).

``request_samples`` and ``request_ids`` hold a row per request, or nearly, so writing them
whole on every run shuffled, sorted and wrote every request of the journals again. A sealed
segment never changes (:mod:`~taproom.spark.segcache`), so with a parsed-segment cache the
batch job writes each sealed segment's rows once, as a *part*, and a later run writes only
the parts whose marker is missing plus each journal's live (last) segment::

    <out>/<table>/date=YYYY-MM-DD/part=<P>/*.parquet
    <out>/<table>/_parts/<P>        marker: part P's files (every date) are in place
                                    (JSON: its dates, the cache version and bounds)

``P`` is ``s<journal id>.<segment entry>`` for a sealed segment (the cache's entry name,
``<first>-<end>-<bytes>``), ``s<journal id>.live`` for a journal's last segment. A part's
rows are what the table's transform gives for that part's requests alone (``slow``,
``failed`` and ``failed_count`` relative to the part's group, for ``request_samples``);
readers merge the parts of a group at read time
(:func:`~taproom.spark.transforms.merge_sample_parts`, the console's own merge).

Each part's rows are tagged cheaply: cached rows by their file's path (``_metadata.file_path``
names the entry), live rows by their ``journal`` column. Rows are partitioned by part before
the transform, so a part's rows are in one task and each (date, part) gets one file (never
shuffle partitions x parts files).

How the files appear: each table's new parts are written by one Spark job into a staging
directory ``<out>/<table>/.staging-<uuid>/`` (ignored by readers: it starts with ``.``),
then moved into place by renames, not by Spark's dynamic partition overwrite: that replaces
whole ``date=`` directories, so writing a few parts would delete every other part of the
same dates, and it cannot drop the stale parts of dates it does not write. The commit, in
this order: the markers of the parts that go (stale ones: a journal's previous live part,
parts of segments retention deleted or ``journal check --repair`` cut back, of journals not
in this run) are removed, then their files, and the flat files an older version wrote
directly in a date directory; then the new parts' directories are renamed into place (each
a single rename) and their markers written. A reader may miss the live part's rows for a
moment during a run, never sees a request twice (the old live part is gone before the
sealed part that holds its requests appears), and never a half-written part.

The run's ``--since``/``--until`` range limits the aggregate tables only: a part holds its
whole segment, whatever the range (a sealed part is written once, for good).

Two jobs writing the same output take turns per table: ``<table>/_parts/.lock`` (an
exclusive ``flock``) is held from choosing the parts to writing their markers.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any
from urllib.parse import unquote

from .. import transforms as T
from ..schemas import PARSED_EVENT_SCHEMA
from ..segcache import CACHE_VERSION, CacheStats, SealedPart, live_part, locked
from ..settings import SparkSettings

__all__ = ["MARKERS", "PART_TABLES", "drop_markers", "write_parts"]

PART_TABLES = ("request_samples", "request_ids")
MARKERS = "_parts"
_DATE = "date="
_PART = "part="


def _markers(table_dir: str) -> set[str]:
    try:
        return {n for n in os.listdir(os.path.join(table_dir, MARKERS)) if n[0] not in "._"}
    except FileNotFoundError:
        return set()


def _made_with(table: str, settings: SparkSettings) -> dict[str, int]:
    """What a part's rows depend on beside its segment: a part written under another cache
    version (parse_events changed) or other bounds is written again."""
    made = {"cache_version": CACHE_VERSION}
    if table == "request_samples":
        made["slow"] = settings.slow_requests_per_action
        made["failed"] = settings.failed_requests_per_action
    return made


def _current(table_dir: str, made: dict[str, int]) -> set[str]:
    """The parts whose marker says they were written as this run would write them."""
    found = set()
    for part in _markers(table_dir):
        try:
            with open(os.path.join(table_dir, MARKERS, part)) as f:
                marker = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(marker, dict) and all(marker.get(k) == v for k, v in made.items()):
            found.add(part)
    return found


def _date_dirs(table_dir: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(table_dir) if n.startswith(_DATE))
    except FileNotFoundError:
        return []


def _part_dirs(table_dir: str) -> dict[str, list[str]]:
    """Every part's directories (one per date it has rows in). Spark escapes a partition
    value's special characters in its directory name (%XX): part names have none, but the
    name is read back the way Spark would."""
    found: dict[str, list[str]] = {}
    for date in _date_dirs(table_dir):
        path = os.path.join(table_dir, date)
        for name in os.listdir(path):
            if name.startswith(_PART):
                found.setdefault(unquote(name[len(_PART) :]), []).append(os.path.join(path, name))
    return found


def drop_markers(out: str, tables: tuple[str, ...]) -> None:
    """Forget the parts of ``tables``: a run without a cache replaces whole date directories
    (dynamic partition overwrite), parts included, so their markers would lie."""
    for table in tables:
        if table in PART_TABLES:
            shutil.rmtree(os.path.join(out, table, MARKERS), ignore_errors=True)


def _rows(spark: Any, sealed: list[SealedPart], live: bool, stats: CacheStats) -> Any:
    """Parsed rows of ``sealed`` parts (and the live segments), each with its ``part``."""
    from pyspark.sql import functions as F

    frames = []
    if sealed:
        # The entry is the directory of the row's file: one regexp per row, whatever the
        # number of segments (a CASE over segments' offsets would test each of them).
        entry = F.regexp_extract(F.col("_metadata.file_path"), r"/([^/]+)/[^/]+$", 1)
        cached = spark.read.schema(PARSED_EVENT_SCHEMA).parquet(*[p.path for p in sealed])
        frames.append(
            cached.select(
                *PARSED_EVENT_SCHEMA.fieldNames(),
                F.concat(F.lit("s"), F.col("journal"), F.lit("."), entry).alias("part"),
            )
        )
    if live and stats.live_rows is not None:
        frames.append(
            stats.live_rows.withColumn(
                "part", F.concat(F.lit("s"), F.col("journal"), F.lit(".live"))
            )
        )
    if not frames:
        return None
    out = frames[0]
    for frame in frames[1:]:
        out = out.unionByName(frame)
    return out


def _table(rows: Any, table: str, settings: SparkSettings) -> Any:
    # By part first: the window's partitioning (which includes the part) is then satisfied
    # without another shuffle, and every (date, part) is written by one task, as one file.
    # Then sorted by (date, part): the writer sees its partitions in order and keeps one file
    # open at a time. A cold run gives a task many (date, part) pairs; a writer kept open
    # for each (spark.sql.maxConcurrentOutputFileWriters) made Parquet's memory manager
    # scale every writer down, below its 1 MiB floor for the index's small row groups
    # ("New Memory allocation ... is smaller than the minimum allocation size").
    requests = rows.transform(T.logjam_requests)
    if table == "request_samples":
        return (
            requests.repartition("part")
            .transform(
                T.request_samples,
                slow=settings.slow_requests_per_action,
                failed=settings.failed_requests_per_action,
            )
            .sortWithinPartitions("date", "part")
        )
    # Each file sorted by id, as in the flat layout (a lookup reads one row group per file).
    return (
        requests.transform(T.request_index)
        .repartition("part")
        .sortWithinPartitions("date", "part", "request_id")
    )


def write_parts(
    spark: Any, stats: CacheStats, out: str, table: str, settings: SparkSettings
) -> list[str]:
    """Write ``table``'s missing parts and its live parts, remove its stale parts; returns
    the names of the parts written."""
    table_dir = os.path.join(out, table)
    # One job at a time per table, from choosing the parts to their markers: two rollups of
    # the same output (a cron run that overlaps the next) would each remove and rename the
    # other's parts. The second waits, then finds the sealed parts done.
    with locked(os.path.join(table_dir, MARKERS)):
        return _write_parts(spark, stats, table_dir, table, settings)


def _write_parts(
    spark: Any, stats: CacheStats, table_dir: str, table: str, settings: SparkSettings
) -> list[str]:
    made = _made_with(table, settings)
    done = _current(table_dir, made)
    sealed = [p for p in stats.sealed if p.name not in done]
    live = [live_part(j) for j in stats.live_journals]
    wanted = {p.name for p in stats.sealed} | set(live)
    written = [p.name for p in sealed] + live
    rows = _rows(spark, sealed, bool(live), stats)
    staging = os.path.join(table_dir, f".staging-{uuid.uuid4().hex}")
    try:
        if rows is not None:
            writer = _table(rows, table, settings).write.mode("overwrite")
            if table == "request_ids":
                writer = writer.option("parquet.block.size", str(settings.index_row_group_bytes))
            writer.partitionBy("date", "part").parquet(staging)
        _commit(table_dir, staging, written, wanted, made)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return written


def _commit(
    table_dir: str, staging: str, written: list[str], wanted: set[str], made: dict[str, int]
) -> None:
    markers = os.path.join(table_dir, MARKERS)
    existing = _part_dirs(table_dir)
    # 1. What goes: its marker first (a reader trusting markers stops reading it), then its
    # files; the parts rewritten now too (the live ones; a sealed one a dead run left
    # without its marker), so none is ever there twice.
    going = (set(existing) | _markers(table_dir)) - (wanted - set(written))
    for part in sorted(going):
        try:
            os.remove(os.path.join(markers, part))
        except FileNotFoundError:
            pass
    for part in sorted(going):
        for path in existing.get(part, []):
            shutil.rmtree(path, ignore_errors=True)
    # Flat files an older version (or a run without a cache) wrote: rows already whole, which
    # would be read beside the parts.
    for date in _date_dirs(table_dir):
        path = os.path.join(table_dir, date)
        for name in os.listdir(path):
            if not name.startswith(_PART) and os.path.isfile(os.path.join(path, name)):
                os.remove(os.path.join(path, name))
    # 2. The new parts, each directory by one rename; then their markers. Sealed parts come
    # first in ``written``; the old live part is already gone.
    staged = _part_dirs(staging)
    for part in written:
        dates = []
        for path in staged.get(part, []):
            date = os.path.basename(os.path.dirname(path))
            dates.append(date[len(_DATE) :])
            os.makedirs(os.path.join(table_dir, date), exist_ok=True)
            os.rename(path, os.path.join(table_dir, date, os.path.basename(path)))
        tmp = os.path.join(markers, f".{part}.{uuid.uuid4().hex}")
        with open(tmp, "w") as f:
            json.dump({**made, "dates": sorted(dates)}, f)
        os.rename(tmp, os.path.join(markers, part))
    for date in _date_dirs(table_dir):
        try:
            os.rmdir(os.path.join(table_dir, date))  # only if empty
        except OSError:
            pass
