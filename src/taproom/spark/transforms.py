"""Pure DataFrame → DataFrame transforms: logjam requests and the rollups.

Each function takes DataFrames with the schemas of :mod:`.schemas` and returns a new one;
nothing here reads or writes storage, so batch and streaming jobs chain the same functions
with ``.transform()``. What logjam's importer computes per minute is the model (PEERS.md):

* minute from ``started_at``; defaults code 500, total_time 1.0, action
  ``Unknown#unknown_method``; severity = the request's ``severity``, else the highest line
  severity, else 1;
* apdex with three thresholds (happy / satisfied / tolerating): 100/500/2000 ms for backend
  requests, 500/2000/8000 ms for ``frontend.*`` topics; apdex = (satisfied + tolerating/2) /
  count, where satisfied includes happy;
* counts per HTTP status class, per severity and per exception; total_time sum, max and
  percentiles from a log-bucket histogram: each within :data:`PERCENTILE_RELATIVE_ERROR`
  (1%) of the exact value, deterministic, the same in batch and streaming runs; the histogram
  itself (``total_time_histogram``) so readers can merge rows into percentiles and heatmaps;
* the sum of every numeric resource in :data:`~taproom.spark.schemas.LOGJAM_RESOURCES`
  (``db_time_sum``, ``db_calls_sum``, ``allocated_memory_sum``, ...), as logjam's importer sums
  its configured resources.

Beside the aggregates, the console's drill-down: :func:`request_samples` (per minute and action
the slowest and the failed requests, each with where it is stored: ``journal``, ``offset``),
samples of the requests behind each exception class (:func:`exception_rollup`) and the
request-id index (:func:`request_index`).

Streaming jobs pass ``watermark`` (e.g. ``"10 minutes"``): rows of a minute are emitted once
the watermark passes it, and later events for that minute are dropped, as Spark documents.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from ..eventtime import MAX_MS, MAX_NS, MIN_MS, MIN_NS
from .buckets import GAMMA, LOG_GAMMA, PERCENTILE_FLOOR_MS, PERCENTILE_RELATIVE_ERROR
from .logjamdoc import SEVERITY_NAMES
from .schemas import (
    EVENT_PAYLOAD_SCHEMA,
    LOGJAM_RESOURCES,
    LOGJAM_TIME_RESOURCES,
    PARSED_EVENT_SCHEMA,
)

__all__ = [
    "BACKEND_APDEX_MS",
    "DEFAULT_ACTION",
    "FRONTEND_APDEX_MS",
    "PERCENTILE_FLOOR_MS",
    "PERCENTILE_RELATIVE_ERROR",
    "SEVERITY_NAMES",
    "attribute_lager_rows",
    "exception_rollup",
    "log_rollup",
    "logjam_requests",
    "merge_sample_parts",
    "parse_events",
    "parsed_rows",
    "request_index",
    "request_rollup",
    "request_samples",
    "telemetry_rollup",
]

BACKEND_APDEX_MS = (100.0, 500.0, 2000.0)
FRONTEND_APDEX_MS = (500.0, 2000.0, 8000.0)
DEFAULT_ACTION = "Unknown#unknown_method"
DEFAULT_CODE = 500
DEFAULT_TOTAL_TIME = 1.0
DEFAULT_SEVERITY = 1
# The drill-down tables' defaults: [spark] slow_requests_per_action, failed_requests_per_action,
# exception_samples (spark/settings.py) give the job's values.
DEFAULT_SLOW_REQUESTS = 10
DEFAULT_FAILED_REQUESTS = 50
DEFAULT_EXCEPTION_SAMPLES = 5
FAILED_SEVERITY = 3  # error, fatal, unknown
MAX_REQUEST_ID = 256  # the console's longest text parameter
# Percentiles come from a histogram of total_time with logarithmic buckets (spark/buckets.py,
# as DDSketch does): each reported percentile is within PERCENTILE_RELATIVE_ERROR of the exact
# value (nearest rank), for values of at least PERCENTILE_FLOOR_MS; smaller values (and zero or
# negative ones) share the lowest bucket and are reported within PERCENTILE_FLOOR_MS.
_GAMMA = GAMMA
_LOG_GAMMA = LOG_GAMMA
_QUANTILES = (0.5, 0.9, 0.95, 0.99)
_QUANTILE_NAMES = ("p50", "p90", "p95", "p99")
_DIMENSIONS = ("minute", "app", "env", "action", "module", "frontend")
# A drill-down row's request fields, in REQUEST_SAMPLE_SCHEMA's order.
_SAMPLE_FIELDS = (
    "request_id",
    "started",
    "code",
    "total_time",
    "severity",
    "exceptions",
    "host",
    "times",
    "journal",
    "offset",
)


def _is_request_topic(topic: Column) -> Column:
    # logs.* carry request documents, frontend.page / frontend.ajax the browser's timings;
    # javascript.* and events.* are not requests (logjam-consumer seed, topic grammar).
    return topic.startswith("logs.") | topic.startswith("frontend.")


def _level(content_type: Column, attrs: Column, doc: Column) -> Column:
    """A log level name from attrs, or from a JSON payload's level / severity field."""
    # A non-string JSON value comes back as its text, so logjam's severity 3 reads "3".
    json_level = F.when(content_type.isin("json", "kv"), F.coalesce(doc["level"], doc["severity"]))
    raw = F.lower(F.coalesce(attrs["level"], json_level, F.lit("unknown")))
    names = F.create_map(
        *[x for k, n in enumerate(SEVERITY_NAMES) for x in (F.lit(str(k)), F.lit(n))]
    )
    return F.coalesce(names[raw], raw)


