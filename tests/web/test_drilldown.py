"""The drill-down read from ``request_samples`` written a part per journal segment
(docs/spark.md's layout, written here with pyarrow): a group's rows merged over its parts are
exactly those the rollup gives for the union of its requests, and a parted table answers as
the flat table of the same requests does.

The rows a part holds are computed here by a brute-force ranking (:func:`expected_rows`, the
rules of ``transforms._ranked_samples``), the same one the merged rows are checked against.
tests/spark checks the console against tables the real job wrote.
"""

from __future__ import annotations

import datetime as dt
import random
import shutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from aiohttp import ClientSession
from hypothesis import given, settings
from hypothesis import strategies as st

from taproom.spark.settings import SparkSettings
from taproom.web.drilldown import Drilldown, merge_parts
from taproom.web.tables import TableFiles
from tests.support import running_app

DAY = dt.datetime(2026, 3, 4, tzinfo=dt.UTC)
DATE = DAY.date().isoformat()
STREAM = "shop-production"
ACTIONS = ("Cart#show", "Orders#create", "Search#index")
SLOW, FAILED = 3, 2  # small bounds: groups of a few requests overflow them

SAMPLE_SCHEMA = pa.schema(
    [
        ("minute", pa.timestamp("us", "UTC")),
        ("app", pa.string()),
        ("env", pa.string()),
        ("action", pa.string()),
        ("module", pa.string()),
        ("frontend", pa.bool_()),
        ("failed_count", pa.int64()),
        ("slow", pa.bool_()),
        ("failed", pa.bool_()),
        ("request_id", pa.string()),
        ("started", pa.timestamp("us", "UTC")),
        ("code", pa.int64()),
        ("total_time", pa.float64()),
        ("severity", pa.int64()),
        ("exceptions", pa.list_(pa.string())),
        ("host", pa.string()),
        ("times", pa.struct([("db_time", pa.float64()), ("view_time", pa.float64())])),
        ("journal", pa.string()),
        ("offset", pa.int64()),
    ]
)


@dataclass(frozen=True)
class Request:
    journal: str
    offset: int
    minute: int  # minutes into DAY
    action: str
    frontend: bool
    total_time: float
    started_us: int  # microseconds into the minute
    code: int
    exceptions: tuple[str, ...]

    @property
    def failed(self) -> bool:
        return self.code >= 500 or bool(self.exceptions)

    @property
    def group(self) -> tuple[Any, ...]:
        return (self.minute, self.action, self.frontend)


