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

A batch job with a parsed-segment cache writes ``request_samples`` a part per journal segment
(:meth:`~.tables.TableFiles.parts`): each part's rows are those of its requests alone, so a
group (minute, action, ...) whose requests fall in several parts has each part's slowest and
failed ones. :func:`merge_parts` makes them the group's: the ``slow`` slowest of the union are
among each part's slowest, the first ``failed`` failed ones among each part's first, and the
group's ``failed_count`` is its parts' added up. Each part is read once, in the order of its
first minute (Parquet statistics of ``minute``): rows of minutes no other part's range covers
are whole and go by a batch at a time as before; rows of shared minutes (with one journal, those
at a segment's boundary; with several, most) are held until every part that can hold them has
been read, then merged. What is held is bounded by the parts that overlap in time, not by the
day. A part without statistics makes the whole selection one merge.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from ..spark.settings import SparkSettings
from .tables import TableFiles, relisted

__all__ = ["Drilldown", "merge_parts", "split_stream"]

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
# Rows of a group, with app, env and the date (transforms._DIMENSIONS); the readers select one
# app, env and date, the merge keys on every one present.
GROUP_KEYS = ("date", "app", "env", "minute", "action", "module", "frontend")
# What the merge orders and counts by.
MERGE_COLUMNS = (
    *GROUP_KEYS, "total_time", "journal", "offset", "started", "slow", "failed", "failed_count",
)  # fmt: skip
_MINUTE_US = 60_000_000
_NULL_ORDER = np.iinfo(np.int64).min  # a null journal or offset orders first (as in Spark)


@dataclass(frozen=True)
class _Failed:
    """The rows the Errors page reads: failed requests (of one status code if given). A
    filter on rows, not groups: applied after a group's rows are merged, pushed down to the
    scan where they need no merge."""

    status: int | None = None

    def expression(self) -> Any:
        where = pc.field("failed")
        return where if self.status is None else where & (pc.field("code") == self.status)

    def mask(self, table: pa.Table) -> Any:
        # A compute kernel on the columns: a table filtered by an expression costs an Acero
        # plan (milliseconds) a call.
        where = table.column("failed").fill_null(False)
        if self.status is not None:
            where = pc.and_(where, pc.equal(table.column("code"), self.status).fill_null(False))
        return where


def split_stream(stream: str) -> tuple[str, str]:
    """app-env as the rollup splits it: the env is what follows the last dash."""
    app, dash, env = stream.rpartition("-")
    return (app, env) if dash and app else (stream, "")


def _ms(column: pa.ChunkedArray) -> list[int | None]:
    # Cut to the millisecond: a start parsed with microseconds would fail a safe cast.
    return pc.cast(pc.cast(column, pa.timestamp("ms"), safe=False), pa.int64()).to_pylist()


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

    def __init__(self, tables: TableFiles, spark: SparkSettings | None = None) -> None:
        self.tables = tables
        spark = spark if spark is not None else SparkSettings()
        # The bounds the rollup kept per group: the merge keeps as many over a group's parts.
        self.slow = spark.slow_requests_per_action
        self.failed = spark.failed_requests_per_action
        self._answers: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._bounds = (self.slow, self.failed)
        self.merges = 0  # merges of rows read (tests look at it)

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

    def _samples(
        self,
        date: str,
        groups: Any,
        rows: _Failed | None,
        columns: list[str],
        minute_us: int | None = None,
    ) -> Iterator[pa.Table]:
        """``request_samples``' rows of ``date`` in the groups ``groups`` selects (a filter on
        app, env, minute, action: whole groups) that ``rows`` then selects (None: all), a
        table at a time, each group's rows merged over its parts. ``minute_us``: the one
        minute ``groups`` selects, if so (only the parts that can hold it are read)."""
        parts = self.tables.parts(SAMPLES, date)
        if len(parts) <= 1:  # a flat table, or one part: its rows are whole
            both = groups if rows is None else groups & rows.expression()
            for batch in self._batches(SAMPLES, date, both, columns):
                yield pa.Table.from_batches([batch])
            return
        ranges = {name: self.tables.minute_range(files) for name, files in parts.items()}
        if minute_us is not None:
            ranges = {
                name: span
                for name, span in ranges.items()
                if span is None or span[0] <= minute_us <= span[1]
            }
        # Parts by their first minute: after those before part k are read, no part left holds
        # a minute before part k's first, so the held rows of those minutes are whole. A part
        # whose minutes are unknown may hold any: then every row is held to the end.
        known = {name: span for name, span in ranges.items() if span is not None}
        if len(known) == len(ranges):
            order = sorted((span[0], name) for name, span in known.items() if span[0] <= span[1])
            names = [name for _, name in order]
            starts: list[int] | None = [start for start, _ in order]
            windows = _shared([known[name] for name in names])
            edges = np.asarray([edge for window in windows for edge in window], dtype=np.int64)
        else:
            names, starts, edges, windows = sorted(ranges), None, None, []
        paths = [path for name in names for path in parts[name]]
        if not paths:
            return
        # The bounds the parts were written with (their markers), else the [spark] section's.
        bounds = self.tables.part_bounds(SAMPLES, names) or self._bounds
        part_of = {path: k for k, name in enumerate(names) for path in parts[name]}
        # One dataset: one schema for every part (the first file's, the others' columns cast
        # to it, null where absent), files read ahead; its batches come in the files' order.
        dataset = ds.dataset(paths, format="parquet")
        present = set(dataset.schema.names)
        wanted = [c for c in dict.fromkeys([*columns, *MERGE_COLUMNS]) if c in present]
        # The row filter goes down to the scan for the rows of unshared minutes (those of
        # shared minutes are all needed: the merge ranks a group's rows whatever they are).
        where = groups
        if rows is not None and edges is not None:
            pushed = rows.expression()
            where = groups & (pushed | _within(windows)) if windows else groups & pushed
        scanner = dataset.scanner(columns=wanted, filter=where, batch_size=SCAN_BATCH_ROWS)
        held: list[pa.Table] = []
        tags: list[np.ndarray] = []
        current = 0
        for tagged in scanner.scan_batches():
            k = part_of[tagged.fragment.path]
            if k < current:  # not in the files' order after all: hold every shared row to the end
                starts = None
            elif k > current:
                current = k
                if starts is not None and held:
                    whole, held, tags = self._whole(held, tags, starts[k], bounds)
                    if whole is not None:
                        yield from _selected(whole, rows, columns)
            table = pa.Table.from_batches([tagged.record_batch])
            if not table.num_rows:
                continue
            if edges is None:
                shared = np.ones(table.num_rows, dtype=bool)
            else:
                minute = pc.cast(table.column("minute"), pa.int64()).to_numpy()
                # In a shared window [lo, hi) iff an odd number of edges are at or below it.
                shared = np.searchsorted(edges, minute, side="right") % 2 == 1
            if shared.all():
                held.append(table)
                tags.append(np.full(table.num_rows, k))
                continue
            if shared.any():
                held.append(table.filter(pa.array(shared)))
                tags.append(np.full(int(shared.sum()), k))
                table = table.filter(pa.array(~shared))
            yield from _selected(table, None if where is not groups else rows, columns)
        if held:
            whole, _, _ = self._whole(held, tags, None, bounds)
            if whole is not None:
                yield from _selected(whole, rows, columns)

    def _whole(
        self,
        held: list[pa.Table],
        tags: list[np.ndarray],
        before: int | None,
        bounds: tuple[int, int],
    ) -> tuple[pa.Table | None, list[pa.Table], list[np.ndarray]]:
        """The held rows of minutes before ``before`` (None: all) merged to ``bounds``, and
        those left."""
        table, tag = pa.concat_tables(held), np.concatenate(tags)
        if before is None:
            whole = np.ones(table.num_rows, dtype=bool)
        else:
            whole = pc.cast(table.column("minute"), pa.int64()).to_numpy() < before
        if not whole.any():
            return None, held, tags
        self.merges += 1
        if whole.all():
            return merge_parts(table, tag, *bounds), [], []
        mask = pa.array(whole)
        merged = merge_parts(table.filter(mask), tag[whole], *bounds)
        return merged, [table.filter(pc.invert(mask))], [tag[~whole]]

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

    @relisted
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
        minute_us = None if minute_ms is None else minute_ms * 1000
        read = list(self._samples(date, where, None, columns, minute_us))
        table = pa.concat_tables(read) if read else pa.table({})
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
        slow = table.filter(pc.field("slow")).sort_by(
            [("total_time", "descending"), ("journal", "descending"), ("offset", "descending")]
        )
        failed = table.filter(pc.field("failed")).sort_by(
            [("started", "ascending"), ("journal", "ascending"), ("offset", "ascending")]
        )
        result["slow"] = _rows(slow.slice(0, limit))
        result["failed"] = _rows(failed.slice(0, limit))
        result["failed_kept"] = failed.num_rows
        result["failed_count"] = _failed_total(table)
        return result

    @relisted
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
        day = (pc.field("app") == app) & (pc.field("env") == env)
        result: dict[str, Any] = {
            "stream": stream,
            "date": date,
            **self._cached(
                ("facets", stream, date), SAMPLES, date, lambda: self._facets(date, day)
            ),
        }
        groups = day
        if action:
            groups &= pc.field("action") == action
        rows = _Failed(status)
        # The newest `limit` of the matching rows, kept while the batches go by.
        newest: pa.Table | None = None
        matched = 0
        for chosen in self._samples(date, groups, rows, list(ROW_COLUMNS)):
            if exception and chosen.num_rows:
                chosen = chosen.filter(_raised(chosen.column("exceptions"), exception))
            matched += chosen.num_rows
            if chosen.num_rows:
                merged = chosen if newest is None else pa.concat_tables([newest, chosen])
                newest = merged.sort_by(
                    [("started", "descending"), ("journal", "descending"), ("offset", "descending")]
                ).slice(0, limit)
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
        # Each group's failed_count once (every row of a group carries it): per batch a row
        # per group, in Arrow; what is held is bounded by the day's groups, not its rows.
        keys = columns[:4]
        groups: list[pa.Table] = []
        held = 0
        kept = 0
        for batch in self._samples(date, day, _Failed(), columns):
            kept += batch.num_rows
            for counter, values in (
                (actions, batch.column("action")),
                (statuses, batch.column("code")),
                (exceptions, pc.list_flatten(batch.column("exceptions"))),
            ):
                for pair in pc.value_counts(values).to_pylist():
                    counter[pair["values"]] += pair["counts"]
            present = [k for k in keys if k in batch.column_names]
            groups.append(_per_group(batch.select([*present, "failed_count"]), present))
            held += groups[-1].num_rows
            if held > 4 * SCAN_BATCH_ROWS:
                groups = [_per_group(pa.concat_tables(groups), present)]
                held = groups[0].num_rows
        failed_count = 0
        if groups:
            whole = _per_group(pa.concat_tables(groups), present)
            failed_count = int(pc.sum(whole.column("failed_count")).as_py() or 0)
        return {
            "failed_count": failed_count,
            "failed_kept": kept,
            "facets": {
                "actions": _top(list(actions.items())),
                "statuses": sorted(statuses.items())[:FACETS],
                "exceptions": _top(list(exceptions.items())),
            },
        }

    @relisted
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


def _per_group(table: pa.Table, keys: list[str]) -> pa.Table:
    """A row per group of ``keys`` with its ``failed_count`` (the same on each of its rows)."""
    grouped = table.group_by(keys, use_threads=False).aggregate([("failed_count", "max")])
    return grouped.rename_columns([*keys, "failed_count"])


def _failed_total(table: pa.Table) -> int:
    """Failed requests of the groups (minute, action, ...) present in ``table``: each group's
    rows carry its ``failed_count``, so it is counted once per group."""
    keys = ["minute", "action", "module", "frontend"]
    present = [k for k in keys if k in table.column_names]
    grouped = table.group_by(present).aggregate([("failed_count", "max")])
    return int(pc.sum(grouped.column("failed_count_max")).as_py() or 0)


def merge_parts(table: pa.Table, parts: np.ndarray, slow: int, failed: int) -> pa.Table:
    """``request_samples`` rows of several parts (``parts[i]``: row i's part) as the rollup
    would have written them for the union of the parts' requests: per group
    (:data:`GROUP_KEYS`), ``slow`` is true for the ``slow`` greatest by (total_time, journal,
    offset) of the rows a part kept as slow; a failed row is kept among the first ``failed``
    by (started, journal, offset); a row is kept iff either; ``failed_count`` is the sum of
    the group's parts' counts. Exact: the union's slowest are among its parts' slowest, its
    first failed among its parts' first. A group of one part is left as it was."""
    n = table.num_rows
    if n == 0:
        return table
    group = _group_ids(table)
    journal = _order_codes(table.column("journal"))
    offset = table.column("offset").fill_null(_NULL_ORDER).to_numpy().astype(np.int64)
    total = table.column("total_time").to_numpy(zero_copy_only=False).astype(np.float64)
    started = pc.cast(table.column("started"), pa.int64()).to_numpy().astype(np.int64)
    was_slow = table.column("slow").fill_null(False).to_numpy(zero_copy_only=False)
    is_failed = table.column("failed").fill_null(False).to_numpy(zero_copy_only=False)

    now_slow = np.zeros(n, dtype=bool)
    chosen = np.flatnonzero(was_slow)
    if chosen.size:
        # Ascending (NaN last, as Spark orders it greatest), ranked from each group's end.
        order = chosen[np.lexsort((offset[chosen], journal[chosen], total[chosen], group[chosen]))]
        ranked = group[order]
        from_end = np.searchsorted(ranked, ranked, side="right") - 1 - np.arange(order.size)
        now_slow[order] = from_end < slow
    kept_failed = np.zeros(n, dtype=bool)
    chosen = np.flatnonzero(is_failed)
    if chosen.size:
        order = chosen[
            np.lexsort((offset[chosen], journal[chosen], started[chosen], group[chosen]))
        ]
        ranked = group[order]
        rank = np.arange(order.size) - np.searchsorted(ranked, ranked, side="left")
        kept_failed[order] = rank < failed

    # Every row of a (group, part) carries that part's count for the group: one each, added.
    counts = table.column("failed_count").fill_null(0).to_numpy().astype(np.int64)
    parts = np.asarray(parts, dtype=np.int64)
    pair = group * (int(parts.max()) + 1) + parts
    _, first = np.unique(pair, return_index=True)
    summed = np.zeros(int(group.max()) + 1, dtype=np.int64)
    np.add.at(summed, group[first], counts[first])

    keep = now_slow | kept_failed
    merged = table.set_column(
        table.schema.get_field_index("slow"), table.schema.field("slow"), pa.array(now_slow)
    )
    merged = merged.set_column(
        merged.schema.get_field_index("failed_count"),
        merged.schema.field("failed_count"),
        pa.array(summed[group], type=merged.schema.field("failed_count").type),
    )
    return merged.filter(pa.array(keep))


def _group_ids(table: pa.Table) -> np.ndarray:
    """A number per row (0, 1, ...), the same for the rows of a group (:data:`GROUP_KEYS`
    present): each key's values numbered, the numbers combined into one (mixed radix)."""
    combined = np.zeros(table.num_rows, dtype=np.int64)
    size = 1
    for name in GROUP_KEYS:
        if name not in table.column_names:
            continue
        column = table.column(name).combine_chunks()
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            encoded = pc.dictionary_encode(column)
            codes = encoded.indices.fill_null(-1).to_numpy().astype(np.int64) + 1
            count = len(encoded.dictionary) + 1
        else:
            if pa.types.is_timestamp(column.type):
                column = pc.cast(column, pa.int64())
            values = pc.cast(column, pa.int64()).fill_null(_NULL_ORDER).to_numpy()
            _, inverse = np.unique(values, return_inverse=True)
            codes = np.asarray(inverse, dtype=np.int64).reshape(-1)
            count = int(codes.max()) + 1 if codes.size else 1
        if size * count >= 1 << 62:  # never for a day's keys; keep the numbers small
            _, inverse = np.unique(combined, return_inverse=True)
            combined = np.asarray(inverse, dtype=np.int64).reshape(-1)
            size = int(combined.max()) + 1 if combined.size else 1
        combined = combined * count + codes
        size *= count
    _, inverse = np.unique(combined, return_inverse=True)
    return np.asarray(inverse, dtype=np.int64).reshape(-1)


def _order_codes(column: pa.ChunkedArray) -> np.ndarray:
    """Strings as numbers in the same order (byte order, as Spark compares them); null first."""
    encoded = pc.dictionary_encode(column.combine_chunks())
    rank = np.empty(len(encoded.dictionary), dtype=np.int64)
    rank[pc.sort_indices(encoded.dictionary).to_numpy()] = np.arange(len(encoded.dictionary))
    indices = encoded.indices.fill_null(-1).to_numpy().astype(np.int64)
    return np.where(indices < 0, _NULL_ORDER, rank[np.maximum(indices, 0)])


def _shared(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The minutes (half-open windows of epoch microseconds, in order) that two parts or more
    may hold, from each part's ``minute`` range (inclusive)."""
    edges: list[tuple[int, int]] = []
    for lo, hi in ranges:
        edges += [(lo, 1), (hi + _MINUTE_US, -1)]
    edges.sort()
    windows: list[tuple[int, int]] = []
    depth = 0
    start = 0
    for at, step in edges:
        if depth >= 2 > depth + step and at > start:
            windows.append((start, at))
        elif depth < 2 <= depth + step:
            start = at
        depth += step
    return windows


def _within(windows: list[tuple[int, int]]) -> Any:
    """A filter: the minute is in one of ``windows``."""
    minute = pc.field("minute")
    where = None
    for lo, hi in windows:
        inside = (minute >= pa.scalar(lo, pa.timestamp("us", "UTC"))) & (
            minute < pa.scalar(hi, pa.timestamp("us", "UTC"))
        )
        where = inside if where is None else where | inside
    return where


def _selected(table: pa.Table, rows: _Failed | None, columns: list[str]) -> Iterator[pa.Table]:
    if rows is not None:
        table = table.filter(rows.mask(table))
    if table.num_rows:
        yield table.select([c for c in columns if c in table.column_names])
