"""The ``taproom`` data source: batch reads equal ``taproom tail``; streaming offsets, limits
and ``availableNow``; torn tails; several journals."""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from taproom.journal import Journal, read_journal_id
from taproom.records import BatchBuilder

from .generate import generate_events, write_journal

pytestmark = pytest.mark.spark

TAPROOM = str(Path(sys.executable).with_name("taproom"))


def _tail(journal: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        [TAPROOM, "tail", "--journal", str(journal)],
        check=True,
        capture_output=True,
        timeout=120,
    ).stdout
    return [json.loads(line) for line in out.splitlines()]


def _micros(value: dt.datetime) -> int:
    # collect() gives naive datetimes in the local zone, which conftest makes UTC.
    return (value - dt.datetime(1970, 1, 1)) // dt.timedelta(microseconds=1)


def _as_tail(row: Any) -> dict[str, Any]:
    """A DataFrame row in ``taproom tail``'s JSON shape (payload decoded the same way)."""
    payload = bytes(row["payload"])
    value: Any
    try:
        value = json.loads(payload) if row["content_type"] in ("json", "kv") else None
    except ValueError:
        value = None
    if value is None:
        try:
            value = payload.decode("utf-8")
        except UnicodeDecodeError:
            value = {"base64": base64.b64encode(payload).decode("ascii")}
    return {
        "offset": row["offset"],
        "received_us": _micros(row["received"]),
        "protocol": row["protocol"],
        "stream": row["stream"],
        "topic": row["topic"],
        "producer": row["producer"],
        "seq": row["seq"],
        "event_id": row["event_id"],
        "ts_us": 0 if row["ts"] is None else _micros(row["ts"]),
        "content_type": row["content_type"],
        "payload": value,
        "attrs": dict(row["attrs"]),
    }


def _from_tail(line: dict[str, Any]) -> dict[str, Any]:
    out = dict(line)
    out["received_us"] = out.pop("received_ns") // 1000
    out["ts_us"] = out.pop("ts_ns") // 1000
    return out


def _odd_journal(path: Path) -> Path:
    """Edge cases: non-UTF-8 payloads, attrs, empty fields, long and short strings, u64 seq."""
    journal = Journal(path, fsync="off", segment_bytes=4096)
    try:
        for i in range(40):
            builder = BatchBuilder(received_ns=1_700_000_000_000_000_000 + i * 1_000_123)
            builder.add("raw", bytes([0xFF, 0xFE, i]), content_type="raw", seq=(1 << 63) - 1 + i)
            builder.add(
                "lumberjack",
                json.dumps({"message": "é" * i, "n": i}).encode(),
                stream="s" * (i % 20),
                topic="t",
                producer="p" * 13,
                event_id="x" * 12,
                ts_ns=1_700_000_000_123_456_789 if i % 2 else 0,
                content_type="json",
                attrs={"host": f"h{i}", "level": "INFO"} if i % 3 == 0 else None,
            )
            journal.commit([builder.build()])
    finally:
        journal.close()
    return path


def test_batch_read_equals_taproom_tail(spark: Any, logjam_journal: Path, tmp_path: Path) -> None:
    odd = _odd_journal(tmp_path / "odd")
    for journal in (logjam_journal, odd):
        rows = (
            spark.read.format("taproom")
            .option("partitionBytes", "100000")  # several partitions: boundaries must not drop rows
            .load(str(journal))
            .orderBy("offset")
            .collect()
        )
        expected = [_from_tail(line) for line in _tail(journal)]
        assert len(expected) > 0
        got = [_as_tail(r) for r in rows]
        # seq is u64 in the journal and a signed long in Spark: compare the bit pattern.
        for g in got:
            g["seq"] &= (1 << 64) - 1
        assert got == expected
        # The journal column is the journal's identity, from the file in its directory.
        assert {r["journal"] for r in rows} == {read_journal_id(journal)}


def test_partitioning_never_splits_or_repeats(spark: Any, logjam_journal: Path) -> None:
    def offsets(partition_bytes: int) -> tuple[int, list[int]]:
        df = (
            spark.read.format("taproom")
            .option("partitionBytes", str(partition_bytes))
            .load(str(logjam_journal))
        )
        return df.rdd.getNumPartitions(), sorted(r[0] for r in df.select("offset").collect())

    n_small, small = offsets(50_000)
    n_big, big = offsets(1 << 30)
    assert n_small > 5 and n_big == 1
    assert small == big == list(range(3000))


def test_torn_tail_is_not_read(spark: Any, tmp_path: Path) -> None:
    path = write_journal(tmp_path / "j", generate_events(300, seed=3), segment_bytes=1 << 20)
    last = sorted(p for p in os.listdir(path) if p.endswith(".seg"))[-1]
    with open(path / last, "ab") as f:
        f.write(b"\x40\x00\x00\x00" + b"\x00" * 30)  # a frame header still being written
    assert spark.read.format("taproom").load(str(path)).count() == 300
    assert len(_tail(path)) == 300


def test_columns_option_prunes(spark: Any, logjam_journal: Path) -> None:
    full = spark.read.format("taproom").load(str(logjam_journal))
    pruned = (
        spark.read.format("taproom").option("columns", "payload, offset").load(str(logjam_journal))
    )
    assert pruned.columns == ["offset", "payload"]
    assert sorted(pruned.collect()) == sorted(full.select("offset", "payload").collect())
    with pytest.raises(Exception, match="unknown columns"):
        spark.read.format("taproom").option("columns", "nope").load(str(logjam_journal))


def test_missing_journal_is_an_error(spark: Any, tmp_path: Path) -> None:
    with pytest.raises(Exception, match="no journal directory here"):
        spark.read.format("taproom").load(str(tmp_path / "nope")).count()


def test_several_journals(spark: Any, tmp_path: Path) -> None:
    a = write_journal(tmp_path / "a", generate_events(200, seed=1))
    b = write_journal(tmp_path / "b", generate_events(150, seed=2))
    df = spark.read.format("taproom").option("journals", f"{a},{b}").load()
    counts = {r["journal"]: r["count"] for r in df.groupBy("journal").count().collect()}
    assert counts == {read_journal_id(a): 200, read_journal_id(b): 150}


def _append(path: Path, n: int, seed: int) -> None:
    journal = Journal(path, fsync="off", segment_bytes=256 * 1024)
    try:
        builder = BatchBuilder()
        for e in generate_events(n, seed=seed):
            builder.add(e.protocol, e.payload, stream=e.stream, topic=e.topic, seq=e.seq)
        journal.commit([builder.build()])
    finally:
        journal.close()


def test_stream_limits_available_now_and_restart(spark: Any, tmp_path: Path) -> None:
    """maxRecordsPerTrigger caps each micro-batch; availableNow stops at what was there;
    a restart from the checkpoint continues with exactly the new records."""
    journal = write_journal(tmp_path / "j", generate_events(1000, seed=5))
    out, checkpoint = tmp_path / "out", tmp_path / "ckpt"

    def run() -> Any:
        query = (
            spark.readStream.format("taproom")
            .option("maxRecordsPerTrigger", "300")
            .load(str(journal))
            .select("journal", "offset", "protocol")
            .writeStream.format("parquet")
            .option("path", str(out))
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(180)
        assert not query.isActive and query.exception() is None
        return query

    query = run()
    sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    assert sizes == [300, 300, 300, 100]
    _append(journal, 250, seed=6)
    query = run()
    sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    assert sizes == [250]
    offsets = sorted(r[0] for r in spark.read.parquet(str(out)).select("offset").collect())
    assert offsets == list(range(1250))