def parse_events(events: DataFrame) -> DataFrame:
    """One row per event with everything the three rollups read (:data:`PARSED_EVENT_SCHEMA`).

    Each payload is parsed at most once, for the log level and (for logjam requests) the
    request fields together. Passes ``journal`` and ``offset`` through (null when the input
    has none): the drill-down tables point back into the journal. Request columns are null
    for events that are not requests (``is_request`` false).
    """
    # Where each event is stored, passed through (null when the input has no such column).
    keep = [
        F.col(c) if c in events.columns else F.lit(None).cast(t).alias(c)
        for c, t in (("journal", "string"), ("offset", "long"))
    ]
    topic = F.col("topic")
    # A body the logjam server stored raw (not JSON) is no request document: no defaulted row.
    is_request = (
        (F.col("protocol") == "logjam")
        & (F.col("content_type") == "json")
        & _is_request_topic(topic)
    )
    # The parse gets a column of its own: Spark keeps a projection apart rather than copy an
    # expensive expression into each use, so every payload is parsed once (inlined into the
    # uses below, from_json ran up to three times per event).
    with_doc = events.select(
        "*",
        is_request.alias("is_request"),
        F.when(
            is_request | F.col("content_type").isin("json", "kv"),
            F.from_json(F.col("payload").cast("string"), EVENT_PAYLOAD_SCHEMA),
        ).alias("doc"),
    )
    doc = F.col("doc")
    parsed = with_doc.select(
        *keep,
        "protocol",
        "stream",
        "topic",
        "ts",
        "received",
        F.date_trunc("minute", F.coalesce(F.col("ts"), F.col("received"))).alias("log_minute"),
        _level(F.col("content_type"), F.col("attrs"), doc).alias("level"),
        F.length("payload").cast("long").alias("bytes"),
        "is_request",
        F.when(F.col("is_request"), doc).alias("r"),
    )
    line_max = F.expr("array_max(transform(r.lines, l -> try_cast(try_element_at(l, 1) AS INT)))")
    severity_text = F.col("r.severity")
    severity = F.when(severity_text.rlike(r"^-?[0-9]{1,18}$"), severity_text.cast("long"))
    action = F.when(
        F.col("r.action").isNull() | (F.col("r.action") == ""), F.lit(DEFAULT_ACTION)
    ).otherwise(F.col("r.action"))
    # The event-time rule (taproom.eventtime, docs/spark.md): a started_at or started_ms the
    # journal's i64 nanoseconds cannot hold (years 1-1677, 2262-9999; 2^62 ms), or the epoch
    # itself ("unknown"), is absent, and the request falls back to the event's ts, then to its
    # receive time. Checked before timestamp_millis, which fails the query (ANSI mode) on a
    # number of milliseconds too large for a timestamp.
    started_at = F.try_to_timestamp(F.col("r.started_at"))
    started_at_us = F.unix_micros(started_at)
    started_ms = F.col("r.started_ms")
    started = F.coalesce(
        F.when(
            started_at_us.between(MIN_NS // 1000 + 1, MAX_NS // 1000) & (started_at_us != 0),
            started_at,
        ),
        F.when(
            started_ms.between(MIN_MS, MAX_MS) & (started_ms != 0),
            F.timestamp_millis(started_ms),
        ),
        F.col("ts"),
        F.col("received"),
    )
    app_env = F.regexp_extract(F.col("stream"), r"^(.+)-([^-]+)$", 1)
    req = F.col("is_request")

    def request(column: Column) -> Column:
        return F.when(req, column)

    out = parsed.select(
        "journal",
        "offset",
        "protocol",
        "stream",
        "topic",
        "log_minute",
        "level",
        "bytes",
        "is_request",
        request(F.when(app_env == "", F.col("stream")).otherwise(app_env)).alias("app"),
        request(F.regexp_extract(F.col("stream"), r"^(.+)-([^-]+)$", 2)).alias("env"),
        request(F.col("topic").startswith("frontend.")).alias("frontend"),
        request(started).alias("started"),
        request(action).alias("action"),
        request(F.coalesce(F.col("r.code"), F.lit(DEFAULT_CODE))).alias("code"),
        request(F.coalesce(F.col("r.total_time"), F.lit(DEFAULT_TOTAL_TIME))).alias("total_time"),
        request(F.coalesce(severity, line_max.cast("long"), F.lit(DEFAULT_SEVERITY))).alias(
            "severity"
        ),
        request(F.coalesce(F.col("r.exceptions"), F.array().cast("array<string>"))).alias(
            "exceptions"
        ),
        request(F.struct(*[F.col(f"r.{name}").alias(name) for name in LOGJAM_RESOURCES])).alias(
            "resources"
        ),
        F.col("r.request_id").alias("request_id"),
        F.col("r.host").alias("host"),
    )
    module = F.regexp_extract(F.col("action"), r"^([^:#]+)::", 1)
    return out.select(
        *PARSED_EVENT_SCHEMA.fieldNames()[: PARSED_EVENT_SCHEMA.fieldNames().index("minute")],
        F.date_trunc("minute", F.col("started")).alias("minute"),
        "action",
        request(
            F.when(module == "", F.lit("Others")).otherwise(F.concat(F.lit("::"), module))
        ).alias("module"),
        "code",
        "total_time",
        "severity",
        "exceptions",
        "resources",
        "request_id",
        "host",
    )


def parsed_rows(df: DataFrame) -> DataFrame:
    """``df`` as parsed rows: events are parsed, parsed rows (e.g. from the cache) pass."""
    return df if "is_request" in df.columns else parse_events(df)


def logjam_requests(events: DataFrame) -> DataFrame:
    """One typed row per logjam request event, with the importer's defaults applied.

    Takes raw events or parsed rows (:func:`parse_events`). Columns: journal and offset (when
    the input has them), stream, topic, app, env, frontend, started, minute, date, action,
    module, code, total_time, severity, exceptions (array of names), resources (struct of the
    numeric resources, :data:`~taproom.spark.schemas.LOGJAM_RESOURCES`; null where absent),
    request_id and host (null where absent); ``part`` when the input has it (the per-segment
    drill-down tables, jobs/parts.py).
    """
    parsed = parsed_rows(events)
    return (
        parsed.filter(F.col("is_request"))
        .select(
            *[c for c in ("journal", "offset") if c in parsed.columns],
            "stream",
            "topic",
            "app",
            "env",
            "frontend",
            "started",
            "minute",
            "action",
            "module",
            "code",
            "total_time",
            "severity",
            "exceptions",
            "resources",
            "request_id",
            "host",
            *[c for c in ("part",) if c in parsed.columns],
        )
        .withColumn("date", F.date_format(F.col("minute"), "yyyy-MM-dd"))
    )


def _date() -> Column:
    # Computed once per output row, after the aggregation (formatting it per event costs
    # more than the whole hash aggregation).
    return F.date_format(F.col("minute"), "yyyy-MM-dd").alias("date")


def _watermarked(df: DataFrame, column: str, watermark: str | None) -> DataFrame:
    return df.withWatermark(column, watermark) if watermark else df


def _count_if(condition: Column) -> Column:
    return F.count_if(condition).cast("long")


def _bucket(t: Column) -> Column:
    """The histogram bucket of a duration: ``ceil(log_gamma(t))``, bucket k holding
    ``(gamma^(k-1), gamma^k]``; values below :data:`PERCENTILE_FLOOR_MS` share one bucket."""
    return F.ceil(F.log(F.greatest(t, F.lit(PERCENTILE_FLOOR_MS))) / F.lit(_LOG_GAMMA)).cast("int")


def _quantile_buckets(buckets: Column, count: Column) -> Column:
    """The buckets of p50/p90/p95/p99 (struct fields k0..k3) in a sorted ``array<struct<b,
    n>>`` histogram; :func:`_bucket_value` turns one into a value.

    The q-quantile is the value of nearest rank ``ceil(q * count)``: the first bucket whose
    cumulative count reaches ``q * count`` holds it, and its midpoint in relative terms,
    ``2 gamma^k / (gamma + 1)``, is within :data:`PERCENTILE_RELATIVE_ERROR` of it. Clamping
    to the group's min and max only moves the estimate closer (and makes one-value groups
    exact)."""
    init = F.struct(
        F.lit(0).cast("long").alias("c"),
        *[F.lit(None).cast("int").alias(f"k{i}") for i in range(len(_QUANTILES))],
    )

    def step(acc: Column, x: Column) -> Column:
        c = acc["c"] + x["n"]
        return F.struct(
            c.alias("c"),
            *[
                F.coalesce(acc[f"k{i}"], F.when(c >= count * F.lit(q), x["b"])).alias(f"k{i}")
                for i, q in enumerate(_QUANTILES)
            ],
        )

    return F.aggregate(buckets, init, step)


def _bucket_value(found: Column, i: int, low: Column, high: Column) -> Column:
    gamma = F.lit(_GAMMA)
    value = F.lit(2.0) * F.pow(gamma, found[f"k{i}"]) / (gamma + 1)
    return F.least(high, F.greatest(low, value))


def request_rollup(requests: DataFrame, watermark: str | None = None) -> DataFrame:
    """Per minute, app, env, action, module (and backend/frontend): the logjam figures.

    Two aggregations: per group and total_time bucket (every counter, plus the bucket's
    size), then per group (sums of those, and the percentiles from the bucket histogram).
    Both are plain hash aggregations; the histogram is exact to the bucket, deterministic,
    and the same for batch and streaming runs. In a streaming query the two are chained
    stateful operators on the watermarked minute.
    """
    t = F.col("total_time")
    frontend = F.col("frontend")
    happy_ms = F.when(frontend, F.lit(FRONTEND_APDEX_MS[0])).otherwise(BACKEND_APDEX_MS[0])
    satisfied_ms = F.when(frontend, F.lit(FRONTEND_APDEX_MS[1])).otherwise(BACKEND_APDEX_MS[1])
    tolerating_ms = F.when(frontend, F.lit(FRONTEND_APDEX_MS[2])).otherwise(BACKEND_APDEX_MS[2])
    status = F.floor(F.col("code") / 100)
    severity = F.col("severity")
    counters = {
        "apdex_happy": t < happy_ms,
        "apdex_satisfied": t < satisfied_ms,
        "apdex_tolerating": (t >= satisfied_ms) & (t < tolerating_ms),
        "apdex_frustrated": t >= tolerating_ms,
        **{f"status_{k}xx": status == k for k in range(1, 6)},
        "status_other": (status < 1) | (status > 5),
        **{f"severity_{name}": severity == k for k, name in enumerate(SEVERITY_NAMES[:5])},
        "severity_unknown": (severity < 0) | (severity > 4),
        "requests_with_exceptions": F.size("exceptions") > 0,
    }
    keys = _DIMENSIONS
    per_bucket = (
        _watermarked(requests, "minute", watermark)
        .groupBy(*keys, _bucket(t).alias("b"))
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.sum(t).alias("s"),
            F.min(t).alias("lo"),
            F.max(t).alias("hi"),
            F.sum(F.size("exceptions")).cast("long").alias("exceptions"),
            *[_count_if(cond).alias(name) for name, cond in counters.items()],
            *[F.sum(f"resources.{name}").alias(f"{name}_sum") for name in LOGJAM_RESOURCES],
        )
    )
    agg = per_bucket.groupBy(*keys).agg(
        F.sum("n").alias("count"),
        F.sum("s").alias("total_time_sum"),
        F.min("lo").alias("_lo"),
        F.max("hi").alias("total_time_max"),
        F.sort_array(F.collect_list(F.struct("b", "n"))).alias("_h"),
        *[F.sum(name).alias(name) for name in (*counters, "exceptions")],
        *[F.sum(f"{name}_sum").alias(f"{name}_sum") for name in LOGJAM_RESOURCES],
    )
    # The bucket search gets a projection of its own so that it runs once per row, not once
    # per percentile.
    agg = agg.select("*", _quantile_buckets(F.col("_h"), F.col("count")).alias("_q"))
    low, high = F.col("_lo"), F.col("total_time_max")
    quantiles = [_bucket_value(F.col("_q"), i, low, high) for i in range(len(_QUANTILES))]
    return agg.select(
        *keys,
        _date(),
        "count",
        "total_time_sum",
        "total_time_max",
        *[
            q.alias(f"total_time_{name}")
            for q, name in zip(quantiles, _QUANTILE_NAMES, strict=True)
        ],
        "apdex_happy",
        "apdex_satisfied",
        "apdex_tolerating",
        "apdex_frustrated",
        ((F.col("apdex_satisfied") + F.col("apdex_tolerating") / 2) / F.col("count")).alias(
            "apdex"
        ),
        *[f"status_{k}xx" for k in range(1, 6)],
        "status_other",
        *[f"severity_{name}" for name in SEVERITY_NAMES],
        "exceptions",
        "requests_with_exceptions",
        # A resource no request of the group carried sums to 0, as in logjam's importer.
        *[F.coalesce(F.col(f"{n}_sum"), F.lit(0.0)).alias(f"{n}_sum") for n in LOGJAM_RESOURCES],
        F.col("_h").alias("total_time_histogram"),
    )


