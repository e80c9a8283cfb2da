"""Every transform against an independent pure-Python computation over the same events."""

from __future__ import annotations

import math
from typing import Any

import pytest

from taproom.spark import transforms as T

from .generate import (
    reference_exception_samples,
    reference_exceptions,
    reference_logs,
    reference_requests,
    reference_samples,
)

pytestmark = pytest.mark.spark

KEY = ("minute", "app", "env", "action", "module", "frontend")


def quantile_ok(times: list[float], value: float, q: float) -> bool:
    """``value`` is within the documented error of the exact nearest-rank q-quantile."""
    ordered = sorted(times)
    rank = next(r for r in range(1, len(ordered) + 1) if r >= len(ordered) * q)
    exact = ordered[rank - 1]
    if exact < T.PERCENTILE_FLOOR_MS:
        return abs(value - exact) <= T.PERCENTILE_FLOOR_MS
    return abs(value - exact) <= T.PERCENTILE_RELATIVE_ERROR * exact * (1 + 1e-12)


@pytest.fixture(scope="module")
def events_df(spark: Any, logjam_journal: Any) -> Any:
    return spark.read.format("taproom").load(str(logjam_journal))


def test_request_rollup_matches_reference(events_df: Any, logjam_events: Any) -> None:
    expected = reference_requests(logjam_events)
    rows = events_df.transform(T.logjam_requests).transform(T.request_rollup).collect()
    got = {tuple(r[k] for k in KEY): r.asDict() for r in rows}
    assert set(got) == set(expected)
    assert sum(r["count"] for r in got.values()) == sum(e["count"] for e in expected.values())
    exact = [
        "count",
        "apdex_happy",
        "apdex_satisfied",
        "apdex_tolerating",
        "apdex_frustrated",
        *[f"status_{c}xx" for c in range(1, 6)],
        "status_other",
        *[f"severity_{s}" for s in T.SEVERITY_NAMES],
        "exceptions",
        "requests_with_exceptions",
    ]
    for key, want in expected.items():
        row = got[key]
        for name in exact:
            assert row[name] == want[name], (key, name)
        assert math.isclose(row["total_time_sum"], want["total_time_sum"], rel_tol=1e-9)
        assert row["total_time_max"] == want["total_time_max"]
        assert math.isclose(row["apdex"], want["apdex"], rel_tol=1e-12)
        assert row["date"] == key[0].strftime("%Y-%m-%d")
        for q, name in ((0.5, "p50"), (0.9, "p90"), (0.95, "p95"), (0.99, "p99")):
            value = row[f"total_time_{name}"]
            assert quantile_ok(want["times"], value, q), (key, name, value)


def test_request_defaults_follow_the_importer(spark: Any) -> None:
    """Missing fields take logjam's defaults; broken JSON still counts as one request, but a
    body the server stored as raw (not JSON, content type "raw") is not a request at all."""
    from pyspark.sql import functions as F

    from taproom.spark.schemas import EVENT_SCHEMA

    rows = [
        ("j", 0, "app-env", "logs.app.env", b"{}", "json"),
        ("j", 1, "app-env", "logs.app.env", b"{not json", "json"),
        (
            "j",
            2,
            "app-env",
            "frontend.page",
            b'{"total_time": 600, "lines": [[3, "t", "m"]]}',
            "json",
        ),
        ("j", 3, "app-env", "events.app.env", b'{"total_time": 5}', "json"),
        ("j", 4, "app-env", "logs.app.env", b"plain text, not a request", "raw"),
    ]
    df = spark.createDataFrame(
        [
            (
                j,
                o,
                __import__("datetime").datetime(2026, 1, 2, 3, 4, 5),
                "logjam",
                s,
                t,
                "",
                0,
                "",
                None,
                ct,
                p,
                {},
            )
            for j, o, s, t, p, ct in rows
        ],
        EVENT_SCHEMA,
    )
    out = {
        r["offset"]: r
        for r in df.transform(T.logjam_requests)
        .select(
            "offset",
            "action",
            "code",
            "total_time",
            "severity",
            "module",
            "frontend",
            F.date_format("minute", "HH:mm").alias("m"),
        )
        .collect()
    }
    assert set(out) == {0, 1, 2}  # events.* is not a request topic, a raw body no request
    for offset in (0, 1):
        r = out[offset]
        assert (r["action"], r["code"], r["total_time"], r["severity"], r["module"]) == (
            T.DEFAULT_ACTION,
            500,
            1.0,
            1,
            "Others",
        )
        assert r["m"] == "03:04"  # no started_at: receive time
    assert out[2]["severity"] == 3 and out[2]["frontend"] is True
    # 600 ms is tolerating on the backend but satisfied (not happy) on the frontend.
    rollup = df.transform(T.logjam_requests).transform(T.request_rollup).collect()
    front = next(r for r in rollup if r["frontend"])
    assert (front["apdex_happy"], front["apdex_satisfied"], front["apdex"]) == (0, 1, 1.0)


