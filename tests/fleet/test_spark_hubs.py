"""The ``taproom`` Spark source reading hubs over the network, on the local session.

Hubs are real ``taproom serve`` processes. Reading them gives exactly the rows reading their
journal directories gives (damage included); the rollup over hubs equals the rollup over
directories and caches remote sealed segments; a stream over hubs reports its commits to the
hubs' cursors, fails naming a hub that is down and resumes from its checkpoint, exactly once;
a batch damaged on the wire fails the task naming journal and offset and never becomes rows.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from taproom.journal.remote import HubJournal
from taproom.spark.jobs.rollup import TABLES, run_rollup
from taproom.spark.sources import LocalSource, SourceSpec
from tests.spark.generate import generate_events, write_damaged_journal, write_journal
from tests.support import HubProcess, free_port, write_config

from .feed import LOGJAM, logjam_requests, send_logjam_events
from .proxy import FaultyProxy

pytestmark = pytest.mark.spark


def _hub(root: Path, name: str, **sections: Any) -> HubProcess:
    """A hub whose web listener keeps its port across restarts (readers know it by address)."""
    work = root / name
    work.mkdir(parents=True, exist_ok=True)
    sections.setdefault("web", {"port": free_port()})
    return HubProcess(write_config(work, journal_dir=root / f"{name}-journal", **sections))


@pytest.fixture(scope="module")
def hubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[HubProcess]]:
    """Three hubs over written journals: two of logjam requests, one with damage."""
    root = tmp_path_factory.mktemp("hubs")
    write_journal(root / "a-journal", generate_events(1500, seed=31))
    write_journal(root / "b-journal", generate_events(900, seed=32))
    write_damaged_journal(root / "c-journal")
    running = [_hub(root, name).start() for name in "abc"]
    try:
        yield running
    finally:
        for hub in running:
            hub.kill()


def _dirs(hubs: list[HubProcess]) -> list[str]:
    return [str(h.config_path.parent.parent / f"{h.config_path.parent.name}-journal") for h in hubs]


def _addresses(hubs: list[HubProcess]) -> str:
    return ",".join(h.addresses["web"] for h in hubs)


def _sorted_rows(df: Any) -> list[tuple[Any, ...]]:
    return sorted((tuple(r) for r in df.collect()), key=lambda row: tuple(map(_order, row)))


def _order(value: Any) -> tuple[Any, ...]:
    """A sort key for one column: the drill-down tables hold nulls and structs, which do not
    compare with <; numbers, strings and times keep their own order."""
    if value is None:
        return (0,)
    if isinstance(value, int | float):
        return (1, value)
    if isinstance(value, str):
        return (2, value)
    if isinstance(value, datetime.date):
        return (3, value)
    return (4, repr(value))


def test_reading_hubs_equals_reading_their_directories(spark: Any, hubs: list[HubProcess]) -> None:
    over_network = (
        spark.read.format("taproom")
        .option("hubs", _addresses(hubs))
        .option("partitionBytes", "200000")  # many partitions: offset ranges must tile
        .load()
    )
    local = spark.read.format("taproom").option("journals", ",".join(_dirs(hubs))).load()
    assert over_network.rdd.getNumPartitions() > 6
    rows = _sorted_rows(over_network)
    assert rows == _sorted_rows(local) and len(rows) > 2400
    assert {r[0] for r in rows} == {h.journal_id for h in hubs}
    # ranges by hub address and by journal id read exactly those offsets
    a, b = hubs[0], hubs[1]
    ranged = (
        spark.read.format("taproom")
        .option("hubs", _addresses(hubs))
        .option("ranges", f'{{"{a.addresses["web"]}": [[100, 250]], "{b.journal_id}": [[0, 5]]}}')
        .option("columns", "journal,offset")
        .load()
    )
    assert _sorted_rows(ranged) == sorted(
        [(a.journal_id, o) for o in range(100, 250)] + [(b.journal_id, o) for o in range(5)]
    )


def test_a_journal_named_twice_is_refused(spark: Any, hubs: list[HubProcess]) -> None:
    with pytest.raises(Exception, match="same journal"):
        spark.read.format("taproom").option("hubs", hubs[0].addresses["web"]).option(
            "journals", _dirs(hubs)[0]
        ).load().count()


def test_rollup_over_hubs_equals_directories_and_caches_remote_segments(
    spark: Any, hubs: list[HubProcess], tmp_path: Path
) -> None:
    two = hubs[:2]
    remote = SourceSpec(hubs=tuple(h.addresses["web"] for h in two))
    sealed = sum(s.sealed for d in _dirs(two) for s in LocalSource(d).segments())
    first = run_rollup(spark, remote, str(tmp_path / "net"), progress=False)
    assert (first.built, first.live, first.cached) == (sealed, 2, 0) and sealed >= 2
    again = run_rollup(spark, remote, str(tmp_path / "net"), progress=False)
    assert (again.built, again.cached) == (0, first.built)  # sealed ranges parsed once
    run_rollup(spark, _dirs(two), str(tmp_path / "local"), progress=False)
    for table in TABLES:
        net = _sorted_rows(spark.read.parquet(str(tmp_path / "net" / table)))
        local = _sorted_rows(spark.read.parquet(str(tmp_path / "local" / table)))
        assert net == local and net, table


def test_a_batch_damaged_on_the_wire_fails_the_task_and_is_read_again(
    spark: Any, hubs: list[HubProcess]
) -> None:
    hub = hubs[0]
    expected = _sorted_rows(
        spark.read.format("taproom").option("hubs", hub.addresses["web"]).load()
    )
    with FaultyProxy(hub.addresses["web"], flip_at=30_000) as proxy:
        df = spark.read.format("taproom").option("hubs", proxy.address).load()
        with pytest.raises(Exception) as failed:
            df.collect()
        assert proxy.faults == 1
        message = str(failed.value)
        assert "CorruptTransfer" in message and hub.journal_id in message
        assert "offset" in message
        # Reading again (what a task retry does) fetches clean data: no row was made of it.
        assert _sorted_rows(df) == expected


def _stream(spark: Any, hubs: str, out: Path, checkpoint: Path, **options: str) -> Any:
    reader = spark.readStream.format("taproom").option("hubs", hubs)
    for key, value in options.items():
        reader = reader.option(key, value)
    return (
        reader.load()
        .select("journal", "offset")
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )


def test_stream_over_hubs_reports_cursors_and_survives_a_hub_down(
    spark: Any, tmp_path: Path
) -> None:
    events = logjam_requests(900, seed=41)
    running = [_hub(tmp_path, name, **LOGJAM).start() for name in "xy"]
    try:
        for hub, part in zip(running, (events[:300], events[300:500]), strict=True):
            send_logjam_events(hub.addresses["logjam_router"], part)
        addresses = _addresses(running)
        out, ckpt = tmp_path / "out", tmp_path / "ckpt"
        query = _stream(spark, addresses, out, ckpt, maxRecordsPerTrigger="150", cursor="t")
        query.awaitTermination(240)
        assert query.exception() is None
        sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
        assert sizes == [150, 150, 150, 50]  # an equal share each, the rest to the one with more
        # Spark acknowledges a micro-batch to its source when it plans the next one: the
        # cursors hold the end of the last batch but one (within one batch of the end).
        for hub, end in zip(running, (300, 200), strict=True):
            [cursor] = HubJournal(hub.addresses["web"]).cursors()["cursors"]
            assert cursor["name"] == "t" and end - 150 <= cursor["offset"] <= end, cursor

        # One hub goes down: the next run fails naming it, and writes nothing.
        send_logjam_events(running[0].addresses["logjam_router"], events[500:])
        down = running[1]
        down.kill()
        query = _stream(spark, addresses, out, ckpt)
        with pytest.raises(Exception, match="hub unavailable"):
            query.awaitTermination(240)
        message = str(query.exception())
        assert "hub unavailable" in message and down.addresses["web"] in message

        # It is back (same address): the run resumes from the checkpoint, exactly once.
        down.start()
        send_logjam_events(down.addresses["logjam_router"], events[:50])
        query = _stream(spark, addresses, out, ckpt)
        query.awaitTermination(240)
        assert query.exception() is None
        got = sorted(tuple(r) for r in spark.read.parquet(str(out)).collect())
        want = sorted(
            [(running[0].journal_id, o) for o in range(300 + len(events) - 500)]
            + [(down.journal_id, o) for o in range(250)]
        )
        assert got == want
    finally:
        for hub in running:
            hub.kill()


def test_a_hub_that_is_down_is_named(spark: Any, tmp_path: Path) -> None:
    hub = _hub(tmp_path, "gone").start()
    address = hub.addresses["web"]
    hub.kill()
    started = time.monotonic()
    with pytest.raises(Exception, match=f"hub unavailable: {address}"):
        spark.read.format("taproom").option("hubs", address).load().count()
    assert time.monotonic() - started < 120