def exception_rollup(
    requests: DataFrame, watermark: str | None = None, samples: int = DEFAULT_EXCEPTION_SAMPLES
) -> DataFrame:
    """Per minute, app, env, action, module and exception class: how many were raised, and
    ``samples``: the first ``samples`` requests (in journal order, so batch and streaming runs
    pick the same) that raised it, each ``(request_id, journal, offset)`` (``samples=0``: no
    such column)."""
    if samples <= 0:
        counted = requests.select(*_DIMENSIONS, F.explode("exceptions").alias("exception"))
        return (
            _watermarked(counted, "minute", watermark)
            .groupBy(*_DIMENSIONS, "exception")
            .agg(F.count(F.lit(1)).alias("count"))
            .select(*_DIMENSIONS, _date(), "exception", "count")
        )
    ref = F.struct("request_id", "journal", "offset")
    exploded = requests.select(
        *_DIMENSIONS,
        F.explode(F.array_distinct("exceptions")).alias("exception"),
        ref.alias("ref"),
        F.struct("journal", "offset").alias("ref_order"),
    )
    return (
        _watermarked(exploded, "minute", watermark)
        .groupBy(*_DIMENSIONS, "exception")
        .agg(
            F.count(F.lit(1)).alias("count"),
            F.min_by("ref", "ref_order", samples).alias("samples"),
        )
        .select(*_DIMENSIONS, _date(), "exception", "count", "samples")
    )