def test_a_request_time_the_journal_cannot_hold_falls_back_to_ts_then_receive_time(
    spark: Any,
) -> None:
    """Issue 25 part 4: started_at in 2426 or 0001, started_ms of 2^62 (which failed the
    query in timestamp_millis) or the epoch are absent; the minute comes from the event's
    ts, else from its receive time."""
    import datetime

    from pyspark.sql import functions as F

    from taproom.spark.schemas import EVENT_SCHEMA

    received = datetime.datetime(2026, 1, 2, 3, 4, 5)
    ts = datetime.datetime(2026, 1, 2, 5, 6, 7)
    bodies = [
        (b'{"started_at": "2426-01-01T00:00:00Z"}', None),
        (b'{"started_at": "0001-01-01T00:00:00Z"}', ts),
        (b'{"started_ms": 4611686018427387904}', None),
        (b'{"started_at": "1970-01-01T00:00:00Z", "started_ms": 0}', ts),
        (b'{"started_at": "2026-01-02T07:08:09Z"}', ts),  # in range: it wins
    ]
    df = spark.createDataFrame(
        [
            ("j", o, received, "logjam", "app-env", "logs.app.env", "", 0, "", t, "json", p, {})
            for o, (p, t) in enumerate(bodies)
        ],
        EVENT_SCHEMA,
    )
    minutes = {
        r["offset"]: r["m"]
        for r in df.transform(T.logjam_requests)
        .select("offset", F.date_format("minute", "yyyy-MM-dd HH:mm").alias("m"))
        .collect()
    }
    assert minutes == {
        0: "2026-01-02 03:04",
        1: "2026-01-02 05:06",
        2: "2026-01-02 03:04",
        3: "2026-01-02 05:06",
        4: "2026-01-02 07:08",
    }


def test_exception_rollup_matches_reference(events_df: Any, logjam_events: Any) -> None:
    expected = reference_exceptions(logjam_events)
    samples = reference_exception_samples(logjam_events, 2)
    rows = events_df.transform(T.logjam_requests).transform(T.exception_rollup, samples=2).collect()
    got = {(*(r[k] for k in KEY), r["exception"]): r["count"] for r in rows}
    assert expected and got == expected
    # Each class's first requests (journal order), pointing back into the journal.
    got_samples = {(*(r[k] for k in KEY), r["exception"]): r["samples"] for r in rows}
    by_offset = {e["offset"]: e for e in events_df.select("offset", "payload").collect()}
    assert max(len(v) for v in samples.values()) == 2  # the bound was reached somewhere
    for key, offsets in samples.items():
        refs = got_samples[key]
        assert [ref["offset"] for ref in refs] == offsets, key
        for ref in refs:
            assert (
                ref["journal"] and ref["request_id"] in bytes(by_offset[ref["offset"]][1]).decode()
            )


def test_request_samples_keep_the_slowest_and_the_failed(
    events_df: Any, logjam_events: Any
) -> None:
    """Per minute and action: the N slowest, the first M failed (by start), each request once
    with its key fields and its place in the journal; failed_count counts every failed one."""
    slow, failed = 2, 1
    expected = reference_samples(logjam_events, slow, failed)
    rows = (
        events_df.transform(T.logjam_requests)
        .transform(T.request_samples, slow=slow, failed=failed)
        .collect()
    )
    journal = events_df.select("journal").first()[0]
    got: dict[tuple[Any, ...], list[Any]] = {}
    for r in rows:
        got.setdefault(tuple(r[k] for k in KEY), []).append(r)
    assert set(got) == set(expected)
    assert any(e["failed_count"] > failed for e in expected.values())  # the bound was hit
    assert any(len(e["rows"]) > slow for e in expected.values())
    for key, want in expected.items():
        kept = got[key]
        offsets = [r["offset"] for r in kept]
        assert len(offsets) == len(set(offsets)), key  # a request slow and failed: one row
        assert {r["offset"] for r in kept if r["slow"]} == want["slow"], key
        failed_first = want["failed"]
        assert set(offsets) == want["slow"] | failed_first, key
        for r in kept:
            ref = want["rows"][r["offset"]]
            is_failed = ref["code"] >= 500 or ref["severity"] >= 3 or bool(ref["exceptions"])
            assert r["failed"] == is_failed, key
            assert r["failed_count"] == want["failed_count"]
            assert r["journal"] == journal and r["date"] == key[0].strftime("%Y-%m-%d")
            for name in ("code", "total_time", "severity", "exceptions", "request_id", "host"):
                assert r[name] == ref[name], (key, name)
            assert abs((r["started"] - ref["started"]).total_seconds()) < 1e-5


def test_request_index_maps_every_request_id(events_df: Any, logjam_events: Any) -> None:
    from .generate import request_rows

    rows = events_df.transform(T.logjam_requests).transform(T.request_index).collect()
    expected = {
        (r["request_id"], r["offset"], r["minute"])
        for r in request_rows(logjam_events)
        if r["request_id"]
    }
    assert len(expected) > 2000
    assert {(r["request_id"], r["offset"], r["minute"]) for r in rows} == expected
    assert len(rows) == len(expected)


