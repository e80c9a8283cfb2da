"""The request-id lookup without Spark: version 1 UUID times, and pruning files the way a
streaming query writes them (unsorted, one per micro-batch) by the id's minute.

The batch job's layout (sorted files, small row groups) is checked against files the real job
wrote in tests/spark/test_jobs.py; here the files are written with pyarrow in the columns of
``REQUEST_ID_SCHEMA``.
"""

from __future__ import annotations

import datetime as dt
import random
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from taproom.web.requestindex import RequestIndex, uuid1_time
from taproom.web.tables import TableFiles

DAY = dt.datetime(2026, 3, 4, tzinfo=dt.UTC)
UUID_EPOCH_100NS = 0x01B21DD213814000


def v1(at: dt.datetime, n: int) -> str:
    ticks = int(at.timestamp() * 1e7) + UUID_EPOCH_100NS
    fields = (ticks & 0xFFFFFFFF, (ticks >> 32) & 0xFFFF, (ticks >> 48) & 0x0FFF | 0x1000,
              0x80 | (n >> 8 & 0x3F), n & 0xFF, n)  # fmt: skip
    return uuid.UUID(fields=fields).hex


def test_uuid1_time_is_the_time_in_a_version_1_uuid() -> None:
    now = dt.datetime.now(dt.UTC)
    made = uuid.uuid1()
    for text in (made.hex, str(made)):
        found = uuid1_time(text)
        assert found is not None and abs((found - now).total_seconds()) < 60
    at = DAY + dt.timedelta(hours=5, minutes=7, seconds=9.25)
    assert uuid1_time(v1(at, 3)) == at
    for other in (uuid.uuid4().hex, "0" * 32, "not-a-uuid", "g" * 32, "", v1(at, 3)[:-1]):
        assert uuid1_time(other) is None, other


def _write_streamed_day(root: Path, files: int, per_file: int) -> dict[str, tuple[int, int]]:
    """``files`` Parquet files as a stream's micro-batches write them: file k holds requests
    started in minute k, ids in arrival order (no sort), row groups of 50 rows. Returns id ->
    (file, offset)."""
    part = root / "request_ids" / f"date={DAY.date().isoformat()}"
    part.mkdir(parents=True)
    rng = random.Random(4)
    where: dict[str, tuple[int, int]] = {}
    offset = 0
    for k in range(files):
        minute = DAY + dt.timedelta(minutes=k)
        ids = []
        for i in range(per_file):
            at = minute + dt.timedelta(seconds=rng.uniform(0, 59))
            rid = v1(at, offset) if i % 10 else f"{rng.getrandbits(64):016x}"  # some not v1
            ids.append(rid)
            where[rid] = (k, offset)
            offset += 1
        table = pa.table(
            {
                "request_id": ids,
                "journal": ["j-1"] * per_file,
                "offset": [where[r][1] for r in ids],
                "app": ["shop"] * per_file,
                "env": ["production"] * per_file,
                "minute": pa.array([minute] * per_file, pa.timestamp("us", "UTC")),
            }
        )
        pq.write_table(table, part / f"part-{k:05d}.parquet", row_group_size=50)
    return where


def test_a_streamed_index_is_pruned_by_the_minute_of_a_v1_id(tmp_path: Path) -> None:
    where = _write_streamed_day(tmp_path, files=30, per_file=200)
    index = RequestIndex(TableFiles(str(tmp_path)), find_dates=31)
    by_file = {k: [r for r, (f, _) in where.items() if f == k] for k in range(30)}
    target = next(r for r in by_file[17] if uuid1_time(r) is not None)
    hit = index.find(target)
    assert hit is not None and hit.offset == where[target][1] and hit.date == "2026-03-04"
    assert hit.minute_ms == int((DAY + dt.timedelta(minutes=17)).timestamp() * 1000)
    # Only the files of the id's minute (within the clock slack) were opened: 4 groups each;
    # the unsorted files' id ranges would have pruned nothing.
    assert index.groups_read <= 4 * 5
    # An id that carries no time is still found, at the cost of every group holding its range.
    plain = next(r for r in by_file[29] if uuid1_time(r) is None)
    before = index.groups_read
    hit = index.find(plain)
    assert hit is not None and hit.offset == where[plain][1]
    assert index.groups_read - before > 4 * 5
    # Unknown ids: None (a v1 id's miss falls back to the dates without the minute: a request
    # without started_at has its minute from the hub's clock, not the agent's).
    assert index.find(v1(DAY + dt.timedelta(hours=9), 1)) is None
    assert index.find(v1(DAY, 123_456_789 % 2**48), date="2026-03-05") is None