def _is_failed(code: Column, severity: Column, exceptions: Column) -> Column:
    # What logjam shows as an error: a server error, a logged error (or worse), an exception.
    return (code >= 500) | (severity >= FAILED_SEVERITY) | (F.size(exceptions) > 0)


def request_samples(
    requests: DataFrame,
    watermark: str | None = None,
    slow: int = DEFAULT_SLOW_REQUESTS,
    failed: int = DEFAULT_FAILED_REQUESTS,
) -> DataFrame:
    """The drill-down rows (:data:`~taproom.spark.schemas.REQUEST_SAMPLE_SCHEMA`): per
    minute, app, env, action and module (and backend/frontend), the ``slow`` slowest requests
    and the first ``failed`` failed ones (status >= 500, severity >= error or an exception, by
    start time), one row per request with ``slow`` and ``failed`` flags (a request can be
    both), its key fields and where it is stored (``journal``, ``offset``);
    ``failed_count`` counts every failed request of the group, kept or not.

    A streaming query (or one with a ``watermark``) takes one aggregation: ``max_by``/``min_by``
    with a count keep at most that many per group (a heap, so its state is bounded by the
    groups, not the requests). A batch query ranks the requests with window functions instead
    (:func:`_ranked_samples`, less CPU: docs/console.md; Structured Streaming has no such
    windows). Both break ties by ``(journal, offset)``, so batch and streaming runs keep the
    same requests (tests/spark/test_jobs.py compares them).
    """
    if watermark is None and not requests.isStreaming:
        return _ranked_samples(requests, slow, failed)
    is_failed = _is_failed(F.col("code"), F.col("severity"), F.col("exceptions"))
    # The request, led by what orders the slowest: (total_time, journal, offset) is unique, so
    # the struct orders itself and each row carries its fields once (Spark sorts every input
    # row of this aggregation: narrower rows are cheaper).
    sample = F.struct(
        F.col("total_time"),
        F.col("journal"),
        F.col("offset"),
        F.col("request_id"),
        F.col("started"),
        F.col("code"),
        F.col("severity"),
        F.col("exceptions"),
        F.col("host"),
        F.struct(*[F.col(f"resources.{n}").alias(n) for n in LOGJAM_TIME_RESOURCES]).alias("times"),
        is_failed.alias("failed"),
    )
    rows = requests.select(
        # The groups' hash first: the sort before the aggregation then tells groups apart by
        # this long prefix and compares the key columns only within a group.
        F.xxhash64(*_DIMENSIONS).alias("_group"),
        *_DIMENSIONS,
        sample.alias("s"),
        # null for a request that did not fail: min_by skips rows without an ordering value
        F.when(is_failed, F.struct("started", "journal", "offset")).alias("failed_order"),
    )
    grouped = (
        _watermarked(rows, "minute", watermark)
        .groupBy("_group", *_DIMENSIONS)
        .agg(
            F.max_by("s", "s", slow).alias("_slow"),
            F.min_by("s", "failed_order", failed).alias("_failed"),
            _count_if(F.col("failed_order").isNotNull()).alias("failed_count"),
        )
    )
    # A request is among the slowest iff it orders at or above the least of them: the
    # ordering is total (total_time, journal, offset are unique) and a group with fewer
    # requests than ``slow`` has all of them there. So the failed requests not already kept
    # as slow are those below that cut: one comparison each (mostly of total_time alone),
    # where a union of the two arrays compared every pair of requests field by field.
    cut = F.array_min("_slow")
    failed_only = F.filter("_failed", lambda s: s < cut)
    kept = grouped.select(
        *_DIMENSIONS,
        _date(),
        "failed_count",
        cut.alias("_cut"),
        # min_by gives null, not [], for a group without a failed request: then the slowest
        # alone.
        F.explode(F.coalesce(F.concat("_slow", failed_only), F.col("_slow"))).alias("s"),
    )
    return kept.select(
        *_DIMENSIONS,
        "date",
        "failed_count",
        (F.col("s") >= F.col("_cut")).alias("slow"),
        F.col("s.failed").alias("failed"),
        *[F.col(f"s.{name}").alias(name) for name in _SAMPLE_FIELDS],
    )


