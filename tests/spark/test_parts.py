"""The drill-down tables written once per sealed segment (jobs/parts.py) and merged at read
(transforms.merge_sample_parts): the same rows as the whole-journal transforms."""

from __future__ import annotations

import datetime as dt
import fcntl
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from taproom.spark import transforms as T
from taproom.spark.jobs.parts import MARKERS
from taproom.spark.jobs.rollup import run_rollup
from taproom.spark.schemas import LOGJAM_TIME_RESOURCES
from taproom.spark.segcache import parsed_events
from taproom.spark.settings import SparkSettings
from taproom.spark.sources import LocalSource

from .generate import GeneratedEvent, write_journal

pytestmark = pytest.mark.spark

# Small bounds: groups hold a few requests each, so the merge has something to choose.
SLOW, FAILED = 2, 1
SETTINGS = SparkSettings(slow_requests_per_action=SLOW, failed_requests_per_action=FAILED)
PART_TABLES = ("request_samples", "request_ids")
SEGMENT_BYTES = 96 * 1024


def _files(table: Path) -> dict[str, int]:
    """Every Parquet file of the table (relative path -> mtime)."""
    return {
        str(p.relative_to(table)): p.stat().st_mtime_ns
        for p in table.rglob("*.parquet")
        if not any(part[0] in "._" for part in p.relative_to(table).parts)
    }


def _parts(table: Path) -> dict[str, list[str]]:
    """part -> its files' names, from the directories."""
    out: dict[str, list[str]] = {}
    for rel in _files(table):
        date, part, name = rel.split("/")
        assert date.startswith("date=") and part.startswith("part=")
        out.setdefault(part[len("part=") :], []).append(f"{date}/{name}")
    return out


def _markers(table: Path) -> set[str]:
    return {n for n in os.listdir(table / MARKERS) if n[0] not in "._"}


def _expected_parts(journal: Path) -> set[str]:
    source = LocalSource(str(journal))
    return {
        f"s{source.id}.{s.entry}" if s.sealed else f"s{source.id}.live" for s in source.segments()
    }


def _sample_key(r: Any) -> tuple[Any, ...]:
    d = r.asDict()
    d["date"] = str(d["date"])  # partition discovery reads date=YYYY-MM-DD as a date
    return tuple(sorted((k, repr(v)) for k, v in d.items() if k != "part"))


def _whole(spark: Any, journal: Path) -> tuple[list[tuple[Any, ...]], list[int]]:
    """request_samples over the whole journal (no cache, no parts) and the indexed offsets."""
    parsed, _ = parsed_events(spark, [str(journal)], None)
    requests = parsed.transform(T.logjam_requests)
    samples = requests.transform(T.request_samples, slow=SLOW, failed=FAILED).collect()
    index = requests.transform(T.request_index).select("offset").collect()
    return sorted(_sample_key(r) for r in samples), sorted(r["offset"] for r in index)


def _merged(spark: Any, out: Path) -> tuple[list[tuple[Any, ...]], list[int]]:
    samples = spark.read.parquet(str(out / "request_samples"))
    merged = samples.transform(T.merge_sample_parts, slow=SLOW, failed=FAILED).collect()
    index = spark.read.parquet(str(out / "request_ids")).select("offset").collect()
    return sorted(_sample_key(r) for r in merged), sorted(r["offset"] for r in index)


def _run(spark: Any, journal: Path, out: Path, **kw: Any) -> Any:
    return run_rollup(
        spark, [str(journal)], str(out), tables=PART_TABLES, progress=False, settings=SETTINGS,
        **kw,
    )  # fmt: skip


