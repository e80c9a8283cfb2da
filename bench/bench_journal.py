"""Journal and hub figures (issue 2): append rate with fsync=always through the hub API,
commit latency, read/replay rate, and recovery time of a 1 GB journal.

The hub runs in this process pinned to one core (commit thread and event loop share it), as a
protocol server's hub would.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time

from taproom.config import load_config
from taproom.hub import Hub
from taproom.journal import Journal, JournalReader
from taproom.records import BatchBuilder, EncodedBatch

from .common import Figure, peak_rss_mib, percentile

EVENT = b'{"level":"info","message":"' + b"x" * 250 + b'","app":"shop"}'  # ~300 bytes


def make_batch(n: int = 1000) -> EncodedBatch:
    b = BatchBuilder()
    for i in range(n):
        b.add(
            "bench",
            EVENT,
            stream="shop-prod",
            topic="logs",
            producer="10.0.0.1:5000",
            seq=i,
            content_type="json",
        )
    return b.build()


async def append_run(
    journal_dir: str, seconds: float, encode: bool
) -> tuple[int, float, list[float]]:
    config = load_config(text=f'[journal]\ndir = "{journal_dir}"\nfsync = "always"\n', env={})
    latencies: list[float] = []
    prebuilt = make_batch()
    done = 0
    async with Hub(config) as hub:
        deadline = time.monotonic() + seconds

        async def producer() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                batch = make_batch() if encode else prebuilt
                t0 = time.perf_counter()
                await hub.ingest(batch)
                latencies.append(time.perf_counter() - t0)
                done += batch.count

        start = time.perf_counter()
        await asyncio.gather(*(producer() for _ in range(4)))
        elapsed = time.perf_counter() - start
    return done, elapsed, sorted(latencies)


def run(quick: bool) -> list[Figure]:
    figures = []
    seconds = 2.0 if quick else 8.0
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    except (AttributeError, OSError):
        pass
    root = tempfile.mkdtemp(prefix="taproom-bench-journal-", dir=os.environ.get("BENCH_DIR"))
    try:
        for encode in (False, True):
            path = os.path.join(root, f"append-{encode}")
            events, elapsed, lat = asyncio.run(append_run(path, seconds, encode))
            label = "incl. encoding" if encode else "pre-encoded"
            figures.append(
                Figure(
                    f"append fsync=always, 4 producers x 1000-event batches ({label})",
                    events / elapsed,
                    "events/s",
                    ">= 500,000",
                )
            )
            figures.append(Figure(f"  MB/s ({label})", events * len(EVENT) / elapsed / 1e6, "MB/s"))
            figures.append(
                Figure(f"  commit latency p50 ({label})", percentile(lat, 50) * 1000, "ms")
            )
            figures.append(
                Figure(f"  commit latency p99 ({label})", percentile(lat, 99) * 1000, "ms")
            )
        # Replay: raw batches (what outputs and Spark partitions read) and decoded records.
        path = os.path.join(root, "append-True")
        reader = JournalReader(path)
        t0 = time.perf_counter()
        n = sum(count for _b, count, _body in reader.read_batches(0))
        figures.append(
            Figure(
                "replay: verified batches (CRC checked)", n / (time.perf_counter() - t0), "events/s"
            )
        )
        t0 = time.perf_counter()
        n = sum(1 for _ in reader.read(0))
        figures.append(
            Figure("replay: decoded Record objects", n / (time.perf_counter() - t0), "events/s")
        )
        # Recovery of a 1 GB journal (128 MiB segments), clean and with a torn tail.
        size_target = (256 if quick else 1024) * 1024 * 1024
        path = os.path.join(root, "recovery")
        j = Journal(path, fsync="off")
        big = make_batch(4000)
        written = 0
        while written < size_target:
            j.commit([big])
            written += len(big.body)
        j.close()
        t0 = time.perf_counter()
        Journal(path).close()
        figures.append(
            Figure(
                f"recovery (open) of a {size_target >> 20} MiB journal, clean",
                time.perf_counter() - t0,
                "s",
                "< 5",
            )
        )
        seg = os.path.join(path, sorted(n for n in os.listdir(path) if n.endswith(".seg"))[-1])
        with open(seg, "ab") as f:
            f.write(os.urandom(1000))
        t0 = time.perf_counter()
        Journal(path).close()
        figures.append(
            Figure(
                f"recovery of a {size_target >> 20} MiB journal with a torn tail",
                time.perf_counter() - t0,
                "s",
                "< 5",
            )
        )
        figures.append(Figure("peak RSS of the bench process", peak_rss_mib(), "MiB"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return figures
