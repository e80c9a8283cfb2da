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
  approximate percentiles (``percentile_approx`` with accuracy :data:`PERCENTILE_ACCURACY`:
  the returned value's rank is within ``count / PERCENTILE_ACCURACY`` of the exact rank).

Streaming jobs pass ``watermark`` (e.g. ``"10 minutes"``): rows of a minute are emitted once
the watermark passes it, and later events for that minute are dropped, as Spark documents.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from .schemas import LOGJAM_REQUEST_SCHEMA

__all__ = [
    "BACKEND_APDEX_MS",
    "DEFAULT_ACTION",
    "FRONTEND_APDEX_MS",
    "PERCENTILE_ACCURACY",
    "SEVERITY_NAMES",
    "exception_rollup",
    "log_rollup",
    "logjam_requests",
    "request_rollup",
    "telemetry_rollup",
]

BACKEND_APDEX_MS = (100.0, 500.0, 2000.0)
FRONTEND_APDEX_MS = (500.0, 2000.0, 8000.0)
DEFAULT_ACTION = "Unknown#unknown_method"
DEFAULT_CODE = 500
DEFAULT_TOTAL_TIME = 1.0
DEFAULT_SEVERITY = 1
PERCENTILE_ACCURACY = 10_000
# Logger severities as logjam numbers them (Ruby Logger: DEBUG 0 .. FATAL 4, UNKNOWN 5).
SEVERITY_NAMES = ("debug", "info", "warn", "error", "fatal", "unknown")
_DIMENSIONS = ("minute", "app", "env", "action", "module", "frontend")


def _is_request_topic(topic: Column) -> Column:
    # logs.* carry request documents, frontend.page / frontend.ajax the browser's timings;
    # javascript.* and events.* are not requests (logjam-consumer seed, topic grammar).
    return topic.startswith("logs.") | topic.startswith("frontend.")


def logjam_requests(events: DataFrame) -> DataFrame:
    """One typed row per logjam request event, with the importer's defaults applied.

    Columns: journal, offset, received, stream, topic, app, env, frontend, started, minute,
    date, action, module, code, total_time, severity, exceptions (array of names).
    """
    requests = events.filter((F.col("protocol") == "logjam") & _is_request_topic(F.col("topic")))
    r = F.from_json(F.col("payload").cast("string"), LOGJAM_REQUEST_SCHEMA)
    parsed = requests.select("journal", "offset", "received", "ts", "stream", "topic", r.alias("r"))
    line_max = F.expr("array_max(transform(r.lines, l -> try_cast(try_element_at(l, 1) AS INT)))")
    action = F.when(
        F.col("r.action").isNull() | (F.col("r.action") == ""), F.lit(DEFAULT_ACTION)
    ).otherwise(F.col("r.action"))
    started = F.coalesce(
        F.try_to_timestamp(F.col("r.started_at")),
        F.timestamp_millis(F.col("r.started_ms")),
        F.col("ts"),
        F.col("received"),
    )
    app_env = F.regexp_extract(F.col("stream"), r"^(.+)-([^-]+)$", 1)
    out = parsed.select(
        "journal",
        "offset",
        "received",
        "stream",
        "topic",
        F.when(app_env == "", F.col("stream")).otherwise(app_env).alias("app"),
        F.regexp_extract(F.col("stream"), r"^(.+)-([^-]+)$", 2).alias("env"),
        F.col("topic").startswith("frontend.").alias("frontend"),
        started.alias("started"),
        action.alias("action"),
        F.coalesce(F.col("r.code"), F.lit(DEFAULT_CODE)).alias("code"),
        F.coalesce(F.col("r.total_time"), F.lit(DEFAULT_TOTAL_TIME)).alias("total_time"),
        F.coalesce(F.col("r.severity"), line_max.cast("long"), F.lit(DEFAULT_SEVERITY)).alias(
            "severity"
        ),
        F.coalesce(F.col("r.exceptions"), F.array().cast("array<string>")).alias("exceptions"),
    )
    module = F.regexp_extract(F.col("action"), r"^([^:#]+)::", 1)
    return out.select(
        "*",
        F.date_trunc("minute", F.col("started")).alias("minute"),
        F.when(module == "", F.lit("Others"))
        .otherwise(F.concat(F.lit("::"), module))
        .alias("module"),
    ).withColumn("date", F.date_format(F.col("minute"), "yyyy-MM-dd"))


def _watermarked(df: DataFrame, column: str, watermark: str | None) -> DataFrame:
    return df.withWatermark(column, watermark) if watermark else df


def _count_if(condition: Column) -> Column:
    return F.count_if(condition).cast("long")


def request_rollup(requests: DataFrame, watermark: str | None = None) -> DataFrame:
    """Per minute, app, env, action, module (and backend/frontend): the logjam figures."""
    t = F.col("total_time")
    frontend = F.col("frontend")
    happy_ms = F.when(frontend, F.lit(FRONTEND_APDEX_MS[0])).otherwise(BACKEND_APDEX_MS[0])
    satisfied_ms = F.when(frontend, F.lit(FRONTEND_APDEX_MS[1])).otherwise(BACKEND_APDEX_MS[1])
    tolerating_ms = F.when(frontend, F.lit(FRONTEND_APDEX_MS[2])).otherwise(BACKEND_APDEX_MS[2])
    status = F.floor(F.col("code") / 100)
    severity = F.col("severity")
    grouped = _watermarked(requests, "minute", watermark).groupBy(*_DIMENSIONS, "date")
    agg = grouped.agg(
        F.count(F.lit(1)).alias("count"),
        F.sum(t).alias("total_time_sum"),
        F.max(t).alias("total_time_max"),
        F.percentile_approx(t, [0.5, 0.9, 0.95, 0.99], PERCENTILE_ACCURACY).alias("_p"),
        _count_if(t < happy_ms).alias("apdex_happy"),
        _count_if(t < satisfied_ms).alias("apdex_satisfied"),
        _count_if((t >= satisfied_ms) & (t < tolerating_ms)).alias("apdex_tolerating"),
        _count_if(t >= tolerating_ms).alias("apdex_frustrated"),
        *[_count_if(status == k).alias(f"status_{k}xx") for k in range(1, 6)],
        _count_if((status < 1) | (status > 5)).alias("status_other"),
        *[
            _count_if(severity == k).alias(f"severity_{name}")
            for k, name in enumerate(SEVERITY_NAMES[:5])
        ],
        _count_if((severity < 0) | (severity > 4)).alias("severity_unknown"),
        F.sum(F.size("exceptions")).cast("long").alias("exceptions"),
        _count_if(F.size("exceptions") > 0).alias("requests_with_exceptions"),
    )
    return agg.select(
        *_DIMENSIONS,
        "date",
        "count",
        "total_time_sum",
        "total_time_max",
        *[F.col("_p")[i].alias(name) for i, name in enumerate(("p50", "p90", "p95", "p99"))],
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
    ).withColumnsRenamed({name: f"total_time_{name}" for name in ("p50", "p90", "p95", "p99")})


def exception_rollup(requests: DataFrame, watermark: str | None = None) -> DataFrame:
    """Per minute, app, env, action, module and exception class: how many were raised."""
    exploded = requests.select(*_DIMENSIONS, "date", F.explode("exceptions").alias("exception"))
    return (
        _watermarked(exploded, "minute", watermark)
        .groupBy(*_DIMENSIONS, "date", "exception")
        .agg(F.count(F.lit(1)).alias("count"))
    )


def _level(events_payload: Column) -> Column:
    """A log level name from attrs, or from a JSON payload's level / severity field."""
    # One parse for both fields (two get_json_object calls would parse every payload twice).
    # A non-string JSON value comes back as its text, so logjam's severity 3 reads "3".
    fields = F.from_json(events_payload.cast("string"), "level STRING, severity STRING")
    json_level = F.when(
        F.col("content_type").isin("json", "kv"),
        F.coalesce(fields["level"], fields["severity"]),
    )
    raw = F.lower(F.coalesce(F.col("attrs")["level"], json_level, F.lit("unknown")))
    names = F.create_map(
        *[x for k, n in enumerate(SEVERITY_NAMES) for x in (F.lit(str(k)), F.lit(n))]
    )
    return F.coalesce(names[raw], raw)


def log_rollup(events: DataFrame, watermark: str | None = None) -> DataFrame:
    """Per minute (event time, else receive time), protocol, stream and level: count, bytes."""
    rows = events.select(
        F.date_trunc("minute", F.coalesce(F.col("ts"), F.col("received"))).alias("minute"),
        "protocol",
        "stream",
        _level(F.col("payload")).alias("level"),
        F.length("payload").cast("long").alias("bytes"),
    ).withColumn("date", F.date_format(F.col("minute"), "yyyy-MM-dd"))
    return (
        _watermarked(rows, "minute", watermark)
        .groupBy("minute", "date", "protocol", "stream", "level")
        .agg(F.count(F.lit(1)).alias("count"), F.sum("bytes").cast("long").alias("bytes"))
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