def _ranked_samples(requests: DataFrame, slow: int, failed: int) -> DataFrame:
    """:func:`request_samples` for a batch query, the same rows: each request ranked within
    its group by time taken (``row_number``, slowest first); kept when among the ``slow``
    first, or failed and started no later than the ``failed``-th failed request of its group
    (``min_by`` with a count over the whole group, in the same window: one sort, where a
    second window ordered by start sorted every row again).

    With a ``part`` column (the per-segment tables, jobs/parts.py) a group is also per part:
    each part's rows are what its requests alone give, and :func:`merge_sample_parts` merges
    them. The caller partitions by ``part`` first: the windows' partitioning (which includes
    ``part``) is then already satisfied and each part's rows stay in one task.

    Why not the aggregation: ``max_by``/``min_by`` with a count are declarative aggregates
    whose buffers are arrays, so Spark runs them as sort aggregates, partial and final: every
    request row is sorted twice, and each update rebuilds a group's heap arrays; the partial
    step saves nothing when a minute of an action holds a few requests (the heaps carry them
    all through the shuffle). Windows shuffle the rows once, sort them once and keep or drop
    each row where it stands (no explode; the one heap holds failed starts only).
    """
    is_failed = _is_failed(F.col("code"), F.col("severity"), F.col("exceptions"))
    parts = [c for c in ("part",) if c in requests.columns]
    rows = requests.select(
        # The groups' hash leads the partitioning and the sorts (as in request_samples): the
        # sorts tell groups apart by this long prefix and compare the keys only within one.
        F.xxhash64(*_DIMENSIONS).alias("_group"),
        *_DIMENSIONS,
        *parts,
        *[c for c in _SAMPLE_FIELDS if c != "times"],
        F.struct(*[F.col(f"resources.{n}").alias(n) for n in LOGJAM_TIME_RESOURCES]).alias("times"),
        is_failed.alias("failed"),
    )
    # (total_time, journal, offset) and (started, journal, offset) are unique: the rank and
    # the cut are those of the heaps' orderings.
    by_time = Window.partitionBy("_group", *_DIMENSIONS, *parts).orderBy(
        F.desc("total_time"), F.desc("journal"), F.desc("offset")
    )
    # The whole group, in the same order: one sort for every window of this select.
    whole = by_time.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
    # null for a request that did not fail: min_by skips it.
    failed_order = F.when(F.col("failed"), F.struct("started", "journal", "offset"))
    ranked = rows.select("*", failed_order.alias("_failed_order")).select(
        "*",
        F.row_number().over(by_time).alias("_slow_rank"),
        F.count_if(F.col("failed")).over(whole).cast("long").alias("failed_count"),
        # The latest start among the first ``failed`` failed requests: a failed request is
        # among them iff it started no later (null in a group without a failed request).
        F.array_max(F.min_by("_failed_order", "_failed_order", failed).over(whole)).alias(
            "_failed_cut"
        ),
    )
    is_slow = F.col("_slow_rank") <= slow
    return ranked.filter(is_slow | (F.col("_failed_order") <= F.col("_failed_cut"))).select(
        *_DIMENSIONS,
        _date(),
        "failed_count",
        is_slow.alias("slow"),
        "failed",
        *_SAMPLE_FIELDS,
        *parts,
    )


