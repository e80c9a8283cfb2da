"""The live tail's rows are charged to the budget's console_tail holder (issue 26)."""

from __future__ import annotations

from taproom.budget import Holder
from taproom.records import BatchBuilder, decode_batch
from taproom.web.tail import TailClient, TailFilter, event_json, row_bytes


def records(n: int, size: int) -> list:
    builder = BatchBuilder()
    for i in range(n):
        builder.add("test", str(i).encode().ljust(size, b"x"), stream="s", topic="t")
    return decode_batch(builder.build().body, 0)


def test_rows_past_the_tail_share_are_skipped_counted_and_freed() -> None:
    recs = records(50, 2000)
    one = row_bytes(event_json(recs[0]))
    holder = Holder("console_tail", 10 * one)
    page = TailClient(TailFilter(), maxlen=1000, holder=holder)
    other = TailClient(TailFilter(), maxlen=1000, holder=holder)
    page.offer(recs[:8], {})
    other.offer(recs[:8], {})  # shares the rows, but each page's queue is charged
    assert len(page.queue) == 8 and len(other.queue) == 2 and other.skipped == 6
    assert holder.used <= holder.bound and holder.peak <= holder.bound
    rows, skipped = other.take(100)
    assert len(rows) == 2 and skipped == 6
    assert holder.used == 8 * one
    page.close()
    assert holder.used == 0 and not page.queue
