"""The parsed-segment cache gives the same parsed rows as parsing, and follows its journal."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from taproom.spark.segcache import parsed_events
from taproom.spark.sources import LocalSource, Segment

from .generate import GeneratedEvent, write_journal

pytestmark = pytest.mark.spark


def journal_segments(journal: str) -> list[Segment]:
    return LocalSource(journal).segments()


def _rows(df: Any) -> list[str]:
    return sorted(repr(tuple(r)) for r in df.collect())


def _parsed(spark: Any, journal: Path, cache: Path | None) -> tuple[list[str], Any]:
    df, stats = parsed_events(spark, [str(journal)], None if cache is None else str(cache))
    return _rows(df), stats


def test_ranges_option_reads_exactly_those_offsets(spark: Any, logjam_journal: Path) -> None:
    segments = journal_segments(str(logjam_journal))
    assert len(segments) >= 3
    second, last = segments[1], segments[-1]
    ranges = {str(logjam_journal): [[second.base, second.end], [last.base, None]]}
    offsets = [
        r["offset"]
        for r in spark.read.format("taproom")
        .option("journals", str(logjam_journal))
        .option("ranges", json.dumps(ranges))
        .option("columns", "offset")
        .load()
        .collect()
    ]
    every = [
        r["offset"]
        for r in spark.read.format("taproom").load(str(logjam_journal)).select("offset").collect()
    ]
    assert second.end is not None
    want = [o for o in every if second.base <= o < second.end or o >= last.base]
    assert sorted(offsets) == want and len(offsets) < len(every)


def test_cache_equals_parsing_and_follows_the_journal(
    spark: Any, logjam_events: list[GeneratedEvent], tmp_path: Path
) -> None:
    journal = write_journal(tmp_path / "j", logjam_events[:1500], segment_bytes=96 * 1024)
    cache = tmp_path / "cache"
    sealed = sum(s.sealed for s in journal_segments(str(journal)))
    assert sealed >= 2

    parsed, stats = _parsed(spark, journal, None)
    assert len(parsed) == 1500
    first, stats = _parsed(spark, journal, cache)
    assert first == parsed
    assert (stats.built, stats.cached, stats.live) == (sealed, 0, 1)
    again, stats = _parsed(spark, journal, cache)
    assert again == parsed
    assert (stats.built, stats.cached, stats.live) == (0, sealed, 1)

    # The hub goes on writing: the old last segment is sealed now and gets its entry; the
    # entries already built are kept.
    write_journal(journal, logjam_events[1500:], segment_bytes=96 * 1024)
    now_sealed = sum(s.sealed for s in journal_segments(str(journal)))
    grown, stats = _parsed(spark, journal, cache)
    assert grown == _parsed(spark, journal, None)[0] and len(grown) == len(logjam_events)
    assert (stats.built, stats.cached) == (now_sealed - sealed, sealed)

    # Retention deletes the oldest segment: its entry goes too. A builder that died left a
    # temporary directory: it goes as well.
    oldest = journal_segments(str(journal))[0]
    os.remove(journal / f"{oldest.base:020d}.seg")
    stale = cache / ".tmp-deadbeef"
    (stale / "entry=x").mkdir(parents=True)
    trimmed, stats = _parsed(spark, journal, cache)
    assert trimmed == _parsed(spark, journal, None)[0] and len(trimmed) < len(logjam_events)
    assert (stats.removed, stats.built) == (1, 0) and not stale.exists()
    entries = [p for p in next(cache.glob("v*/*")).iterdir() if p.name != "JOURNAL"]
    assert len(entries) == now_sealed - 1