def test_sealed_parts_are_written_once_and_the_live_part_follows_the_journal(
    spark: Any, logjam_events: list[GeneratedEvent], tmp_path: Path
) -> None:
    journal = write_journal(tmp_path / "j", logjam_events[:1800], segment_bytes=SEGMENT_BYTES)
    out = tmp_path / "out"
    # An older version's flat files in a date directory: the first run with parts removes
    # them (their rows are whole, they would be read beside the parts).
    flat = out / "request_samples" / "date=2026-11-21"
    flat.mkdir(parents=True)
    (flat / "part-00000-old.snappy.parquet").write_bytes(b"PAR1")
    (flat / ".part-00000-old.snappy.parquet.crc").write_bytes(b"")

    _run(spark, journal, out)
    assert not (flat / "part-00000-old.snappy.parquet").exists()
    wanted = _expected_parts(journal)
    assert sum(p.endswith(".live") for p in wanted) == 1 and len(wanted) >= 4
    first: dict[str, dict[str, int]] = {}
    for table in PART_TABLES:
        assert _markers(out / table) == wanted, table
        parts = _parts(out / table)
        assert set(parts) <= wanted
        for part, files in parts.items():  # one file per (date, part)
            dates = [f.split("/")[0] for f in files]
            assert len(dates) == len(set(dates)), (table, part, files)
        first[table] = _files(out / table)
    assert _merged(spark, out) == _whole(spark, journal)

    # Again over the same journal: no sealed part is written again, the live one is.
    _run(spark, journal, out)
    for table in PART_TABLES:
        again = _files(out / table)
        sealed = {f: m for f, m in first[table].items() if ".live/" not in f}
        assert {f: again.get(f) for f in sealed} == sealed, table
        live = {f for f in again if ".live/" in f}
        assert live and not live & set(first[table]), table  # new files (Spark's names)
        assert _markers(out / table) == wanted
    assert _merged(spark, out) == _whole(spark, journal)

    # The hub goes on writing: the old live segment is sealed now. Its sealed part replaces
    # the live part, and no request is in two parts.
    write_journal(journal, logjam_events[1800:], segment_bytes=SEGMENT_BYTES)
    grown = _expected_parts(journal)
    assert len(grown) > len(wanted)
    _run(spark, journal, out)
    for table in PART_TABLES:
        assert _markers(out / table) == grown
        assert set(_parts(out / table)) <= grown
        files = _files(out / table)
        sealed = {f: m for f, m in first[table].items() if ".live/" not in f}
        assert {f: files.get(f) for f in sealed} == sealed, table
    merged, offsets = _merged(spark, out)
    assert len(offsets) == len(set(offsets))
    assert (merged, offsets) == _whole(spark, journal)

    # Retention deletes the oldest segment: its parts go, markers first.
    source = LocalSource(str(journal))
    oldest = source.segments()[0]
    os.remove(journal / f"{oldest.base:020d}.seg")
    _run(spark, journal, out)
    gone = f"s{source.id}.{oldest.entry}"
    for table in PART_TABLES:
        assert gone not in _markers(out / table) and gone not in _parts(out / table)
        assert _markers(out / table) == _expected_parts(journal)
    assert _merged(spark, out) == _whole(spark, journal)
    assert not [p for p in (out / "request_samples").iterdir() if p.name.startswith(".staging")]


def test_parts_are_written_again_under_other_bounds(
    spark: Any, logjam_events: list[GeneratedEvent], tmp_path: Path
) -> None:
    journal = write_journal(tmp_path / "j", logjam_events[:1200], segment_bytes=SEGMENT_BYTES)
    out = tmp_path / "out"
    _run(spark, journal, out)
    before = {t: _files(out / t) for t in PART_TABLES}
    wider = SparkSettings(slow_requests_per_action=SLOW + 1, failed_requests_per_action=FAILED)
    run_rollup(
        spark, [str(journal)], str(out), tables=PART_TABLES, progress=False, settings=wider
    )  # fmt: skip
    # request_samples' rows depend on the bounds: every part again; request_ids' do not.
    assert not set(_files(out / "request_samples")) & set(before["request_samples"])
    ids = _files(out / "request_ids")
    assert {f: ids.get(f) for f in before["request_ids"] if ".live/" not in f} == {
        f: m for f, m in before["request_ids"].items() if ".live/" not in f
    }

    # A run that died after moving a part's files in, before its marker: the part is written
    # again (its old files go first), the others are kept, no request is there twice.
    lost = sorted(p for p in _markers(out / "request_ids") if not p.endswith(".live"))[0]
    os.remove(out / "request_ids" / MARKERS / lost)
    run_rollup(
        spark, [str(journal)], str(out), tables=("request_ids",), progress=False, settings=wider
    )  # fmt: skip
    again = _files(out / "request_ids")
    for f, mtime in ids.items():
        if f".{lost.split('.', 1)[1]}/" in f or ".live/" in f:
            assert f not in again, f
        else:
            assert again.get(f) == mtime, f
    assert lost in _markers(out / "request_ids")
    offsets = [r["offset"] for r in spark.read.parquet(str(out / "request_ids")).collect()]
    assert len(offsets) == len(set(offsets)) == len(_whole(spark, journal)[1])


def _waiting_on(path: Path) -> bool:
    """Some process or thread is blocked on an flock of ``path`` (``->`` lines of
    /proc/locks name the inode a waiter waits for)."""
    inode = f":{os.stat(path).st_ino} "
    with open("/proc/locks") as f:
        return any("->" in line and inode in line for line in f)


