"""The live tail: committed events streamed to console pages, lossy and bounded.

One shared, lossy hub subscription (output ``console_tail``) runs while at least one page
watches; each page has its own filters and a bounded queue. Nothing here can slow ingest:

* the hub drops batches for the subscription when its queue is full (counted by the hub);
* at most ``[console] tail_events_per_s`` committed events per second are decoded, for all
  pages together (the front of a batch, when a batch is larger than what is left); the rest
  are skipped without being looked at;
* each decoded event becomes one tail row, shared by every page that shows it;
* a page whose queue is full misses events, and so does one whose row would pass the rows'
  share of the process budget (``console_tail``, ``[console] tail_bytes``: each queued row is
  charged to it, per page, until the page takes it).

Every skip is counted per page and sent to it (``"skipped": n``), so the page can say so.
A page may ask to start at an earlier offset: that backlog is read from the journal in a worker
thread, bounded by the page's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Any

from ..budget import Holder
from ..hub import Hub
from ..records import Record, iter_batch, shown
from ..supervise import Guard

__all__ = ["TailClient", "TailFilter", "TailHub", "event_json"]

OUTPUT_NAME = "console_tail"
PREVIEW_CHARS = 300  # a table row shows the start of a payload; the record view shows it all
# What a queued row costs besides its text: the dict and its ten values (CPython, measured ~1 KB).
_ROW_OVERHEAD = 1024


def row_bytes(row: dict[str, Any]) -> int:
    """What one tail row is charged to the budget (an estimate from its strings)."""
    return _ROW_OVERHEAD + sum(len(row[k]) for k in ("preview", "stream", "topic", "producer"))


@dataclass(frozen=True, slots=True)
class TailFilter:
    """What a page wants: exact protocol, exact stream, topic prefix, payload substring."""

    protocol: str = ""
    stream: str = ""
    topic: str = ""
    text: bytes = b""

    def matches(self, record: Record) -> bool:
        return (
            (not self.protocol or record.protocol == self.protocol)
            and (not self.stream or record.stream == self.stream)
            and (not self.topic or record.topic.startswith(self.topic))
            and (not self.text or self.text in record.payload)
        )


def event_json(record: Record) -> dict[str, Any]:
    """A tail row: the record's fields and the start of its payload as text."""
    return {
        "offset": record.offset,
        "received_ms": record.received_ns // 1_000_000,
        "protocol": record.protocol,
        "stream": shown(record.stream),
        "topic": shown(record.topic),
        "producer": shown(record.producer),
        "ts_ms": record.ts_ns // 1_000_000 if record.ts_ns else None,
        "content_type": record.content_type,
        "size": len(record.payload),
        "preview": record.payload[: PREVIEW_CHARS * 4].decode("utf-8", "replace")[:PREVIEW_CHARS],
    }


class TailClient:
    """One page's filter, queue (of ready tail rows) and skip count."""

    def __init__(self, tail_filter: TailFilter, maxlen: int, holder: Holder | None = None) -> None:
        self.filter = tail_filter
        self.maxlen = maxlen
        self.holder = holder  # the budget's console_tail: every queued row is charged to it
        self.queued_bytes = 0
        self.queue: deque[dict[str, Any]] = deque()
        self.skipped = 0
        self.after = -1  # offsets at or below this were sent (backlog and live may overlap)
        self.wakeup = asyncio.Event()

    def offer(
        self, records: list[Record], rows: dict[int, dict[str, Any]], guard: Guard | None = None
    ) -> None:
        """Queue the matching ``records``; ``rows`` caches their tail rows across pages, so
        each record is turned into a row once however many pages show it. A record whose row
        cannot be made (a bug) is counted by ``guard`` and shown to the page as skipped."""
        for record in records:
            if record.offset <= self.after or not self.filter.matches(record):
                continue
            if len(self.queue) >= self.maxlen:
                self.skipped += 1
                continue
            row = rows.get(record.offset)
            if row is None:
                try:
                    row = rows[record.offset] = event_json(record)
                except Exception as exc:
                    if guard is None:
                        raise
                    guard.failed(exc, "event for the live tail")
                    self.skipped += 1
                    continue
            if self.holder is not None:
                size = row_bytes(row)
                if not self.holder.try_reserve(size):
                    self.skipped += 1  # over the tail's share of the budget: missed, counted
                    continue
                self.queued_bytes += size
            self.queue.append(row)
        if self.queue or self.skipped:
            self.wakeup.set()

    def _release(self, size: int) -> None:
        if self.holder is not None and size:
            self.holder.release(size)
            self.queued_bytes -= size

    def close(self) -> None:
        """The page is gone: what it had queued is free."""
        self.queue.clear()
        self._release(self.queued_bytes)

    def skip(self, count: int) -> None:
        self.skipped += count
        self.wakeup.set()

    def take(self, limit: int) -> tuple[list[dict[str, Any]], int]:
        rows = [self.queue.popleft() for _ in range(min(limit, len(self.queue)))]
        if rows:
            self.after = max(self.after, rows[-1]["offset"])
            self._release(sum(row_bytes(row) for row in rows))
        skipped, self.skipped = self.skipped, 0
        if not self.queue:
            self.wakeup.clear()
        return rows, skipped


