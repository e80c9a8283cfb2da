"""A real fleet on one machine: three hubs fed by logjam agents, a Spark standalone cluster
(a master and two workers, each a JVM, executors with their own Python workers), and the
taproom jobs sent to it with ``spark-submit --master spark://...`` reading the hubs over the
network.

* The streaming rollup survives SIGKILL of one hub mid-run (its micro-batch fails naming the
  hub, the query restarts from its checkpoint once the hub is back) and SIGKILL of the driver
  (a new driver resumes from the checkpoint): its rows equal the local batch job's over the
  same journals, exactly once, and each hub's cursor holds the stream's committed offsets.
* The batch rollup on the cluster equals the local batch job over the journal directories.

`make test` runs one round of each fault; `make soak` several, with more events.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from taproom.journal.remote import HubJournal
from taproom.spark.jobs.rollup import TABLES, run_rollup
from tests.spark.generate import BASE_NS, GeneratedEvent
from tests.support import SOAK, HubProcess, free_port, fuzz_examples, write_config

from .cluster import SparkCluster, kill_tree
from .feed import LOGJAM, logjam_requests, send_logjam_events

# A dozen JVMs and Pythons on a shared 2-core machine: minutes under load, past the suite's
# per-test timeout (the waits inside have deadlines of their own).
pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900)]

HUBS = 3
STREAM_TABLES = ("requests", "logs")
# Longer than the events' span (15 minutes): while one hub is down the others run ahead, and
# no event may arrive behind the watermark (Spark would drop it, and rightly).
WATERMARK_MIN = 20
# Cores an application takes: one executor on each of the two workers (the master spreads
# an application's executors over the workers).
APP_CORES = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    # Started now, waited for later: the JVMs start while the hubs are fed. Two cores a worker
    # (each application takes one on each): the batch rollup runs beside the stream, as
    # applications share a real cluster's workers.
    with SparkCluster(tmp_path_factory.mktemp("cluster"), cores=APP_CORES) as running:
        yield running


def _hubs(root: Path) -> list[HubProcess]:
    hubs = []
    for i in range(HUBS):
        work = root / f"hub{i}"
        work.mkdir()
        config = write_config(
            work,
            **LOGJAM,
            journal_dir=root / f"journal{i}",
            web={"port": free_port()},  # readers know a hub by address: same after a restart
            journal={"segment_bytes": 1 << 20},  # sealed segments: the cache path is used
        )
        hubs.append(HubProcess(config))
    return hubs


def _spread(events: list[GeneratedEvent]) -> list[list[GeneratedEvent]]:
    """Round robin over the hubs, as Beats' loadbalance and logjam agents' endpoints do."""
    return [events[i::HUBS] for i in range(HUBS)]


def _feed(
    hubs: list[HubProcess], events: list[GeneratedEvent], only: set[int] | None = None
) -> None:
    for i, part in enumerate(_spread(events)):
        if only is None or i in only:
            send_logjam_events(hubs[i].addresses["logjam_router"], part)


def _ends(hubs: list[HubProcess]) -> dict[str, int]:
    return {h.journal_id: HubJournal(h.addresses["web"]).info().end_offset for h in hubs}


def _log(checkpoint: Path, table: str, kind: str) -> dict[int, dict[str, int]]:
    """The query's offsets or commits log: batch id -> source offsets (for offsets)."""
    path = checkpoint / table / kind
    out: dict[int, dict[str, int]] = {}
    if path.is_dir():
        for name in os.listdir(path):
            if name.isdigit():
                lines = (path / name).read_text().strip().splitlines()
                out[int(name)] = json.loads(lines[-1]) if kind == "offsets" else {}
    return out