def test_log_rollup_matches_reference(events_df: Any, logjam_events: Any) -> None:
    expected = reference_logs(logjam_events)
    rows = events_df.transform(T.log_rollup).collect()
    got = {
        (r["minute"], r["protocol"], r["stream"], r["level"]): (r["count"], r["bytes"])
        for r in rows
    }
    assert got == expected
    assert {k[1] for k in got} == {"logjam", "lumberjack", "logtk"}


def test_request_rollup_sums_resources_and_keeps_the_histogram(spark: Any) -> None:
    """Every numeric resource a request carries is summed; absent ones add nothing; the stored
    histogram holds every request and its buckets give the reported percentiles."""
    import datetime as dt

    from taproom.spark.buckets import bucket_of, bucket_value
    from taproom.spark.schemas import EVENT_SCHEMA, LOGJAM_RESOURCES

    payloads = [
        b'{"action": "A#x", "total_time": 10, "db_time": 4.5, "db_calls": 3, "view_time": 2}',
        b'{"action": "A#x", "total_time": 30, "db_time": 1.5, "allocated_memory": 1024}',
        b'{"action": "A#x", "total_time": 200, "gc_time": "not a number", "page_time": 7}',
    ]
    received = dt.datetime(2026, 1, 2, 3, 4, 5)
    df = spark.createDataFrame(
        [
            ("j", o, received, "logjam", "app-env", "logs.app.env", "", 0, "", None, "json", p, {})
            for o, p in enumerate(payloads)
        ],
        EVENT_SCHEMA,
    )
    (row,) = df.transform(T.logjam_requests).transform(T.request_rollup).collect()
    sums = {name: row[f"{name}_sum"] for name in LOGJAM_RESOURCES}
    assert sums["db_time"] == 6.0 and sums["db_calls"] == 3.0 and sums["view_time"] == 2.0
    assert sums["allocated_memory"] == 1024.0 and sums["page_time"] == 7.0
    assert sums["gc_time"] == 0.0 and sums["redis_calls"] == 0.0  # not numeric / absent
    histogram = [(h["b"], h["n"]) for h in row["total_time_histogram"]]
    assert histogram == sorted((bucket_of(t), 1) for t in (10.0, 30.0, 200.0))
    assert math.isclose(row["total_time_p50"], bucket_value(bucket_of(30.0)), rel_tol=1e-9)


def test_attribute_lager_rows_takes_the_first_link_after_each_row(
    spark: Any, tmp_path: Any
) -> None:
    """Rows journaled unattributed take the key of the first lager-attribution or
    lager-registration record of their uuid after them (docs/protocols/lager.md); the rest
    keep their stream; a row no record names keeps a null key."""
    from taproom.journal import Journal
    from taproom.records import BatchBuilder

    u1, u2, u3, u4 = (f"00000000-0000-4000-8000-00000000000{n}" for n in range(1, 5))
    plan = [  # (content type, stream, producer, unattributed) at offsets 0..
        ("lager-registration", "/r1/arm", u1, False),  # 0
        ("lager", "/r1/arm", u1, False),  # 1
        ("lager", "", u2, True),  # 2: -> /r2/arm (the link at 5)
        ("lager", "", u2, True),  # 3: -> /r2/arm
        ("lager", "", u4, True),  # 4: -> /r4/arm (a registration at 9 after a restart)
        ("lager-attribution", "/r2/arm", u2, False),  # 5
        ("lager", "/r2/arm", u2, False),  # 6
        ("lager", "", u2, True),  # 7: the key moved away; -> /r5/arm (the link at 8)
        ("lager-attribution", "/r5/arm", u2, False),  # 8
        ("lager-registration", "/r4/arm", u4, False),  # 9
        ("lager", "", u3, True),  # 10: nothing names u3
    ]
    journal = Journal(tmp_path / "j")
    builder = BatchBuilder()
    for content_type, stream, producer, unattributed in plan:
        attrs = {"version": "4245455252303031", "flags": "0"}
        if unattributed:
            attrs["unattributed"] = "true"
        builder.add("lager", b"\0" * 12, stream=stream, producer=producer,
                    content_type=content_type, attrs=attrs)  # fmt: skip
    journal.commit([builder.build()])
    journal.close()
    events = spark.read.format("taproom").load(str(tmp_path / "j"))
    got = {
        r["offset"]: (r["key"], r["attributed_later"])
        for r in T.attribute_lager_rows(events).collect()
    }
    assert got == {
        1: ("/r1/arm", False),
        2: ("/r2/arm", True),
        3: ("/r2/arm", True),
        4: ("/r4/arm", True),
        6: ("/r2/arm", False),
        7: ("/r5/arm", True),
        10: (None, False),
    }