def requests_of(seed: int, count: int, journals: int, minutes: int) -> list[Request]:
    """Requests in journal order, their minutes mostly rising with the offset (a few late), with
    few distinct times taken and starts, so ties are broken by (journal, offset)."""
    rng = random.Random(seed)
    out = []
    for j in range(journals):
        for offset in range(count):
            minute = min(minutes - 1, offset * minutes // count + rng.choice((0, 0, 0, -1)))
            code = rng.choice((200, 200, 200, 404, 500, 503))
            out.append(
                Request(
                    journal=f"j{j}",
                    offset=offset * 7 + rng.randrange(3),
                    minute=max(0, minute),
                    action=rng.choice(ACTIONS),
                    frontend=rng.random() < 0.2,
                    total_time=float(rng.choice((5, 10, 10, 20, 40, 80))),
                    # a few starts with microseconds (answers give milliseconds)
                    started_us=rng.choice((0, 1_000_000, 2_000_000, 2_000_137)),
                    code=code,
                    exceptions=("Timeout",) if rng.random() < 0.15 else (),
                )
            )
    return out


def expected_rows(requests: list[Request], slow: int, failed: int) -> list[dict[str, Any]]:
    """The drill-down rows of ``requests``, ranked one group at a time by sorting (as the
    rollup's ``_ranked_samples`` does): the ``slow`` greatest by (total_time, journal,
    offset), the first ``failed`` failed by (started, journal, offset)."""
    groups: dict[tuple[Any, ...], list[Request]] = defaultdict(list)
    for request in requests:
        groups[request.group].append(request)
    rows = []
    for members in groups.values():
        by_time = sorted(members, key=lambda r: (r.total_time, r.journal, r.offset), reverse=True)
        slowest = set(by_time[:slow])
        failures = sorted(
            (r for r in members if r.failed), key=lambda r: (r.started_us, r.journal, r.offset)
        )
        first = set(failures[:failed])
        for request in members:
            if request in slowest or request in first:
                rows.append(_row(request, request in slowest, len(failures)))
    return rows


def _row(request: Request, slow: bool, failed_count: int) -> dict[str, Any]:
    minute = DAY + dt.timedelta(minutes=request.minute)
    return {
        "minute": minute,
        "app": "shop",
        "env": "production",
        "action": request.action,
        "module": request.action.split("#")[0],
        "frontend": request.frontend,
        "failed_count": failed_count,
        "slow": slow,
        "failed": request.failed,
        "request_id": f"{request.journal}-{request.offset}",
        "started": minute + dt.timedelta(microseconds=request.started_us),
        "code": request.code,
        "total_time": request.total_time,
        "severity": 4 if request.exceptions else 1,
        "exceptions": list(request.exceptions),
        "host": "web-1",
        "times": {"db_time": request.total_time / 2, "view_time": None},
        "journal": request.journal,
        "offset": request.offset,
    }


def segments_of(requests: list[Request], size: int) -> dict[str, list[Request]]:
    """Parts as the job names them: ``size`` requests of a journal per sealed segment, the
    journal's last segment live."""
    by_journal: dict[str, list[Request]] = defaultdict(list)
    for request in requests:
        by_journal[request.journal].append(request)
    parts: dict[str, list[Request]] = {}
    for journal, members in by_journal.items():
        members.sort(key=lambda r: r.offset)
        chunks = [members[i : i + size] for i in range(0, len(members), size)]
        for chunk in chunks[:-1]:
            first, end = chunk[0].offset, chunk[-1].offset + 1
            parts[f"s{journal}.{first}-{end}-{end * 100}"] = chunk
        parts[f"s{journal}.live"] = chunks[-1]
    return parts


def write_part(root: Path, table: str, part: str | None, rows: pa.Table, **options: Any) -> Path:
    directory = root / table / f"date={DATE}"
    if part is not None:
        directory = directory / f"part={part}"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "part-00000-c000.snappy.parquet"
    pq.write_table(rows, path, **options)
    return path


def write_flat(root: Path, requests: list[Request]) -> None:
    rows = pa.Table.from_pylist(expected_rows(requests, SLOW, FAILED), schema=SAMPLE_SCHEMA)
    write_part(root, "request_samples", None, rows)


def write_parted(
    root: Path,
    parts: dict[str, list[Request]],
    *,
    mark: bool = True,
    made: dict[str, Any] | None = None,
    **options: Any,
) -> None:
    """The parts' files, then (``mark``) each part's marker, as the job writes them; with
    ``made``, the marker's JSON (the job's: its bounds), else an empty marker."""
    for name, members in parts.items():
        rows = pa.Table.from_pylist(expected_rows(members, SLOW, FAILED), schema=SAMPLE_SCHEMA)
        write_part(root, "request_samples", name, rows, **options)
        if mark:
            mark_part(root, name, made)


def mark_part(root: Path, name: str, made: dict[str, Any] | None = None) -> None:
    markers = root / "request_samples" / "_parts"
    markers.mkdir(parents=True, exist_ok=True)
    (markers / name).write_bytes(orjson.dumps(made) if made is not None else b"")


def drilldown(root: Path) -> Drilldown:
    bounds = SparkSettings(slow_requests_per_action=SLOW, failed_requests_per_action=FAILED)
    return Drilldown(TableFiles(str(root)), bounds)


def key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["journal"], row["offset"], row["slow"], row["failed"], row["failed_count"])


# --- the merge itself -----------------------------------------------------------------------


def check_merge(requests: list[Request], parts: dict[str, list[Request]]) -> None:
    tables, tags = [], []
    for k, members in enumerate(parts.values()):
        rows = expected_rows(members, SLOW, FAILED)
        tables.append(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA))
        tags.append(np.full(len(rows), k))
    merged = merge_parts(pa.concat_tables(tables), np.concatenate(tags), SLOW, FAILED)
    got = sorted(key(row) for row in merged.to_pylist())
    assert got == sorted(key(row) for row in expected_rows(requests, SLOW, FAILED))


@pytest.mark.parametrize("seed", range(8))
def test_merged_parts_are_the_rows_of_their_union(seed: int) -> None:
    requests = requests_of(seed, count=300, journals=1 + seed % 3, minutes=20)
    check_merge(requests, segments_of(requests, size=17 + seed * 5))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    count=st.integers(1, 60),
    journals=st.integers(1, 3),
    size=st.integers(1, 30),
    minutes=st.integers(1, 4),
)
def test_merge_matches_a_brute_force_ranking(
    seed: int, count: int, journals: int, size: int, minutes: int
) -> None:
    requests = requests_of(seed, count, journals, minutes)
    check_merge(requests, segments_of(requests, size))


