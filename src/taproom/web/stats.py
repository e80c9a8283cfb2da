"""The Overview's per-second history: a bounded ring of samples read from the metrics registry.

Once a second, on the event loop and off the ingest path, :class:`StatsRing` reads the hub's
Prometheus registry (counters become per-second rates, gauges are kept as they are) plus the
hub's outputs, and appends one row. The ring holds ``[console] stats_seconds`` rows (15 min by
default); every series name comes from a bounded label set (protocol, listener, reason, output),
so a row has a bounded number of values.

Series names: ``events_in/<protocol>`` (events/s), ``bytes_in/<protocol>`` (bytes/s of the
journal records a protocol handed in), ``journal_bytes_in`` (bytes/s appended to the journal),
``connections/<listener>``, ``rejects/<protocol>/<reason>`` (per second), ``journal_end_offset``,
``journal_size_bytes``, ``journal_segments``, ``commit_p50_ms`` and ``commit_p99_ms`` (of the
commits in that second, to the histogram bucket's upper bound), ``pending_bytes``,
``queue/<output>`` (batches), ``lag/<output>`` (events behind the journal end),
``dropped/<output>`` (per second), ``web_connections``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..hub import Hub

__all__ = ["StatsRing"]

_RATES = {
    "taproom_ingest_accepted_events": ("events_in", ("protocol",)),
    "taproom_ingest_accepted_bytes": ("bytes_in", ("protocol",)),
    "taproom_journal_appended_bytes": ("journal_bytes_in", ()),
    "taproom_ingest_rejected_items": ("rejects", ("protocol", "reason")),
    "taproom_hub_output_dropped_events": ("dropped", ("output",)),
}
_GAUGES = {
    "taproom_ingest_open_connections_count": ("connections", ("listener",)),
    "taproom_journal_next_offset": ("journal_end_offset", ()),
    "taproom_journal_size_bytes": ("journal_size_bytes", ()),
    "taproom_journal_segments_count": ("journal_segments", ()),
    "taproom_hub_pending_bytes": ("pending_bytes", ()),
    "taproom_hub_output_queue_batches": ("queue", ("output",)),
}
_LATENCY = "taproom_hub_commit_latency_seconds"
_READ = frozenset((*_RATES, *_GAUGES, _LATENCY))  # the metrics a sample reads, by name


def _name(prefix: str, labels: tuple[str, ...], values: dict[str, str]) -> str:
    return "/".join((prefix, *(values.get(label, "") for label in labels)))


def _quantile_ms(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The upper bound (ms) of the bucket holding the q-quantile of a cumulative histogram."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    target = q * buckets[-1][1]
    for bound, cumulative in buckets:
        if cumulative >= target:
            return round(bound * 1000, 3) if bound != float("inf") else None
    return None


class StatsRing:
    """Per-second samples of the hub's figures, the last ``seconds`` of them."""

    def __init__(self, hub: Hub, seconds: int, extra: Callable[[], dict[str, float]]) -> None:
        self.hub = hub
        self.extra = extra
        self.times: deque[float] = deque(maxlen=seconds)
        self.rows: deque[dict[str, float | None]] = deque(maxlen=seconds)
        self._totals: dict[str, float] = {}
        self._latency: dict[float, float] = {}
        self._last_at: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._guard = hub.supervisor.guard("web.stats", output="console_stats")

    def start(self) -> None:
        self.sample()  # the first sample sets the baselines for rates
        # Supervised (taproom.supervise): restarted if it dies, shown on /ready.
        self._task = self.hub.supervisor.spawn("web.stats", self._run)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            # After a stall, start again from now rather than sample a burst to catch up
            # (samples a few milliseconds apart would turn counters into noisy rates).
            next_at = max(next_at + 1.0, loop.time())
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            try:
                self.sample()
            except Exception as exc:  # a bug: this second has no sample, the next one will
                self._guard.failed(exc, "stats sample")

    def sample(self) -> dict[str, float | None]:
        """Read the registry once and append a row (also called by tests)."""
        now = time.time()
        elapsed = None if self._last_at is None else max(now - self._last_at, 1e-3)
        row: dict[str, float | None] = {}
        totals: dict[str, float] = {}
        latency: dict[float, float] = {}
        for metric in self.hub.metrics.collect(_READ):
            for sample in metric.samples:
                name = sample.name
                if name.endswith("_total") and name[:-6] in _RATES:
                    prefix, labels = _RATES[name[:-6]]
                    totals[_name(prefix, labels, sample.labels)] = sample.value
                elif name in _GAUGES:
                    prefix, labels = _GAUGES[name]
                    row[_name(prefix, labels, sample.labels)] = sample.value
                elif name == f"{_LATENCY}_bucket":
                    latency[float(sample.labels["le"])] = sample.value
        for key, total in totals.items():
            before = self._totals.get(key, 0.0 if self._last_at is not None else total)
            row[key] = None if elapsed is None else round((total - before) / elapsed, 3)
        deltas = sorted(
            (bound, value - self._latency.get(bound, 0.0)) for bound, value in latency.items()
        )
        row["commit_p50_ms"] = _quantile_ms(deltas, 0.5)
        row["commit_p99_ms"] = _quantile_ms(deltas, 0.99)
        end = self.hub.journal.end_offset
        for sub in self.hub.outputs():
            row[f"lag/{sub.name}"] = max(0, end - sub.next_offset)
        row.update(self.extra())
        self._totals, self._latency, self._last_at = totals, latency, now
        self.times.append(round(now, 3))
        self.rows.append(row)
        return row

    def series(self, seconds: int) -> dict[str, Any]:
        """The last ``seconds`` rows, column by column (absent values are null)."""
        rows = list(self.rows)[-seconds:]
        times = list(self.times)[-seconds:]
        names = sorted({name for row in rows for name in row})
        return {"t": times, "series": {n: [row.get(n) for row in rows] for n in names}}

    def latest(self) -> dict[str, float | None]:
        return dict(self.rows[-1]) if self.rows else {}