def test_two_jobs_on_one_output_take_turns(
    spark: Any, logjam_events: list[GeneratedEvent], tmp_path: Path
) -> None:
    """A job that finds another committing a table's parts (here: the test holding the lock)
    waits for it before choosing its parts; nothing of that table moves meanwhile."""
    journal = write_journal(tmp_path / "j", logjam_events[:1200], segment_bytes=SEGMENT_BYTES)
    out = tmp_path / "out"
    _run(spark, journal, out)
    lock = out / "request_ids" / MARKERS / ".lock"
    before = _files(out / "request_ids")
    with ThreadPoolExecutor(1) as pool, open(lock, "a+b") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        job = pool.submit(_run, spark, journal, out)
        deadline = time.monotonic() + 300
        while not _waiting_on(lock):
            assert not job.done(), job.result()  # it finished without waiting: no lock
            assert time.monotonic() < deadline, "the second job never waited on the lock"
            time.sleep(0.05)
        assert _files(out / "request_ids") == before and not job.done()
        fcntl.flock(held.fileno(), fcntl.LOCK_UN)
        job.result(timeout=300)
    assert _merged(spark, out) == _whole(spark, journal)
    assert _markers(out / "request_ids") == _expected_parts(journal)


def test_without_a_cache_the_tables_are_whole_as_before(
    spark: Any, logjam_events: list[GeneratedEvent], tmp_path: Path
) -> None:
    journal = write_journal(tmp_path / "j", logjam_events[:1200], segment_bytes=SEGMENT_BYTES)
    out = tmp_path / "out"
    _run(spark, journal, out)  # parts first: the run without a cache forgets them
    assert _markers(out / "request_samples")
    _run(spark, journal, out, cache=False)
    for table in PART_TABLES:
        assert not (out / table / MARKERS).exists()
        for date in (out / table).glob("date=*"):
            assert not list(date.glob("part=*")) and list(date.glob("*.parquet")), date
    samples = spark.read.parquet(str(out / "request_samples"))
    assert "part" not in samples.columns
    rows = sorted(_sample_key(r) for r in samples.collect())
    assert (rows, _merged(spark, out)[1]) == _whole(spark, journal)
    # Merging rows that are already whole changes nothing.
    assert samples.transform(T.merge_sample_parts).columns == samples.columns


def _random_requests(rng: random.Random, n: int) -> list[dict[str, Any]]:
    base = dt.datetime(2026, 11, 21, 23, 58)
    rows = []
    for offset in range(n):
        rows.append(
            {
                "journal": rng.choice(("ja", "jb")),
                "offset": offset,
                "minute": base + dt.timedelta(minutes=rng.randrange(4)),  # two dates
                "action": rng.choice(("A#a", "B#b")),
                # few distinct times and starts: ties broken by (journal, offset)
                "total_time": float(rng.randrange(6)),
                "started_s": rng.randrange(5),
                "code": rng.choice((200, 200, 500)),
                "severity": rng.choice((1, 1, 3)),
                "exceptions": rng.choice(([], [], ["Boom"])),
                "part": f"p{rng.randrange(4)}",
            }
        )
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_merged_parts_equal_the_whole(spark: Any, seed: int) -> None:
    """Property: per-part request_samples merged = request_samples over the union, for groups
    spread over parts at random (seeded), with ties in time and start."""
    from pyspark.sql import functions as F

    rng = random.Random(seed)
    slow, failed = rng.randint(1, 3), rng.randint(1, 3)
    rows = _random_requests(rng, rng.randint(20, 120))
    df = spark.createDataFrame(rows).select(
        "journal",
        "offset",
        "part",
        F.col("minute").cast("timestamp").alias("minute"),
        F.lit("shop").alias("app"),
        F.lit("production").alias("env"),
        "action",
        F.lit("").alias("module"),
        F.lit(False).alias("frontend"),
        (F.col("minute").cast("timestamp") + F.make_interval(secs=F.col("started_s"))).alias(
            "started"
        ),
        "code",
        "total_time",
        "severity",
        F.col("exceptions").cast("array<string>").alias("exceptions"),
        F.struct(*[F.lit(None).cast("double").alias(n) for n in LOGJAM_TIME_RESOURCES]).alias(
            "resources"
        ),
        F.concat(F.lit("r"), F.col("offset")).alias("request_id"),
        F.lit("web-1").alias("host"),
    )
    whole = df.drop("part").transform(T.request_samples, slow=slow, failed=failed)
    parts = df.repartition("part").transform(T.request_samples, slow=slow, failed=failed)
    assert "part" in parts.columns
    merged = parts.transform(T.merge_sample_parts, slow=slow, failed=failed)
    assert merged.columns == whole.columns
    assert sorted(_sample_key(r) for r in merged.collect()) == sorted(
        _sample_key(r) for r in whole.collect()
    )