def merge_sample_parts(
    samples: DataFrame,
    slow: int = DEFAULT_SLOW_REQUESTS,
    failed: int = DEFAULT_FAILED_REQUESTS,
) -> DataFrame:
    """Whole ``request_samples`` rows from per-part ones (the batch job's per-segment layout,
    ``<table>/date=.../part=.../``): what :func:`request_samples` gives over the union of the
    parts' requests, the ``part`` column dropped. ``slow`` and ``failed`` must be the bounds
    the parts were written with (``[spark] slow_requests_per_action``,
    ``failed_requests_per_action``) or smaller.

    Exact because each part kept its own ``slow`` slowest and ``failed`` first failed
    requests: the ``slow`` slowest of a union are among the union of each part's ``slow``
    slowest, and the first ``failed`` failed of a union among each part's first ``failed``.
    Per group (the dimensions and the date): ``slow`` = among the ``slow`` greatest by
    (total_time, journal, offset); a failed row is kept when among the first ``failed``
    failed by (started, journal, offset); a row is kept when slow or kept failed;
    ``failed_count`` = the sum of each part's ``failed_count`` for the group. Rows without a
    ``part`` column (the layout without a cache, a stream's table) are already whole and
    pass unchanged.

    For a Spark user: ``spark.read.parquet("<out>/request_samples")`` (or one date's
    directory) ``.transform(merge_sample_parts, slow=10, failed=50)``.
    """
    if "part" not in samples.columns:
        return samples
    keys = (*_DIMENSIONS, "date")
    by_time = Window.partitionBy(*keys).orderBy(
        F.desc("total_time"), F.desc("journal"), F.desc("offset")
    )
    whole = by_time.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
    # The part's count once per (group, part): every row of a part's group carries it.
    first_of_part = Window.partitionBy(*keys, "part").orderBy("journal", "offset")
    counted = samples.select(
        "*",
        F.when(F.row_number().over(first_of_part) == 1, F.col("failed_count")).alias("_count"),
        F.when(F.col("failed"), F.struct("started", "journal", "offset")).alias("_failed_order"),
    )
    ranked = counted.select(
        "*",
        F.row_number().over(by_time).alias("_slow_rank"),
        F.sum("_count").over(whole).cast("long").alias("_failed_count"),
        F.array_max(F.min_by("_failed_order", "_failed_order", failed).over(whole)).alias(
            "_failed_cut"
        ),
    )
    is_slow = F.col("_slow_rank") <= slow
    return ranked.filter(is_slow | (F.col("_failed_order") <= F.col("_failed_cut"))).select(
        *_DIMENSIONS,
        "date",
        F.col("_failed_count").alias("failed_count"),
        is_slow.alias("slow"),
        "failed",
        *_SAMPLE_FIELDS,
    )