def test_one_part_is_left_as_it_was() -> None:
    requests = requests_of(1, count=200, journals=1, minutes=5)
    rows = pa.Table.from_pylist(expected_rows(requests, SLOW, FAILED), schema=SAMPLE_SCHEMA)
    merged = merge_parts(rows, np.zeros(rows.num_rows, dtype=np.int64), SLOW, FAILED)
    assert merged.equals(rows)


# --- answers: a parted table as the flat one --------------------------------------------------


def answers(reader: Drilldown) -> list[Any]:
    out: list[Any] = []
    for minute in (0, 3, 7, 11, 19):
        minute_ms = int((DAY + dt.timedelta(minutes=minute)).timestamp() * 1000)
        out.append(reader.samples(STREAM, DATE, minute_ms, "", 100))
        out.append(reader.samples(STREAM, DATE, minute_ms, ACTIONS[1], 100))
    for action in ACTIONS:
        out.append(reader.samples(STREAM, DATE, None, action, 1000))
        out.append(reader.samples(STREAM, DATE, None, action, 3))
    for action, status, exception in (
        ("", None, ""),
        (ACTIONS[0], None, ""),
        ("", 503, ""),
        ("", None, "Timeout"),
        (ACTIONS[2], 500, "Timeout"),
    ):
        out.append(
            reader.errors(
                STREAM, DATE, action=action, status=status, exception=exception, limit=1000
            )
        )
        out.append(
            reader.errors(STREAM, DATE, action=action, status=status, exception=exception, limit=5)
        )
    return out


