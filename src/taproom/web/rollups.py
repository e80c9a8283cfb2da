"""The Requests page's data: the Parquet tables of ``taproom spark rollup|stream``, read with pyarrow.

Tables live under ``[console] rollups`` as ``requests/date=YYYY-MM-DD/*.parquet`` (and
``exceptions/``, ``logs/``). Reads push the date partition and the app/env filter down to
pyarrow, so a day of one app reads only that day's files and row groups. Rows are per minute and
action; this module merges them per minute (requests, percentiles, apdex, status classes,
severities, a latency heatmap) and per action (count, time, p95, share of time, the time
breakdown by resource). Percentiles of merged rows come from merging their stored
``total_time_histogram`` (spark/buckets.py), not from averaging percentiles. Called in worker
threads.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from ..spark.buckets import GAMMA, LOG_GAMMA, bucket_value
from .drilldown import split_stream as _split_stream
from .tables import TableFiles

__all__ = ["MAX_DATES", "Rollups"]

MAX_DATES = 400  # a bit over a year of daily partitions listed
CACHED_ANSWERS = 16  # day answers kept (a few KB to a few hundred KB each)
HEATMAP_ROWS_PER_DECADE = 4
HEATMAP_RANGE_MS = (0.1, 100_000.0)
# Time resources shown as the per-action breakdown: gc_time is part of the others' time, and
# total_time is the whole (logjam's "other time resources" rule); what they leave is "other".
_NOT_STACKED = {"total_time_sum", "gc_time_sum"}


class _Histograms:
    """Many rows' histograms merged per group (a minute, an action) as one dense matrix:
    groups x buckets, built with one bincount, so merging is linear in the stored entries."""

    def __init__(
        self,
        group: np.ndarray[Any, Any],
        groups: int,
        buckets: np.ndarray[Any, Any],
        counts: np.ndarray[Any, Any],
    ) -> None:
        self.low = int(buckets.min()) if len(buckets) else 0
        width = int(buckets.max()) - self.low + 1 if len(buckets) else 1
        self.matrix = np.bincount(
            group * width + (buckets - self.low), weights=counts, minlength=groups * width
        ).reshape(groups, width)

    def quantile(self, q: float) -> list[float | None]:
        """Nearest-rank q-quantile per group (the value of the bucket that holds it)."""
        cumulative = np.cumsum(self.matrix, axis=1)
        totals = cumulative[:, -1]
        first = np.argmax(cumulative >= (q * totals)[:, None], axis=1)
        return [
            round(bucket_value(int(b) + self.low), 3) if total > 0 else None
            for b, total in zip(first.tolist(), totals.tolist(), strict=True)
        ]

    def heatmap(self) -> dict[str, Any]:
        """Requests per group and latency band (HEATMAP_ROWS_PER_DECADE bands a decade)."""
        low, high = (math.log10(v) * HEATMAP_ROWS_PER_DECADE for v in HEATMAP_RANGE_MS)
        buckets = np.arange(self.matrix.shape[1]) + self.low
        # log10 of bucket_value(b), vectorised: (b ln GAMMA + ln(2 / (GAMMA + 1))) / ln 10
        log10_values = (buckets * LOG_GAMMA + math.log(2 / (GAMMA + 1))) / math.log(10)
        bands = np.clip(np.floor(log10_values * HEATMAP_ROWS_PER_DECADE), low, high - 1)
        bands = bands.astype(np.int64) - int(low)
        rows = int(high - low)
        grid = np.zeros((self.matrix.shape[0], rows))
        np.add.at(grid.T, bands, self.matrix.T)
        return {
            "bands_ms": [
                round(10 ** ((low + k) / HEATMAP_ROWS_PER_DECADE), 4) for k in range(rows)
            ],
            "counts": np.rint(grid).astype(np.int64).tolist(),
        }


class Rollups:
    """Reads the rollup tables. Answers are kept for the same files (names, sizes, mtimes) of
    a date, so a page reloaded over a finished day does not read it again."""

    def __init__(self, tables: TableFiles | str) -> None:
        self.tables = TableFiles(tables) if isinstance(tables, str) else tables
        self.directory = self.tables.directory
        self._answers: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def dates(self) -> list[str]:
        return self.tables.dates("requests")[:MAX_DATES]

    def _dataset(self, table: str, date: str) -> ds.Dataset | None:
        """The committed files of ``table`` for ``date`` (a streaming query's sink log is
        honoured, :class:`~.tables.TableFiles`)."""
        files = self.tables.files(table, date)
        if not files:
            return None
        return ds.dataset(files, format="parquet")

    def apps(self, date: str) -> dict[str, Any]:
        """The dates with data, and the app-env streams of ``date`` (default: the latest)."""
        dates = self.dates()
        date = date or (dates[0] if dates else "")
        dataset = self._dataset("requests", date) if date in dates else None
        streams: list[dict[str, Any]] = []
        if dataset is not None:
            table = dataset.to_table(columns=["app", "env", "count"])
            grouped = table.group_by(["app", "env"]).aggregate([("count", "sum")])
            for row in grouped.to_pylist():
                stream = f"{row['app']}-{row['env']}" if row["env"] else row["app"]
                streams.append({"stream": stream, "requests": row["count_sum"]})
            streams.sort(key=lambda s: -s["requests"])
        return {"directory": self.directory, "dates": dates, "date": date, "streams": streams}

    def day(self, stream: str, date: str, max_actions: int) -> dict[str, Any]:
        """One app-env's day: per-minute series, heatmap, actions and their time breakdown."""
        key = (stream, date, max_actions, self.tables.fingerprint("requests", date))
        with self._lock:  # worker threads share the cache
            answer = self._answers.get(key)
            if answer is not None:
                self._answers.move_to_end(key)
                return answer
        answer = self._day(stream, date, max_actions)
        with self._lock:
            self._answers[key] = answer
            while len(self._answers) > CACHED_ANSWERS:
                self._answers.popitem(last=False)
        return answer

    def _day(self, stream: str, date: str, max_actions: int) -> dict[str, Any]:
        app, env = _split_stream(stream)
        result: dict[str, Any] = {"stream": stream, "date": date, "minutes": [], "actions": []}
        dataset = self._dataset("requests", date)
        if dataset is None:
            return result
        names = set(dataset.schema.names)
        resources = sorted(n for n in names if n.endswith("_time_sum") and n not in _NOT_STACKED)
        severities = sorted(n for n in names if n.startswith("severity_"))
        wanted = [
            "minute", "action", "count", "total_time_sum", "apdex_satisfied",
            "apdex_tolerating", "status_4xx", "status_5xx", "exceptions", *severities,
            *resources,
        ]  # fmt: skip
        has_histogram = "total_time_histogram" in names
        if has_histogram:
            wanted.append("total_time_histogram")
        where = (pc.field("app") == app) & (pc.field("env") == env)
        table = dataset.to_table(columns=[c for c in wanted if c in names], filter=where)
        if table.num_rows == 0:
            return result
        minute_ms = pc.cast(table.column("minute"), pa.timestamp("ms")).cast(pa.int64())
        minutes, minute_of_row = np.unique(minute_ms.to_numpy(), return_inverse=True)
        encoded = pc.dictionary_encode(table.column("action")).combine_chunks()
        actions = encoded.dictionary.to_pylist()
        action_of_row = encoded.indices.to_numpy().astype(np.int64)

        def per(group: np.ndarray[Any, Any], size: int, column: str) -> np.ndarray[Any, Any]:
            values = table.column(column).to_numpy(zero_copy_only=False).astype(float)
            return np.bincount(group, weights=values, minlength=size)

        count = per(minute_of_row, len(minutes), "count")
        safe = np.where(count > 0, count, 1)
        apdex = (
            per(minute_of_row, len(minutes), "apdex_satisfied")
            + per(minute_of_row, len(minutes), "apdex_tolerating") / 2
        ) / safe
        result.update(
            minutes=(minutes // 1000).tolist(),
            requests=count.tolist(),
            apdex=np.round(apdex, 4).tolist(),
            status_4xx=per(minute_of_row, len(minutes), "status_4xx").tolist(),
            status_5xx=per(minute_of_row, len(minutes), "status_5xx").tolist(),
            exceptions=per(minute_of_row, len(minutes), "exceptions").tolist(),
            severities={
                s.removeprefix("severity_"): per(minute_of_row, len(minutes), s).tolist()
                for s in severities
            },
        )
        action_count = per(action_of_row, len(actions), "count")
        action_time = per(action_of_row, len(actions), "total_time_sum")
        action_p95: list[float | None] = [None] * len(actions)
        if has_histogram:
            histogram = table.column("total_time_histogram").combine_chunks()
            parents = pc.list_parent_indices(histogram).to_numpy()
            flat = pc.list_flatten(histogram)
            buckets = flat.field("b").to_numpy().astype(np.int64)
            counts = flat.field("n").to_numpy().astype(float)
            by_minute = _Histograms(minute_of_row[parents], len(minutes), buckets, counts)
            result.update(
                p50=by_minute.quantile(0.5),
                p95=by_minute.quantile(0.95),
                p99=by_minute.quantile(0.99),
                heatmap=by_minute.heatmap(),
            )
            by_action = _Histograms(action_of_row[parents], len(actions), buckets, counts)
            action_p95 = by_action.quantile(0.95)
        total_time = float(action_time.sum()) or 1.0
        stacks = {r: per(action_of_row, len(actions), r) for r in resources}
        order = np.argsort(-action_time)[:max_actions]
        rows = []
        for i in order.tolist():
            breakdown = {r.removesuffix("_sum"): round(float(stacks[r][i]), 3) for r in resources}
            breakdown["other_time"] = round(
                max(0.0, float(action_time[i]) - sum(breakdown.values())), 3
            )
            rows.append(
                {
                    "action": str(actions[i]),
                    "count": int(action_count[i]),
                    "time_sum": round(float(action_time[i]), 3),
                    "mean": round(float(action_time[i] / max(action_count[i], 1)), 3),
                    "p95": action_p95[i],
                    "share": round(float(action_time[i]) / total_time, 4),
                    "breakdown": breakdown,
                }
            )
        result["actions"] = rows
        result["action_count"] = len(actions)
        return result