def request_index(requests: DataFrame) -> DataFrame:
    """The request-id index (:data:`~taproom.spark.schemas.REQUEST_ID_SCHEMA`): request id ->
    journal, offset (with app, env and minute), for every request that has an id of at most
    :data:`MAX_REQUEST_ID` characters (longer ones cannot be asked for).

    A projection: streaming and batch runs give the same rows. The batch job sorts each file
    by ``request_id`` (:func:`~taproom.spark.jobs.rollup.run_rollup`), so a lookup reads one
    row group per file; a streaming query cannot sort its files (docs/console.md)."""
    rid = F.col("request_id")
    parts = [c for c in ("part",) if c in requests.columns]
    return requests.filter(rid.isNotNull() & (F.length(rid).between(1, MAX_REQUEST_ID))).select(
        "request_id", "journal", "offset", "app", "env", "minute", _date(), *parts
    )


def log_rollup(events: DataFrame, watermark: str | None = None) -> DataFrame:
    """Per minute (event time, else receive time), protocol, stream and level: count, bytes.

    Takes raw events or parsed rows (:func:`parse_events`)."""
    rows = parsed_rows(events).select(
        F.col("log_minute").alias("minute"), "protocol", "stream", "level", "bytes"
    )
    return (
        _watermarked(rows, "minute", watermark)
        .groupBy("minute", "protocol", "stream", "level")
        .agg(F.count(F.lit(1)).alias("count"), F.sum("bytes").cast("long").alias("bytes"))
        .select("minute", _date(), "protocol", "stream", "level", "count", "bytes")
    )