@pytest.mark.parametrize(
    ("journals", "size", "options"),
    [
        # One journal: the minutes at segment boundaries are merged.
        (1, 97, {}),
        (1, 23, {}),  # segments of a minute or two: most minutes shared
        # Three journals: every minute has several parts.
        (3, 150, {}),
        # No minute ranges: the whole day merged at once.
        (2, 61, {"write_statistics": False}),
    ],
)
def test_a_parted_table_answers_as_the_flat_one(
    tmp_path: Path, journals: int, size: int, options: dict[str, Any]
) -> None:
    requests = requests_of(journals, count=1500 // journals, journals=journals, minutes=20)
    write_flat(tmp_path / "flat", requests)
    write_parted(tmp_path / "parted", segments_of(requests, size), **options)
    flat, parted = drilldown(tmp_path / "flat"), drilldown(tmp_path / "parted")
    expected = answers(flat)
    assert expected[0]["slow"] and any(a.get("requests") for a in expected)  # not vacuous
    assert answers(parted) == expected
    assert flat.merges == 0 and parted.merges > 0
    # And right, not only alike: the day's failed requests, and those the rollup kept.
    day = parted.errors(STREAM, DATE, action="", status=None, exception="", limit=1)
    assert day["failed_count"] == sum(r.failed for r in requests)
    kept = expected_rows(requests, SLOW, FAILED)
    assert day["failed_kept"] == sum(row["failed"] for row in kept) < day["failed_count"]


def test_parts_of_separate_minutes_are_not_merged(tmp_path: Path) -> None:
    requests = [r for r in requests_of(5, count=600, journals=1, minutes=20) if r.minute % 5]
    parts: dict[str, list[Request]] = defaultdict(list)
    for request in requests:
        parts[f"sj0.{request.minute // 5}"].append(request)
    write_flat(tmp_path / "flat", requests)
    write_parted(tmp_path / "parted", parts)
    flat, parted = drilldown(tmp_path / "flat"), drilldown(tmp_path / "parted")
    assert answers(parted) == answers(flat)
    assert parted.merges == 0


def test_flat_files_beside_parts_and_marker_names_are_not_read(tmp_path: Path) -> None:
    requests = requests_of(2, count=400, journals=1, minutes=10)
    parts = segments_of(requests, 90)
    write_parted(tmp_path, parts)
    old = pa.Table.from_pylist(expected_rows(requests[:50], SLOW, FAILED), schema=SAMPLE_SCHEMA)
    write_part(tmp_path, "request_samples", None, old)  # an earlier version's flat file
    day = tmp_path / "request_samples" / f"date={DATE}"
    (day / "part=sj0.live" / "_SUCCESS").touch()
    (day / "part=sj0.live" / ".part-00000-c000.snappy.parquet.crc").touch()
    tables = TableFiles(str(tmp_path))
    assert sorted(tables.parts("request_samples", DATE)) == sorted(f"part={p}" for p in parts)
    assert len(tables.files("request_samples", DATE)) == len(parts)
    assert tables.dates("request_samples") == [DATE]
    write_flat(tmp_path / "flat", requests)
    assert answers(drilldown(tmp_path)) == answers(drilldown(tmp_path / "flat"))


def test_a_replaced_part_is_not_served_from_a_stale_listing(tmp_path: Path) -> None:
    """The job seals the live segment as the contract orders it: the sealed part's files,
    the live part dropped, the sealed part's marker; and a new live part. At every step the
    same reader answers as the flat table of the requests of the parts it may read: never a
    request twice, never a cached answer of parts gone."""
    requests = requests_of(3, count=600, journals=1, minutes=20)
    day = tmp_path / "request_samples" / f"date={DATE}"
    reader = drilldown(tmp_path)

    def same_as(members: list[Request]) -> None:
        flat = tmp_path / f"flat-{members[0].offset}-{members[-1].offset}"
        if not flat.exists():
            write_flat(flat, members)
        assert answers(reader) == answers(drilldown(flat))

    write_parted(tmp_path, segments_of(requests[:380], 200))  # sealed [0, 200), live [200, 380)
    same_as(requests[:380])
    after = segments_of(requests, 200)  # sealed [0, 200) and [200, 400), live [400, 600)
    sealed = list(after)[1]
    write_parted(tmp_path, {sealed: after[sealed]}, mark=False)
    same_as(requests[:380])  # the new sealed part is not read before its marker
    shutil.rmtree(day / "part=sj0.live")
    same_as(requests[:200])  # for a moment, the live part's requests are missing
    mark_part(tmp_path, sealed)
    same_as(requests[:400])
    write_parted(tmp_path, {"sj0.live": after["sj0.live"]})
    same_as(requests)
    # Retention deleted the first segment: its part and marker go.
    shutil.rmtree(day / f"part={next(iter(after))}")
    (tmp_path / "request_samples" / "_parts" / next(iter(after))).unlink()
    same_as(requests[200:])


async def test_the_console_merges_with_the_bounds_of_its_spark_section(tmp_path: Path) -> None:
    """Over HTTP: the hub's ``[spark]`` bounds (3 slow, 2 failed, as the parts were written
    with) are those the console merges to; with the defaults (10, 50) every row of every part
    would stay and the answers would differ from the flat table's."""
    requests = requests_of(7, count=400, journals=2, minutes=20)
    write_flat(tmp_path / "flat", requests)
    write_parted(tmp_path / "parted", segments_of(requests, 70))
    flat = drilldown(tmp_path / "flat")
    minute_ms = int((DAY + dt.timedelta(minutes=9)).timestamp() * 1000)
    bounds = {"slow_requests_per_action": SLOW, "failed_requests_per_action": FAILED}
    console = {"rollups": str(tmp_path / "parted")}
    async with running_app(tmp_path, console=console, spark=bounds) as app:
        base = f"http://{app.addresses['web']}/api/requests"
        day = f"date={DATE}&stream={STREAM}"
        async with ClientSession() as http:
            async with http.get(f"{base}/samples?{day}&minute={minute_ms // 1000}") as r:
                assert r.status == 200
                samples = await r.json()
            async with http.get(f"{base}/errors?{day}&limit=50") as r:
                assert r.status == 200
                errors = await r.json()
    expected = flat.samples(STREAM, DATE, minute_ms, "", 100)
    assert samples == orjson.loads(orjson.dumps(expected))
    assert len(samples["slow"]) > SLOW  # several actions in the minute
    expected = flat.errors(STREAM, DATE, action="", status=None, exception="", limit=50)
    assert errors == orjson.loads(orjson.dumps(expected))


def test_the_bounds_the_parts_were_written_with_are_those_merged_to(tmp_path: Path) -> None:
    """The job's markers record the bounds it wrote the parts with; the console merges to
    those, whatever its own [spark] section says (here the defaults, 10 and 50: merged to
    them, every row of every part would stay). Markers that disagree, or say nothing: the
    section's bounds."""
    requests = requests_of(13, count=400, journals=2, minutes=20)
    write_flat(tmp_path / "flat", requests)
    made = {"cache_version": 6, "slow": SLOW, "failed": FAILED, "dates": [DATE]}
    write_parted(tmp_path / "parted", segments_of(requests, 70), made=made)
    expected = answers(drilldown(tmp_path / "flat"))
    defaults = SparkSettings()
    assert (defaults.slow_requests_per_action, defaults.failed_requests_per_action) != (
        SLOW, FAILED,
    )  # fmt: skip
    assert answers(Drilldown(TableFiles(str(tmp_path / "parted")), defaults)) == expected

    # One marker disagrees (not what the job leaves: it writes every part again when its
    # bounds change): the [spark] section's bounds, and with the defaults the answers differ.
    markers = tmp_path / "parted" / "request_samples" / "_parts"
    first = sorted(markers.iterdir())[0]
    first.write_bytes(orjson.dumps({**made, "slow": SLOW + 1}))
    assert answers(Drilldown(TableFiles(str(tmp_path / "parted")), defaults)) != expected
    assert answers(drilldown(tmp_path / "parted")) == expected


def test_a_part_of_an_older_schema_reads_with_the_others(tmp_path: Path) -> None:
    """A part written without a column the others have (an older job's) is read in the
    first file's schema, the column null, and merged with the rest."""
    requests = requests_of(11, count=500, journals=2, minutes=20)
    parts = segments_of(requests, 100)
    write_parted(tmp_path / "parted", parts)
    older = sorted(parts)[-1]
    path = next((tmp_path / "parted" / "request_samples").glob(f"*/part={older}/*.parquet"))
    pq.write_table(pq.read_table(path).drop_columns(["host"]), path)
    write_flat(tmp_path / "flat", requests)
    got, expected = answers(drilldown(tmp_path / "parted")), answers(drilldown(tmp_path / "flat"))
    hosts = set()
    for mine, theirs in zip(got, expected, strict=True):
        for name in ("slow", "failed", "requests"):
            rows = mine.get(name, [])
            hosts |= {row["host"] for row in rows}
            for row in rows:
                row["host"] = "web-1"
        assert mine == theirs
    assert hosts == {"web-1", None}


def test_parts_read_out_of_order_still_merge_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep relies on the dataset's batches coming in its files' order; should they not,
    every shared row is held to the end and the answers stay exact."""
    requests = requests_of(4, count=600, journals=1, minutes=20)
    write_flat(tmp_path / "flat", requests)
    write_parted(tmp_path / "parted", segments_of(requests, 23))
    real = ds.dataset

    def swapped_files(source: Any, **options: Any) -> Any:
        if isinstance(source, list):  # 1, 0, 3, 2, ...: part 2 read after part 3
            swapped = [i ^ 1 if i ^ 1 < len(source) else i for i in range(len(source))]
            source = [source[i] for i in swapped]
        return real(source, **options)

    expected = answers(drilldown(tmp_path / "flat"))
    monkeypatch.setattr(ds, "dataset", swapped_files)
    assert answers(drilldown(tmp_path / "parted")) == expected


def test_a_file_gone_between_listing_and_reading_is_listed_again(tmp_path: Path) -> None:
    """The job rewrites the live part (new file names) just after a page listed the old one:
    the answer is read again from a fresh listing, not an error."""
    requests = requests_of(6, count=500, journals=1, minutes=20)
    parts = segments_of(requests, 120)
    write_parted(tmp_path / "parted", parts)
    write_flat(tmp_path / "flat", requests)
    live = tmp_path / "parted" / "request_samples" / f"date={DATE}" / "part=sj0.live"

    class Racing(TableFiles):
        raced = 0

        def parts(self, table: str, date: str) -> dict[str, list[str]]:
            listed = super().parts(table, date)
            if not self.raced:  # the job's rename right after this listing
                self.raced += 1
                (live / "part-00000-c000.snappy.parquet").rename(live / "part-00000-c001.parquet")
            return listed

    bounds = SparkSettings(slow_requests_per_action=SLOW, failed_requests_per_action=FAILED)
    racing = Racing(str(tmp_path / "parted"))
    got = Drilldown(racing, bounds).errors(
        STREAM, DATE, action="", status=None, exception="", limit=100
    )
    assert racing.raced == 1
    expected = drilldown(tmp_path / "flat").errors(
        STREAM, DATE, action="", status=None, exception="", limit=100
    )
    assert got == expected


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    sizes=st.lists(st.integers(1, 80), min_size=1, max_size=3),
    minutes=st.integers(1, 12),
)
def test_any_layout_of_parts_answers_as_the_flat_table(
    seed: int, sizes: list[int], minutes: int
) -> None:
    """Journals cut into segments of their own sizes (parts of one request, parts spanning
    every minute, boundaries anywhere): the reader's sweep answers as the flat table."""
    import tempfile

    requests: list[Request] = []
    parts: dict[str, list[Request]] = {}
    for j, size in enumerate(sizes):
        mine = [
            Request(**{**r.__dict__, "journal": f"j{j}"})
            for r in requests_of(seed + j, 120, 1, minutes)
        ]
        requests += mine
        parts.update(segments_of(mine, size))
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        write_flat(root / "flat", requests)
        write_parted(root / "parted", parts)
        assert answers(drilldown(root / "parted")) == answers(drilldown(root / "flat"))
