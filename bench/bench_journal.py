"""Journal and hub figures (issue 2): append rate with fsync=always through the hub API,
commit latency, read/replay rate, and recovery time of a 1 GB journal, clean, with a torn tail
and with corrupt frames (issue 19: damage is quarantined and walked past, never cut).

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
from taproom.journal import Journal, JournalReader, check_journal
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
        figures += corruption_figures(path, size_target)
        figures.append(Figure("peak RSS of the bench process", peak_rss_mib(), "MiB"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return figures


def _damage(path: str, position: int, nbytes: int) -> None:
    with open(path, "r+b") as f:
        f.seek(position)
        f.write(os.urandom(nbytes))


def corruption_figures(path: str, size_target: int) -> list[Figure]:
    """Open, replay and check a journal with corrupt frames in the middle of the last segment
    and of a sealed one: each costs one frame, found by resynchronising on the next."""
    names = sorted(n for n in os.listdir(path) if n.endswith(".seg"))
    last, first = os.path.join(path, names[-1]), os.path.join(path, names[0])
    mib = size_target >> 20
    figures = []
    _damage(last, os.path.getsize(last) // 2, 64)
    t0 = time.perf_counter()
    j = Journal(path)
    figures.append(
        Figure(
            f"recovery of a {mib} MiB journal ({len(names)} segments), corrupt frame mid last",
            time.perf_counter() - t0,
            "s",
            "< 5",
        )
    )
    j.close()
    _damage(first, os.path.getsize(first) // 3, 4 << 20)  # 4 MiB of garbage to resync over
    j = Journal(path)
    t0 = time.perf_counter()
    n = sum(count for _b, count, _body in j.read_batches(0))
    elapsed = time.perf_counter() - t0
    lost = sum(d.lost_events for d in j.damage())
    j.close()
    figures.append(
        Figure(f"replay past 2 quarantined regions ({lost:,} events lost)", n / elapsed, "events/s")
    )
    t0 = time.perf_counter()
    report = check_journal(path)
    figures.append(
        Figure(
            f"journal check of {mib} MiB ({len(report['problems'])} problems found)",
            time.perf_counter() - t0,
            "s",
        )
    )
    return figures
