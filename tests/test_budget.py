"""The process-wide memory budget (issue 26): holders, FIFO waits, refusals, the config check."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from taproom.budget import CONNECTION_BUFFERS, HOLDERS, Holder, MemoryBudget
from taproom.config import ConfigError, load_config
from taproom.hub import Hub
from taproom.metrics import Metrics


def sample(metrics: Metrics, name: str, holder: str) -> float:
    value = metrics.registry.get_sample_value(name, {"holder": holder})
    assert value is not None, name
    return value


def test_try_reserve_takes_what_fits_and_counts_refusals() -> None:
    metrics = Metrics()
    holder = Holder("h", 100, metrics)
    assert holder.try_reserve(60)
    assert holder.try_reserve(40)
    assert not holder.try_reserve(1)
    assert holder.used == 100 and holder.peak == 100
    holder.release(50)
    assert holder.try_reserve(50)
    assert not holder.try_reserve(10)
    assert sample(metrics, "taproom_budget_refusals_calls_total", "h") == 2
    assert sample(metrics, "taproom_budget_held_bytes", "h") == 100
    assert sample(metrics, "taproom_budget_bound_bytes", "h") == 100
    with pytest.raises(ValueError):
        holder.release(101)


def test_a_request_over_the_bound_goes_alone() -> None:
    holder = Holder("h", 100)
    assert holder.try_reserve(10)
    assert not holder.try_reserve(150)  # something is held: it would pass the bound
    holder.release(10)
    assert holder.try_reserve(150)  # nothing held: it goes alone
    assert not holder.try_reserve(1)
    holder.release(150)
    assert holder.used == 0


async def test_reserve_waits_in_fifo_order_and_nobody_overtakes() -> None:
    metrics = Metrics()
    holder = Holder("h", 100, metrics)
    assert holder.try_reserve(90)
    order: list[str] = []

    async def take(name: str, n: int) -> None:
        await holder.reserve(n)
        order.append(name)

    big = asyncio.create_task(take("big", 60))
    await asyncio.sleep(0)
    small = asyncio.create_task(take("small", 5))
    await asyncio.sleep(0)
    # 10 bytes are free, but a reservation waits before this one: no overtaking.
    assert holder.waiting == 2 and holder.waiting_bytes == 65
    assert not holder.try_reserve(5)
    assert order == []
    holder.release(55)  # 35 held: big (60) fits, then small (5)
    await asyncio.wait_for(asyncio.gather(big, small), 5)
    assert order == ["big", "small"]
    assert holder.used == 100 and holder.waiting == 0
    assert sample(metrics, "taproom_budget_waits_calls_total", "h") == 2


async def test_a_cancelled_wait_takes_nothing_and_lets_the_next_in() -> None:
    holder = Holder("h", 100)
    assert holder.try_reserve(80)
    head = asyncio.create_task(holder.reserve(50))
    await asyncio.sleep(0)
    second = asyncio.create_task(holder.reserve(20))
    await asyncio.sleep(0)
    assert holder.waiting == 2
    head.cancel()
    await asyncio.gather(head, return_exceptions=True)
    await asyncio.wait_for(second, 5)  # 80 + 20 fits once the head is gone
    assert holder.used == 100 and holder.waiting == 0 and holder.waiting_bytes == 0


async def test_callback_waits_are_granted_inside_release() -> None:
    holder = Holder("h", 10)
    changes: list[int] = []
    holder.on_change(lambda: changes.append(holder.used))
    assert holder.try_reserve(10)
    granted: list[int] = []
    handle = holder.wait(4, lambda: granted.append(holder.used))
    other = holder.wait(4, lambda: granted.append(holder.used))
    assert holder.cancel(other)
    assert not holder.cancel(other)
    holder.release(10)
    assert granted == [4] and holder.used == 4 and changes == [10, 4]  # the cancel, the release
    assert not holder.cancel(handle)  # already granted


def test_every_declared_holder_is_in_the_hub_budget(tmp_path: Path) -> None:
    config = load_config(text=f'[journal]\ndir = "{tmp_path}"\n', env={})
    budget = MemoryBudget(config, Metrics())
    names = {h.name for h in budget.holders()}
    assert names == {spec.name for spec in HOLDERS} and CONNECTION_BUFFERS in names
    assert budget.holder("pending").bound == config.hub.max_pending_bytes
    assert budget.holder("eventbus_hashmap").bound == config.eventbus.max_hashmap_bytes
    # The defaults split the whole budget, nothing left over and nothing over.
    assert sum(h.bound for h in budget.holders()) == budget.total == 128 << 20
    with pytest.raises(KeyError):
        budget.holder("nonsense")


def test_holders_over_the_total_are_a_config_error_at_their_line() -> None:
    text = "[hub]\nmax_pending_bytes = 134217728\n"
    with pytest.raises(ConfigError) as info:
        load_config(text=text, env={})
    assert info.value.key == "hub.memory_budget_bytes"
    assert "hub.max_pending_bytes 134217728" in info.value.message
    # Raising the total with it is the fix.
    config = load_config(text=text + "memory_budget_bytes = 268435456\n", env={})
    assert config.hub.memory_budget_bytes == 256 << 20


async def test_the_hub_pending_bytes_are_its_budget_holder(tmp_path: Path) -> None:
    from taproom.records import BatchBuilder

    config = load_config(text=f'[journal]\ndir = "{tmp_path}"\n', env={})
    async with Hub(config) as hub:
        pending = hub.budget.holder("pending")
        assert pending.bound == config.hub.max_pending_bytes
        builder = BatchBuilder()
        builder.add("test", b"x" * 1000)
        batch = builder.build()
        future = hub.submit(batch)
        assert pending.used == len(batch.body)
        await future
        assert pending.used == 0
        # A caller that reserved first hands its reservation over.
        await pending.reserve(len(batch.body))
        builder.add("test", b"y" * 1000)
        batch = builder.build()
        await hub.submit(batch, reserved=True)
        assert pending.used == 0 and pending.peak >= len(batch.body)


async def test_waiters_holding_everything_held_are_not_deadlocked() -> None:
    # Two parties each hold the start of a large frame and need more: nobody would ever
    # release, so the oldest is granted beyond the bound; the other waits for it.
    holder = Holder("h", 100)
    assert holder.try_reserve(45) and holder.try_reserve(45)
    first = asyncio.create_task(holder.reserve(40, holding=45))
    await asyncio.sleep(0)
    assert not first.done()  # one party alone is not a deadlock: the other may release
    second = asyncio.create_task(holder.reserve(40, holding=45))
    await asyncio.wait_for(first, 5)
    assert holder.used == 130 and not second.done()
    holder.release(85)  # the first finished its frame
    await asyncio.wait_for(second, 5)
    assert holder.used == 85 and holder.waiting == 0


async def test_past_the_bound_the_waiter_holding_the_most_is_granted() -> None:
    # The party granted beyond the bound asks again for the rest of its frame: it, not the
    # oldest waiter, goes on, so only one frame grows past the bound (taking the oldest let
    # every party grow past it in turn: 74 MB in a 16 MiB holder under 64 bomb connections).
    holder = Holder("h", 100)
    assert holder.try_reserve(45) and holder.try_reserve(45)
    first = asyncio.create_task(holder.reserve(40, holding=45))
    await asyncio.sleep(0)
    second = asyncio.create_task(holder.reserve(40, holding=45))
    await asyncio.wait_for(first, 5)
    again = asyncio.create_task(holder.reserve(40, holding=85))  # the first's next step
    await asyncio.wait_for(again, 5)
    assert holder.used == 170 and not second.done()
    holder.release(125)  # the first finished its frame
    await asyncio.wait_for(second, 5)
    assert holder.used == 85 and holder.waiting == 0


async def test_output_queues_are_bounded_in_bytes_across_outputs(tmp_path: Path) -> None:
    # Issue 26: an output that does not read holds committed bodies in memory; with many
    # batches of large events that was max batches x batch size per output. Now the bodies
    # queued for all outputs together stay within output_queue_bytes: past it a lossy output
    # drops and counts, a lossless one reads back from the journal and loses nothing.
    from taproom.records import BatchBuilder

    bound = 256 << 10
    config = load_config(
        text=f'[journal]\ndir = "{tmp_path}"\n[hub]\noutput_queue_bytes = {bound}\n', env={}
    )
    async with Hub(config) as hub:
        queued = hub.budget.holder("output_queues")
        lossy = hub.subscribe("lossy_one", lossy=True)
        lossless = hub.subscribe("lossless_one")
        for i in range(20):  # 20 x 40 KiB, nobody reading
            builder = BatchBuilder()
            builder.add("test", str(i).encode().ljust(40 << 10, b"."))
            await hub.ingest(builder.build())
        assert queued.peak <= bound and 0 < queued.used <= bound
        dropped = hub.metrics.registry.get_sample_value(
            "taproom_hub_output_dropped_events_total", {"output": "lossy_one"}
        )
        assert dropped and dropped > 0
        got = []
        async for batch in lossless:
            got += [r.payload.rstrip(b".") for r in batch.records()]
            if len(got) == 20:
                break
        assert got == [str(i).encode() for i in range(20)]  # read back, nothing lost
        lossy.close()
        lossless.close()
        assert queued.used == 0