def _write_parted_day(
    root: Path, journals: int, segments: int, per_segment: int
) -> dict[str, tuple[str, int]]:
    """``request_ids`` a part per journal segment, as the batch job with a segment cache
    writes it: each part's requests contiguous in time (segment k of a journal holds the
    minutes [k * 30, k * 30 + 30) of the day, a few late ones from the minute before), its file
    sorted by id, row groups of 50 rows. Returns id -> (journal, offset)."""
    rng = random.Random(9)
    where: dict[str, tuple[str, int]] = {}
    for j in range(journals):
        for k in range(segments):
            part = "live" if k == segments - 1 else f"{k * per_segment}-{(k + 1) * per_segment}-1"
            rows = []
            for i in range(per_segment):
                minute = DAY + dt.timedelta(minutes=k * 30 + i * 30 // per_segment)
                if i % 17 == 0 and minute > DAY:
                    minute -= dt.timedelta(minutes=1)  # a request that reached the hub late
                at = minute + dt.timedelta(seconds=rng.uniform(0, 59))
                offset = k * per_segment + i
                rid = v1(at, offset) if i % 10 else f"{rng.getrandbits(64):016x}"
                where[rid] = (f"j-{j}", offset)
                rows.append((rid, f"j-{j}", offset, minute))
            rows.sort()
            ids, journal, offsets, minutes = zip(*rows, strict=True)
            table = pa.table(
                {
                    "request_id": list(ids),
                    "journal": list(journal),
                    "offset": list(offsets),
                    "app": ["shop"] * per_segment,
                    "env": ["production"] * per_segment,
                    "minute": pa.array(minutes, pa.timestamp("us", "UTC")),
                }
            )
            directory = (
                root / "request_ids" / f"date={DAY.date().isoformat()}" / f"part=sj-{j}.{part}"
            )
            directory.mkdir(parents=True)
            pq.write_table(table, directory / "part-00000.c000.parquet", row_group_size=50)
    return where


def test_a_parted_index_is_pruned_to_the_parts_of_a_v1_ids_time(tmp_path: Path) -> None:
    """Many parts (2 journals x 24 segments of 30 minutes): a v1 id reads the row group that
    holds its id in the one or two parts of its time; an id without a time reads one group
    per part."""
    where = _write_parted_day(tmp_path, journals=2, segments=24, per_segment=400)
    index = RequestIndex(TableFiles(str(tmp_path)), find_dates=31)
    timed = [r for r in where if uuid1_time(r) is not None]
    plain = [r for r in where if uuid1_time(r) is None]
    rng = random.Random(2)
    for name, ids in (("v1", timed), ("plain", plain)):
        reads = []
        for rid in rng.sample(ids, 60):
            before = index.groups_read
            hit = index.find(rid)
            assert hit is not None and (hit.journal, hit.offset) == where[rid]
            reads.append(index.groups_read - before)
        mean = sum(reads) / len(reads)
        print(f"{name} ids, 48 parts of 8 row groups: {mean:.1f} read a lookup, max {max(reads)}")
        if name == "v1":
            # The parts whose minutes are within the id's time +- the clock slack (2 or 3 of
            # each journal), one group each, the id's journal's holding it.
            assert max(reads) <= 6
        else:
            assert max(reads) <= 48
    assert index.find(v1(DAY + dt.timedelta(hours=3, seconds=5), 77_777)) is None
    assert index.find("f" * 16) is None


def test_a_sealed_part_replacing_the_live_one_is_searched(tmp_path: Path) -> None:
    where = _write_parted_day(tmp_path, journals=1, segments=3, per_segment=100)
    index = RequestIndex(TableFiles(str(tmp_path)), find_dates=31)
    day = tmp_path / "request_ids" / f"date={DAY.date().isoformat()}"
    late = [r for r, (_, offset) in where.items() if offset >= 200]
    assert all(index.find(r) is not None for r in late)
    # The job seals the live segment: the same rows under the sealed part's name, then the
    # live part goes and the new live one (here: requests of later minutes) appears.
    (day / "part=sj-0.200-300-1").mkdir()
    (day / "part=sj-0.live" / "part-00000.c000.parquet").rename(
        day / "part=sj-0.200-300-1" / "part-00000.c000.parquet"
    )
    (day / "part=sj-0.live").rmdir()
    newer = v1(DAY + dt.timedelta(minutes=95, seconds=3), 301)
    minute = pa.array([DAY + dt.timedelta(minutes=95)], pa.timestamp("us", "UTC"))
    rows = {
        "request_id": [newer],
        "journal": ["j-0"],
        "offset": [301],
        "app": ["shop"],
        "env": ["production"],
        "minute": minute,
    }
    (day / "part=sj-0.live").mkdir()
    pq.write_table(pa.table(rows), day / "part=sj-0.live" / "part-00000.c000.parquet")
    for rid in late:
        hit = index.find(rid)
        assert hit is not None and (hit.journal, hit.offset) == where[rid]
    hit = index.find(newer)
    assert hit is not None and hit.offset == 301


def test_a_part_gone_between_listing_and_reading_is_listed_again(tmp_path: Path) -> None:
    """The live part sealed just after a lookup listed it: the lookup lists again and finds
    the request in the sealed part, not an error."""
    where = _write_parted_day(tmp_path, journals=1, segments=3, per_segment=100)
    day = tmp_path / "request_ids" / f"date={DAY.date().isoformat()}"
    target = next(r for r, (_, offset) in where.items() if offset >= 250 and uuid1_time(r))

    class Racing(TableFiles):
        raced = 0

        def files(self, table: str, date: str) -> list[str]:
            listed = super().files(table, date)
            if not self.raced:
                self.raced += 1
                (day / "part=sj-0.200-300-1").mkdir()
                (day / "part=sj-0.live" / "part-00000.c000.parquet").rename(
                    day / "part=sj-0.200-300-1" / "part-00000.c000.parquet"
                )
            return listed

    racing = Racing(str(tmp_path))
    hit = RequestIndex(racing, find_dates=31).find(target)
    assert racing.raced == 1 and hit is not None and hit.offset == where[target][1]