def _wait(what: str, done: Callable[[], bool], timeout: float, driver: Any, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if (driver is not None and driver.poll() is not None) or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
            raise AssertionError(f"{what}: driver exit {driver and driver.poll()}:\n{tail}")
        time.sleep(0.2)


def _hub_failures(log: Path) -> int:
    """How many times the stream's driver planned a query's restart because a hub was down."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return text.count("a hub is unavailable; restarting from the checkpoint")


def _stream_args(hubs: list[HubProcess], out: Path, ckpt: Path) -> list[str]:
    args = ["stream", "--out", str(out), "--checkpoint", str(ckpt)]
    for hub in hubs:
        args += ["--hub", hub.addresses["web"]]
    return [
        *args,
        "--trigger-seconds", "1",
        "--max-records-per-trigger", "900",
        "--tables", ",".join(STREAM_TABLES),
        "--watermark", f"{WATERMARK_MIN} minutes",
        "--retry-seconds", "2",
    ]  # fmt: skip


def _committed_past(ckpt: Path, batch: int) -> Callable[[], bool]:
    return lambda: all(max(_log(ckpt, t, "commits"), default=-1) > batch for t in STREAM_TABLES)


def _caught_up(ckpt: Path, ends: dict[str, int], batches: int = 1) -> Callable[[], bool]:
    """The last ``batches`` committed batches of every query end at ``ends``: all read (and
    with 2, the no-data batch that writes what the watermark closed has run too)."""

    def done() -> bool:
        for table in STREAM_TABLES:
            offsets, commits = _log(ckpt, table, "offsets"), _log(ckpt, table, "commits")
            last = sorted(i for i in commits if i in offsets)[-batches:]
            if len(last) < batches or any(offsets[i] != ends for i in last):
                return False
        return True

    return done


# What identifies a row in each table (the rest are its figures).
# The drill-down tables (request_samples, request_ids) have a row per request: where it lives.
KEY = ("minute", "date", "app", "env", "action", "module", "frontend", "exception",
       "protocol", "stream", "level", "request_id", "journal", "offset")  # fmt: skip


def _rows(spark: Any, path: Path) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Rows by key (Spark's reader honours a stream sink's commit log)."""
    rows = [r.asDict() for r in spark.read.parquet(str(path)).collect()]
    assert rows, f"{path}: no rows"
    keys = [c for c in KEY if c in rows[0]]
    out = {tuple(r[k] for k in keys): r for r in rows}
    assert len(out) == len(rows), f"{path}: duplicate rows"
    return out


def _assert_equal(got: dict[Any, Any], want: dict[Any, Any], what: str) -> None:
    assert set(got) == set(want), f"{what}: missing or extra rows"
    for key, row in want.items():
        for column, value in row.items():
            if isinstance(value, float):
                assert math.isclose(got[key][column], value, rel_tol=1e-9), (what, key, column)
            else:
                assert got[key][column] == value, (what, key, column)


def test_fleet_on_a_standalone_cluster(spark: Any, cluster: SparkCluster, tmp_path: Path) -> None:
    rounds = fuzz_examples(1, 3)  # fault rounds: each kills a hub, then the driver
    events = logjam_requests(fuzz_examples(2400, 9000), seed=51, minute_span=15, in_order=True)
    flush_ns = BASE_NS + 3600 * 10**9  # moves the watermark past every real minute
    flush = [
        GeneratedEvent("logjam", "shop-production", "logs.shop.production",
                       json.dumps({"started_ms": flush_ns // 10**6}).encode(), "json",
                       flush_ns, flush_ns)
    ]  # fmt: skip
    hubs = _hubs(tmp_path)
    parts = [events[i * len(events) // (rounds + 1) : (i + 1) * len(events) // (rounds + 1)]
             for i in range(rounds + 1)]  # fmt: skip
    out, ckpt, log = tmp_path / "out", tmp_path / "ckpt", tmp_path / "stream.log"
    driver: subprocess.Popen[bytes] | None = None
    rollup: subprocess.Popen[bytes] | None = None
    try:
        for hub in hubs:
            hub.start()
        cluster.wait_ready()
        # The driver and its executors start while the hubs are fed (the stream waits for data).
        driver = cluster.submit(_stream_args(hubs, out, ckpt), log, cores=APP_CORES)
        _feed(hubs, parts[0])
        _wait("first micro-batch", _committed_past(ckpt, 0), 300, driver, log)
        for part in parts[1:]:
            # SIGKILL one hub in the middle of the run; the others go on taking events.
            down = hubs[1]
            failures = _hub_failures(log)
            down.kill()
            _feed(hubs, part, only={0, 2})
            # Until the stream's next micro-batch has failed on it (each trigger asks every
            # hub for its end; the driver logs the restart it plans), not a fixed 3 s: on a
            # loaded machine the failure came later, on a quiet one sooner.
            _wait(
                "a micro-batch failing on the hub that is down",
                lambda n=failures: _hub_failures(log) > n,  # type: ignore[misc]
                300,
                driver,
                log,
            )
            down.start()
            _feed(hubs, part, only={1})
            marks = {t: max(_log(ckpt, t, "commits")) for t in STREAM_TABLES}
            _wait(
                "progress after the hub came back",
                lambda m=marks: all(max(_log(ckpt, t, "commits")) > m[t] for t in STREAM_TABLES),  # type: ignore[misc]
                300,
                driver,
                log,
            )
            # SIGKILL the driver (and its JVM) mid-run; a new one resumes from the checkpoint.
            assert kill_tree(driver, signal.SIGKILL) == -signal.SIGKILL
            driver = cluster.submit(_stream_args(hubs, out, ckpt), log, cores=APP_CORES)
        assert "hub unavailable" in log.read_text(errors="replace")
        # The flush goes in only when the stream has read everything else: it moves the
        # watermark, and what a later micro-batch read from the other hubs would be dropped.
        _wait("caught up", _caught_up(ckpt, _ends(hubs)), 300, driver, log)
        send_logjam_events(hubs[0].addresses["logjam_router"], flush)
        # Every event is in: the batch rollup on the cluster over the hubs, and the local batch
        # job over the same journals read from their directories, while the stream catches up.
        batch_log = tmp_path / "rollup.log"
        args = ["rollup", "--out", str(tmp_path / "cluster-rollup"), "--quiet"]
        for hub in hubs:
            args += ["--hub", hub.addresses["web"]]
        rollup = cluster.submit(args, batch_log, cores=APP_CORES)
        journals = [str(tmp_path / f"journal{i}") for i in range(HUBS)]
        run_rollup(spark, journals, str(tmp_path / "local"), progress=False)
        _wait("flushed", _caught_up(ckpt, _ends(hubs), batches=2), 300, driver, log)
        assert kill_tree(driver, signal.SIGTERM) == 0
        driver = None
        ends = _ends(hubs)
        for hub in hubs:  # what the stream committed, reported to each hub's cursors
            listed = HubJournal(hub.addresses["web"]).cursors()["cursors"]
            assert {c["name"]: c["offset"] for c in listed} == {
                f"taproom-stream-{t}": ends[hub.journal_id] for t in STREAM_TABLES
            }
        assert rollup.wait(600) == 0, batch_log.read_text(errors="replace")[-4000:]
    finally:
        if driver is not None:
            kill_tree(driver, signal.SIGKILL)
        if rollup is not None and rollup.poll() is None:
            kill_tree(rollup, signal.SIGKILL)
        for hub in hubs:
            hub.kill()

    flush_minute = dt.datetime.fromtimestamp(flush_ns // 10**9, dt.UTC).replace(second=0)
    for table in TABLES:
        local = _rows(spark, tmp_path / "local" / table)
        _assert_equal(_rows(spark, tmp_path / "cluster-rollup" / table), local, table)
        if table in STREAM_TABLES:
            final = {
                k: v for k, v in local.items() if v["minute"].replace(tzinfo=dt.UTC) < flush_minute
            }
            _assert_equal(_rows(spark, out / table), final, f"stream {table}")
    requests = [e for e in events if e.topic.startswith(("logs.", "frontend."))]
    total = sum(r["count"] for r in spark.read.parquet(str(out / "requests")).collect())
    assert total == len(requests)
    if SOAK:
        assert rounds > 1