class TailHub:
    """The shared subscription and the pages that watch it."""

    def __init__(self, hub: Hub, events_per_s: int, max_clients: int) -> None:
        self.hub = hub
        self.events_per_s = events_per_s
        self.max_clients = max_clients
        self.clients: set[TailClient] = set()
        self._task: asyncio.Task[None] | None = None
        self._guard = hub.supervisor.guard("web.tail", output=OUTPUT_NAME)
        self._m_skipped = hub.metrics.counter(
            "web",
            "tail_skipped",
            "events",
            "Live-tail events not shown to a page, by reason",
            ("reason",),
        )

    @property
    def full(self) -> bool:
        return len(self.clients) >= self.max_clients

    def add(self, client: TailClient) -> None:
        self.clients.add(client)
        if self._task is None or self._task.done():
            # Supervised (taproom.supervise): restarted if it dies, shown on /ready.
            self._task = self.hub.supervisor.spawn("web.tail", self._run)

    def remove(self, client: TailClient) -> None:
        self.clients.discard(client)
        client.close()
        if not self.clients and self._task is not None:
            self._task.cancel()
            self._task = None

    async def stop(self) -> None:
        self.clients.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def backlog(self, client: TailClient, from_offset: int) -> None:
        """Queue committed events from ``from_offset`` (bounded by the page's queue)."""
        journal = self.hub.journal
        limit = client.maxlen
        scan_limit = self.events_per_s  # a page's filter may match little: bound the scan too

        def read() -> tuple[list[Record], int]:
            found: list[Record] = []
            scanned = 0
            for record in journal.read(max(from_offset, journal.first_offset)):
                scanned += 1
                if client.filter.matches(record):
                    found.append(record)
                if len(found) >= limit or scanned >= scan_limit:
                    break
            return found, scanned

        found, _ = await asyncio.to_thread(read)
        client.offer(found, {})

    async def _run(self) -> None:
        sub = self.hub.subscribe(OUTPUT_NAME, lossy=True, maxsize=256)
        expected = sub.next_offset
        window_start = time.monotonic()
        budget = self.events_per_s
        try:
            async for batch in sub:
                if batch.base_offset > expected:  # the hub dropped batches for us
                    self._skip_all(batch.base_offset - expected, "hub_queue_full")
                expected = batch.end_offset
                now = time.monotonic()
                if now - window_start >= 1.0:
                    window_start, budget = now, self.events_per_s
                # Decode only the front of a batch that exceeds what is left of the budget.
                take = min(batch.count, budget)
                budget -= take
                if take < batch.count:
                    self._skip_all(batch.count - take, "decode_budget")
                if take:
                    try:
                        records = list(islice(iter_batch(batch.body, batch.base_offset), take))
                    except Exception as exc:  # a bug: the pages miss this batch, not the next
                        self._guard.failed(exc, "committed batch", take)
                        continue
                    self._fan_out(records)
        finally:
            sub.close()

    def _fan_out(self, records: list[Record]) -> None:
        rows: dict[int, dict[str, Any]] = {}
        for client in list(self.clients):
            before = client.skipped
            try:
                client.offer(records, rows, self._guard)
            except Exception as exc:  # one page's failure costs that page these events only
                self._guard.failed(exc, "events for a page", len(records))
                continue
            if client.skipped > before:
                self._m_skipped.labels(reason="page_queue_full").inc(client.skipped - before)

    def _skip_all(self, count: int, reason: str) -> None:
        self._m_skipped.labels(reason=reason).inc(count * len(self.clients))
        for client in list(self.clients):
            client.skip(count)
