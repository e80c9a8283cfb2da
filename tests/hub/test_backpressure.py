"""hub.max_pending_bytes is a real bound, and /ready says at once when acks are paused.

A batch that does not fit under the bound waits (in submission order) until commits make room,
whether or not its server called wait_capacity() first; one batch larger than the bound is
admitted alone. The disk-full case uses a real full filesystem (a small tmpfs), full exactly
when the journal must start a new segment.
"""

from __future__ import annotations

import asyncio
import time

from taproom.config import load_config
from taproom.hub import Hub
from taproom.journal import Journal
from taproom.records import BatchBuilder, EncodedBatch
from tests.hub.test_core import _config
from tests.support import fill, needs_mount, small_tmpfs

BOUND = 65536


def batch(tag: str, size: int) -> EncodedBatch:
    b = BatchBuilder()
    b.add("test", tag.encode().ljust(size, b"."))
    return b.build()


def gauge(hub: Hub, name: str) -> float:
    value = hub.metrics.registry.get_sample_value(name)
    assert value is not None
    return value


async def until(condition, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@needs_mount
async def test_disk_full_at_a_roll_holds_the_bound_reports_and_recovers(tmp_path):
    with small_tmpfs(tmp_path / "mnt", "4m") as mnt:
        config = load_config(
            text=f'[journal]\ndir = "{mnt / "j"}"\nsegment_bytes = 1048576\n'
            f"[hub]\nmax_pending_bytes = {BOUND}\nstall_after_s = 3600.0\n",
            env={},
        )
        async with Hub(config) as hub:
            # Over segment_bytes (1 MiB, the smallest allowed): the next commit must roll. It
            # is also larger than the bound: admitted alone.
            first = await hub.ingest(batch("first", 1_100_000))
            filler = fill(mnt)
            futures = [hub.submit(batch(f"held{i}", 8_000)) for i in range(40)]  # no waiting
            await until(lambda: bool(hub.readiness()))
            (reason,) = hub.readiness()  # at once, not after stall_after_s
            assert reason.startswith("acks paused, journal not writable") and "space" in reason
            assert gauge(hub, "taproom_hub_pending_bytes") <= BOUND
            assert gauge(hub, "taproom_hub_admission_waiting_bytes") > 0
            assert not hub.has_capacity
            await asyncio.sleep(1.5)  # several retries of the failing roll
            assert not any(f.done() for f in futures)  # nothing acked that is not on disk
            assert gauge(hub, "taproom_hub_pending_bytes") <= BOUND
            filler.unlink()
            commits = await asyncio.wait_for(asyncio.gather(*futures), 30)
            assert [c.first_offset for c in commits] == list(range(1, 41))  # in order
            await until(lambda: not hub.readiness() and hub.has_capacity)
            assert gauge(hub, "taproom_hub_pending_bytes") == 0
            assert len(hub.journal.segments()) == 2
        journal = Journal(mnt / "j")
        payloads = [r.payload.rstrip(b".") for r in journal.read(0)]
        journal.close()
        assert first.first_offset == 0
        assert payloads == [b"first"] + [f"held{i}".encode() for i in range(40)]


async def test_submit_without_waiting_is_held_in_order_under_the_bound(tmp_path):
    async with Hub(_config(tmp_path, max_pending_bytes=BOUND)) as hub:
        seen: list[float] = []
        futures = []
        for i in range(30):
            futures.append(hub.submit(batch(f"b{i}", 20_000)))  # 600 KB, never waiting
            seen.append(gauge(hub, "taproom_hub_pending_bytes"))
        assert max(seen) <= BOUND
        commits = await asyncio.wait_for(asyncio.gather(*futures), 30)
        assert [c.first_offset for c in commits] == list(range(30))
        held = hub.metrics.registry.get_sample_value("taproom_hub_admission_held_batches_total")
        assert held and held > 0


async def test_a_batch_larger_than_the_bound_goes_in_alone(tmp_path):
    async with Hub(_config(tmp_path, max_pending_bytes=BOUND)) as hub:
        small = hub.submit(batch("small", 1_000))
        big = hub.submit(batch("big", 3 * BOUND))
        after = hub.submit(batch("after", 1_000))
        commits = await asyncio.wait_for(asyncio.gather(small, big, after), 30)
        assert [c.first_offset for c in commits] == [0, 1, 2]
        assert hub.has_capacity


async def test_committed_batches_count_until_their_acks_are_delivered(tmp_path):
    """A committed batch's body is in memory until the loop has resolved its acks and fed the
    outputs: its room under the bound is freed then, not when the commit thread is done.
    (The commit thread's path: a small batch on an idle hub is otherwise committed inline, by
    the loop this test holds.)"""
    async with Hub(_config(tmp_path, max_pending_bytes=BOUND, inline_commit_max_bytes=0)) as hub:
        first = hub.submit(batch("first", 40_000))
        size = gauge(hub, "taproom_hub_pending_bytes")
        # The loop is held here (no await): the commit thread commits, delivery must wait.
        deadline = time.monotonic() + 20
        while hub.journal.end_offset < 1:
            assert time.monotonic() < deadline, "never committed"
            time.sleep(0.01)
        assert not first.done()
        assert gauge(hub, "taproom_hub_pending_bytes") == size  # still in memory, counted
        second = hub.submit(batch("second", 40_000))  # would pass the bound: it waits
        assert gauge(hub, "taproom_hub_admission_waiting_bytes") > 0
        assert not hub.has_capacity
        commits = await asyncio.wait_for(asyncio.gather(first, second), 30)
        assert [c.first_offset for c in commits] == [0, 1]
        await until(lambda: gauge(hub, "taproom_hub_pending_bytes") == 0)
        assert hub.has_capacity