def telemetry_rollup(
    samples: DataFrame, window: str = "1 minute", watermark: str | None = None
) -> DataFrame:
    """Per tap, item and time window of Lager samples (the keg long table): count, min, max,
    mean and the last value (by timestamp)."""
    rows = samples.select("tap", "item", "ts", "ts_ns", "value")
    return (
        _watermarked(rows, "ts", watermark)
        .groupBy(F.window("ts", window).alias("w"), "tap", "item")
        .agg(
            F.count(F.lit(1)).alias("count"),
            F.min("value").alias("min"),
            F.max("value").alias("max"),
            F.avg("value").alias("mean"),
            F.max_by("value", "ts_ns").alias("last"),
        )
        .select(
            F.col("w.start").alias("window_start"),
            F.col("w.end").alias("window_end"),
            "tap",
            "item",
            "count",
            "min",
            "max",
            "mean",
            "last",
        )
    )


def attribute_lager_rows(events: DataFrame) -> DataFrame:
    """Lager data rows with their tap's ``key`` (docs/protocols/lager.md, "Restarted taps").

    A row journaled with its key has it as its stream. A row journaled unattributed (stream
    empty, ``attrs.unattributed``: no registration named its uuid yet) belongs to the key of
    the first ``lager-attribution`` or ``lager-registration`` record of the same journal whose
    producer is its uuid, at a higher offset; ``key`` is null while there is none. Adds
    ``key`` and ``attributed_later`` (the key came from such a link). Batch only: the link
    follows the rows it names."""
    lager = events.filter(F.col("protocol") == "lager")
    rows = lager.filter(F.col("content_type") == "lager")
    unattributed = F.coalesce(F.col("attrs")["unattributed"] == "true", F.lit(False))
    links = lager.filter(F.col("content_type").isin("lager-attribution", "lager-registration"))
    first_link = (
        rows.filter(unattributed)
        .select("journal", "offset", "producer")
        .join(
            links.select(
                F.col("journal").alias("link_journal"),
                F.col("producer").alias("link_producer"),
                F.col("offset").alias("link_offset"),
                F.col("stream").alias("link_key"),
            ),
            (F.col("journal") == F.col("link_journal"))
            & (F.col("producer") == F.col("link_producer"))
            & (F.col("link_offset") > F.col("offset")),
        )
        .groupBy("journal", "offset")
        .agg(F.min_by("link_key", "link_offset").alias("linked_key"))
    )
    return (
        rows.join(first_link, ["journal", "offset"], "left")
        .withColumn("attributed_later", unattributed & F.col("linked_key").isNotNull())
        .withColumn("key", F.when(unattributed, F.col("linked_key")).otherwise(F.col("stream")))
        .drop("linked_key")
    )
