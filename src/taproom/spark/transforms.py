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

Streaming jobs pass ``watermark`` (e.g. ``"10 minutes"``): rows of a minute are emitted once
the watermark passes it, and later events for that minute are dropped, as Spark documents.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from ..eventtime import MAX_MS, MAX_NS, MIN_MS, MIN_NS
from .buckets import GAMMA, LOG_GAMMA, PERCENTILE_FLOOR_MS, PERCENTILE_RELATIVE_ERROR
from .schemas import EVENT_PAYLOAD_SCHEMA, LOGJAM_RESOURCES, PARSED_EVENT_SCHEMA

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
    "parse_events",
    "parsed_rows",
    "request_rollup",
    "telemetry_rollup",
]

BACKEND_APDEX_MS = (100.0, 500.0, 2000.0)
FRONTEND_APDEX_MS = (500.0, 2000.0, 8000.0)
DEFAULT_ACTION = "Unknown#unknown_method"
DEFAULT_CODE = 500
DEFAULT_TOTAL_TIME = 1.0
DEFAULT_SEVERITY = 1
# Percentiles come from a histogram of total_time with logarithmic buckets (spark/buckets.py,
# as DDSketch does): each reported percentile is within PERCENTILE_RELATIVE_ERROR of the exact
# value (nearest rank), for values of at least PERCENTILE_FLOOR_MS; smaller values (and zero or
# negative ones) share the lowest bucket and are reported within PERCENTILE_FLOOR_MS.
_GAMMA = GAMMA
_LOG_GAMMA = LOG_GAMMA
_QUANTILES = (0.5, 0.9, 0.95, 0.99)
_QUANTILE_NAMES = ("p50", "p90", "p95", "p99")
# Logger severities as logjam numbers them (Ruby Logger: DEBUG 0 .. FATAL 4, UNKNOWN 5).
SEVERITY_NAMES = ("debug", "info", "warn", "error", "fatal", "unknown")
_DIMENSIONS = ("minute", "app", "env", "action", "module", "frontend")


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
    request fields together. Passes ``journal`` and ``offset`` through when present. Request
    columns are null for events that are not requests (``is_request`` false).
    """
    keep = [c for c in ("journal", "offset") if c in events.columns]  # passed through
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
        *keep,
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
    )
    module = F.regexp_extract(F.col("action"), r"^([^:#]+)::", 1)
    return out.select(
        *keep,
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
    )


def parsed_rows(df: DataFrame) -> DataFrame:
    """``df`` as parsed rows: events are parsed, parsed rows (e.g. from the cache) pass."""
    return df if "is_request" in df.columns else parse_events(df)


def logjam_requests(events: DataFrame) -> DataFrame:
    """One typed row per logjam request event, with the importer's defaults applied.

    Takes raw events or parsed rows (:func:`parse_events`). Columns: journal and offset (when
    the input has them), stream, topic, app, env, frontend, started, minute, date, action,
    module, code, total_time, severity, exceptions (array of names), resources (struct of the
    numeric resources, :data:`~taproom.spark.schemas.LOGJAM_RESOURCES`; null where absent).
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


def exception_rollup(requests: DataFrame, watermark: str | None = None) -> DataFrame:
    """Per minute, app, env, action, module and exception class: how many were raised."""
    exploded = requests.select(*_DIMENSIONS, F.explode("exceptions").alias("exception"))
    return (
        _watermarked(exploded, "minute", watermark)
        .groupBy(*_DIMENSIONS, "exception")
        .agg(F.count(F.lit(1)).alias("count"))
        .select(*_DIMENSIONS, _date(), "exception", "count")
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
