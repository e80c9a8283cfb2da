"""The drill-down's data: from a minute or an action to the requests behind it.

Reads the tables ``taproom spark rollup|stream`` write for it (docs/spark.md) with pyarrow:

* ``request_samples``: per minute and action the slowest requests and the failed ones (status
  >= 500, severity >= error or an exception; at most ``[spark] failed_requests_per_action`` a
  minute and action, ``failed_count`` counting all of them), each row a request's key fields
  and where it is stored (``journal``, ``offset``);
* ``exceptions``: per minute, action and exception class a count and the first few requests.

Every read pushes the date partition and app/env (and minute, action where given) down to
pyarrow, so a page reads one day of one app. Only committed files are read
(:class:`~.tables.TableFiles`). Answers are bounded by the caller's ``limit``. Called in worker
threads.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from .tables import TableFiles

__all__ = ["Drilldown", "split_stream"]

SAMPLES = "request_samples"
EXCEPTIONS = "exceptions"
# Columns of a drill-down row the pages show (a request's key fields and where it lives).
ROW_COLUMNS = (
    "minute", "action", "request_id", "started", "code", "total_time", "severity",
    "exceptions", "host", "times", "journal", "offset", "slow", "failed",
)  # fmt: skip
SCAN_BATCH_ROWS = 65_536  # rows a streaming read holds at once (a few MB)
FACETS = 200  # actions, statuses and exception classes listed as filters of the Errors page
SERIES = 10  # exception classes drawn per minute on the Exceptions page
CACHED_ANSWERS = 32


def split_stream(stream: str) -> tuple[str, str]:
    """app-env as the rollup splits it: the env is what follows the last dash."""
    app, dash, env = stream.rpartition("-")
    return (app, env) if dash and app else (stream, "")


def _ms(column: pa.ChunkedArray) -> list[int | None]:
    return pc.cast(pc.cast(column, pa.timestamp("ms")), pa.int64()).to_pylist()


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    """Table rows as JSON-ready dicts: times in epoch milliseconds, ``times`` without nulls."""
    rows = table.select([c for c in ROW_COLUMNS if c in table.column_names])
    out = rows.drop_columns([c for c in ("minute", "started") if c in rows.column_names])
    listed = out.to_pylist()
    for name in ("minute", "started"):
        if name in rows.column_names:
            for row, value in zip(listed, _ms(rows.column(name)), strict=True):
                row[name] = value
    for row in listed:
        times = row.get("times") or {}
        row["times"] = {k: v for k, v in times.items() if v is not None}
    return listed


class Drilldown:
    """Reads ``request_samples`` and ``exceptions`` under ``[console] rollups``."""

    def __init__(self, tables: TableFiles) -> None:
        self.tables = tables
        self._answers: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def _read(self, table: str, date: str, where: Any, columns: list[str] | None) -> pa.Table:
        files = self.tables.files(table, date)
        if not files:
            return pa.table({})
        dataset = ds.dataset(files, format="parquet")
        names = set(dataset.schema.names)
        wanted = [c for c in columns if c in names] if columns is not None else None
        return dataset.to_table(columns=wanted, filter=where)

    def _batches(self, table: str, date: str, where: Any, columns: list[str]) -> Iterator[Any]:
        """The rows of ``_read`` a record batch at a time: a day's failed requests can be
        many (up to failed_requests_per_action a minute and action), so the Errors page
        counts and picks from them without holding them all."""
        files = self.tables.files(table, date)
        if not files:
            return
        dataset = ds.dataset(files, format="parquet")
        names = set(dataset.schema.names)
        scanner = dataset.scanner(
            columns=[c for c in columns if c in names], filter=where, batch_size=SCAN_BATCH_ROWS
        )
        yield from scanner.to_batches()

    def _cached(self, key: tuple[Any, ...], table: str, date: str, build: Any) -> dict[str, Any]:
        """``build()``, kept while the table's files for ``date`` stay the same."""
        key = (*key, self.tables.fingerprint(table, date))
        with self._lock:
            answer = self._answers.get(key)
            if answer is not None:
                self._answers.move_to_end(key)
                return answer
        answer = build()
        with self._lock:
            self._answers[key] = answer
            while len(self._answers) > CACHED_ANSWERS:
                self._answers.popitem(last=False)
        return answer

    def samples(
        self, stream: str, date: str, minute_ms: int | None, action: str, limit: int
    ) -> dict[str, Any]:
        """The slow and failed requests of one minute and/or action of ``stream``'s ``date``:
        ``slow`` slowest first, ``failed`` by start time; each
        list at most ``limit`` long. ``failed_count``: every failed request of the selection,
        ``failed_kept``: how many of those the table kept."""
        app, env = split_stream(stream)
        where = (pc.field("app") == app) & (pc.field("env") == env)
        if minute_ms is not None:
            where &= pc.field("minute") == pa.scalar(minute_ms * 1000, pa.timestamp("us", "UTC"))
        if action:
            where &= pc.field("action") == action
        columns = [*ROW_COLUMNS, "failed_count", "module", "frontend"]
        table = self._read(SAMPLES, date, where, columns)
        result: dict[str, Any] = {
            "stream": stream,
            "date": date,
            "minute": minute_ms,
            "action": action,
            "slow": [],
            "failed": [],
            "failed_count": 0,
            "failed_kept": 0,
        }
        if table.num_rows == 0:
            return result
        slow = table.filter(pc.field("slow")).sort_by([("total_time", "descending")])
        failed = table.filter(pc.field("failed")).sort_by([("started", "ascending")])
        result["slow"] = _rows(slow.slice(0, limit))
        result["failed"] = _rows(failed.slice(0, limit))
        result["failed_kept"] = failed.num_rows
        result["failed_count"] = _failed_total(table)
        return result

    def errors(
        self,
        stream: str,
        date: str,
        *,
        action: str,
        status: int | None,
        exception: str,
        limit: int,
    ) -> dict[str, Any]:
        """The failed requests of ``stream``'s ``date``, newest first, filtered by action,
        status code and exception class; with the day's facets (actions, statuses, exception
        classes and how many failed requests each has among those kept) and the overflow."""
        app, env = split_stream(stream)
        day = (pc.field("app") == app) & (pc.field("env") == env) & pc.field("failed")
        result: dict[str, Any] = {
            "stream": stream,
            "date": date,
            **self._cached(
                ("facets", stream, date), SAMPLES, date, lambda: self._facets(date, day)
            ),
        }
        where = day
        if action:
            where &= pc.field("action") == action
        if status is not None:
            where &= pc.field("code") == status
        # The newest `limit` of the matching rows, kept while the batches go by.
        newest: pa.Table | None = None
        matched = 0
        for batch in self._batches(SAMPLES, date, where, list(ROW_COLUMNS)):
            chosen = pa.Table.from_batches([batch])
            if exception and chosen.num_rows:
                chosen = chosen.filter(_raised(chosen.column("exceptions"), exception))
            matched += chosen.num_rows
            if chosen.num_rows:
                merged = chosen if newest is None else pa.concat_tables([newest, chosen])
                newest = merged.sort_by([("started", "descending")]).slice(0, limit)
        result["matched"] = matched
        result["requests"] = _rows(newest) if newest is not None else []
        return result

    def _facets(self, date: str, day: Any) -> dict[str, Any]:
        """How many failed requests the day had and kept, and the Errors page's filters: the
        actions, statuses and exception classes of those kept, each with its count."""
        columns = ["minute", "action", "module", "frontend", "code", "exceptions", "failed_count"]
        actions: Counter[str] = Counter()
        statuses: Counter[int] = Counter()
        exceptions: Counter[str] = Counter()
        groups: dict[tuple[Any, ...], int] = {}  # (minute, action, ...) -> its failed_count
        kept = 0
        for batch in self._batches(SAMPLES, date, day, columns):
            kept += batch.num_rows
            for counter, values in (
                (actions, batch.column("action")),
                (statuses, batch.column("code")),
                (exceptions, pc.list_flatten(batch.column("exceptions"))),
            ):
                for pair in pc.value_counts(values).to_pylist():
                    counter[pair["values"]] += pair["counts"]
            keys = zip(*(batch.column(k).to_pylist() for k in columns[:4]), strict=True)
            for key, count in zip(keys, batch.column("failed_count").to_pylist(), strict=True):
                groups[key] = count  # every row of a group carries the same count
        return {
            "failed_count": sum(groups.values()),
            "failed_kept": kept,
            "facets": {
                "actions": _top(list(actions.items())),
                "statuses": sorted(statuses.items())[:FACETS],
                "exceptions": _top(list(exceptions.items())),
            },
        }

    def exceptions(self, stream: str, date: str, limit: int) -> dict[str, Any]:
        """Exception classes of ``stream``'s ``date`` by count: per class the count, its
        actions, sample requests (``request_id``, ``journal``, ``offset``) and, for the
        :data:`SERIES` most frequent, a count per minute (``minutes``: the day's minutes that
        had any)."""
        app, env = split_stream(stream)
        where = (pc.field("app") == app) & (pc.field("env") == env)
        return self._cached(
            ("exceptions", stream, date, limit),
            EXCEPTIONS,
            date,
            lambda: self._exceptions(stream, date, where, limit),
        )

    def _exceptions(self, stream: str, date: str, where: Any, limit: int) -> dict[str, Any]:
        columns = ["minute", "action", "exception", "count", "samples"]
        table = self._read(EXCEPTIONS, date, where, columns)
        result: dict[str, Any] = {"stream": stream, "date": date, "minutes": [], "classes": []}
        if table.num_rows == 0:
            return result
        minute_ms = np.asarray(_ms(table.column("minute")), dtype=np.int64)
        minutes, minute_of_row = np.unique(minute_ms, return_inverse=True)
        encoded = pc.dictionary_encode(table.column("exception")).combine_chunks()
        names = encoded.dictionary.to_pylist()
        class_of_row = encoded.indices.to_numpy().astype(np.int64)
        counts = table.column("count").to_numpy().astype(np.int64)
        totals = np.bincount(class_of_row, weights=counts, minlength=len(names))
        order = np.argsort(-totals, kind="stable")[:limit]
        actions = table.column("action").to_pylist()
        samples = table.column("samples").to_pylist()
        per_class_actions: dict[int, Counter[str]] = {}
        per_class_samples: dict[int, list[dict[str, Any]]] = {}
        wanted = set(order.tolist())
        # Samples of the class's earliest minutes first: rows ordered by minute.
        for row in np.argsort(minute_of_row, kind="stable").tolist():
            k = int(class_of_row[row])
            if k not in wanted:
                continue
            per_class_actions.setdefault(k, Counter())[actions[row]] += int(counts[row])
            kept = per_class_samples.setdefault(k, [])
            for ref in samples[row] or []:
                if len(kept) < 10 and ref not in kept:
                    kept.append(ref)
        grid = np.zeros((len(names), len(minutes)), dtype=np.int64)
        np.add.at(grid, (class_of_row, minute_of_row), counts)
        classes = []
        for rank, k in enumerate(order.tolist()):
            entry: dict[str, Any] = {
                "exception": names[k],
                "count": int(totals[k]),
                "actions": per_class_actions.get(k, Counter()).most_common(10),
                "samples": per_class_samples.get(k, []),
            }
            if rank < SERIES:
                entry["series"] = grid[k].tolist()
            classes.append(entry)
        result["minutes"] = (minutes // 1000).tolist()
        result["classes"] = classes
        result["class_count"] = len(names)
        return result


def _raised(exceptions: pa.ChunkedArray | pa.Array, name: str) -> pa.Array:
    """True for the rows whose exception classes include ``name``."""
    lists = exceptions.combine_chunks() if isinstance(exceptions, pa.ChunkedArray) else exceptions
    has = pc.equal(pc.list_flatten(lists), name).fill_null(False).to_numpy(zero_copy_only=False)
    hit = np.zeros(len(lists), dtype=bool)
    hit[pc.list_parent_indices(lists).to_numpy()[has]] = True
    return pa.array(hit)


def _top(pairs: list[tuple[Any, int]]) -> list[tuple[Any, int]]:
    """The FACETS most frequent values, most frequent first (ties by value)."""
    return sorted(pairs, key=lambda p: (-p[1], str(p[0])))[:FACETS]


def _failed_total(table: pa.Table) -> int:
    """Failed requests of the groups (minute, action, ...) present in ``table``: each group's
    rows carry its ``failed_count``, so it is counted once per group."""
    keys = ["minute", "action", "module", "frontend"]
    present = [k for k in keys if k in table.column_names]
    grouped = table.group_by(present).aggregate([("failed_count", "max")])
    return int(pc.sum(grouped.column("failed_count_max")).as_py() or 0)
