"""taproom.supervise: the mechanism itself, and the hub's own loops (the commit thread and its
hand-off to the outputs). Each protocol's loops are checked in tests/supervision/."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from taproom.config import HubConfig
from taproom.errors import HubStopped
from taproom.hub import Hub
from taproom.hub.core import Subscription
from taproom.metrics import Metrics
from taproom.records import Record, encode_records
from taproom.supervise import FAILED, Supervisor
from tests.support import load, write_config


def _supervisor(**over: object) -> Supervisor:
    return Supervisor(HubConfig(**over), Metrics())  # type: ignore[arg-type]


def _sample(metrics: Metrics, name: str, labels: dict[str, str]) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def until(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``predicate`` until true, failing after ``timeout`` s (never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class TestGuard:
    def test_counts_each_failure_and_logs_the_first_with_its_traceback(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        sup = _supervisor(error_log_interval_s=3600)
        guard = sup.guard("demo.loop", protocol="demo")
        with caplog.at_level(logging.ERROR, "taproom.supervise"):
            for i in range(5):
                try:
                    raise ValueError(f"poison {i}")
                except ValueError as exc:
                    guard.failed(exc, "demo message")
        labels = {"protocol": "demo", "reason": "internal_error"}
        assert _sample(sup.metrics, "taproom_ingest_rejected_items_total", labels) == 5
        assert guard.errors == 5
        records = [r for r in caplog.records if "demo.loop" in r.getMessage()]
        assert len(records) == 1  # rate-limited: the other four are counted, not logged
        assert records[0].exc_info is not None and "poison 0" in str(records[0].exc_info[1])

    def test_the_next_line_says_how_many_were_not_logged(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        sup = _supervisor(error_log_interval_s=0)
        guard = sup.guard("demo.loop", output="demo_out")
        guard._interval = 3600
        with caplog.at_level(logging.ERROR, "taproom.supervise"):
            for _ in range(3):
                guard.failed(RuntimeError("x"), items=2)
            guard._next_log = 0  # the interval has passed
            guard.failed(RuntimeError("y"))
        lines = [r.getMessage() for r in caplog.records if "demo.loop" in r.getMessage()]
        assert len(lines) == 2 and "(2 more since the last one logged)" in lines[1]
        labels = {"output": "demo_out", "reason": "internal_error"}
        assert _sample(sup.metrics, "taproom_hub_output_errors_items_total", labels) == 7

    def test_call_returns_failed_instead_of_raising(self) -> None:
        guard = _supervisor().guard("demo.loop", protocol="demo")
        assert guard.call(lambda x: x + 1, 1) == 2
        assert guard.call(lambda: 1 / 0) is FAILED
        assert guard.errors == 1

    def test_a_guard_counts_for_exactly_one_protocol_or_output(self) -> None:
        sup = _supervisor()
        with pytest.raises(ValueError):
            sup.guard("x")
        with pytest.raises(ValueError):
            sup.guard("x", protocol="p", output="o")


class TestSpawn:
    async def test_a_loop_that_dies_is_restarted_and_listed_until_it_is_back(self) -> None:
        sup = _supervisor(loop_settle_s=0.3, loop_death_limit=5)
        runs = 0
        served = asyncio.Event()

        async def loop() -> None:
            nonlocal runs
            runs += 1
            if runs == 1:
                raise RuntimeError("a bug outside any guard")
            served.set()
            await asyncio.Event().wait()

        task = sup.spawn("demo.loop", loop)
        try:
            await asyncio.wait_for(served.wait(), 10)
            assert runs == 2
            degraded = sup.degraded()
            assert len(degraded) == 1 and "demo.loop died at" in degraded[0]
            assert "RuntimeError: a bug outside any guard" in degraded[0]
            assert sup.readiness() == []  # one death: shown, not unready
            await until(lambda: not sup.degraded(), 10, "the loop to be back")
            labels = {"loop": "demo.loop"}
            assert _sample(sup.metrics, "taproom_hub_loop_restarts_calls_total", labels) == 1
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    async def test_a_loop_that_keeps_dying_makes_ready_fail(self) -> None:
        sup = _supervisor(loop_death_limit=3, loop_restart_max_s=0.1, loop_death_window_s=60)

        async def loop() -> None:
            raise KeyError("always")

        task = sup.spawn("demo.loop", loop)
        try:
            await until(lambda: sup.readiness(), 10, "three deaths")
            (reason,) = sup.readiness()
            assert reason.startswith("loop demo.loop died at") and "deaths within 60s" in reason
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    async def test_return_cancel_and_hub_stopped_end_without_a_restart(self) -> None:
        sup = _supervisor()
        calls = 0

        async def stops() -> None:
            nonlocal calls
            calls += 1
            raise HubStopped("shutting down")

        await sup.spawn("demo.stops", stops)

        async def returns() -> None:
            nonlocal calls
            calls += 1

        await sup.spawn("demo.returns", returns)
        assert calls == 2
        assert sup.degraded() == [] and sup.readiness() == []

    async def test_a_first_coroutine_runs_once_then_the_factory(self) -> None:
        sup = _supervisor()
        seen: list[str] = []

        async def first() -> None:
            seen.append("first")
            raise RuntimeError("die once")

        async def again() -> None:
            seen.append("again")

        await sup.spawn("demo.first", again, first=first())
        assert seen == ["first", "again"]

    async def test_a_first_coroutine_cancelled_before_it_ran_is_closed(self) -> None:
        sup = _supervisor()

        async def first() -> None:
            raise AssertionError("never runs")

        coro = first()
        task = sup.spawn("demo.first", lambda: asyncio.sleep(0), first=coro)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert coro.cr_frame is None  # closed: no "never awaited" warning


def _batch(topic: str) -> object:
    return encode_records([Record("test", topic=topic, payload=b"x")])


class TestHubLoops:
    """The commit thread and its hand-off to the outputs, supervised like every loop."""

    async def test_a_commit_thread_that_dies_is_restarted_and_retries_its_group(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # the commit thread's own path (a lone small batch is otherwise committed inline)
        config = load(write_config(tmp_path, hub={"inline_commit_max_bytes": 0}))
        async with Hub(config) as hub:
            real = hub.journal.commit
            failures = 0

            def commit_once_broken(batches: list[object]) -> list[int]:
                nonlocal failures
                if failures == 0:
                    failures += 1
                    raise RuntimeError("a bug in the journal's write path")
                return real(batches)  # type: ignore[arg-type]

            monkeypatch.setattr(hub.journal, "commit", commit_once_broken)
            commit = await asyncio.wait_for(hub.submit(_batch("a")), 30)  # type: ignore[arg-type]
            assert commit.count == 1 and failures == 1
            assert [r.topic for r in hub.journal.read(0)] == ["a"]
            assert hub.supervisor.loops["hub.commit"].total_deaths == 1
            assert hub.readiness() == []  # one death: degraded, not unready
            assert any("loop hub.commit died" in d for d in hub.degraded())
            later = await asyncio.wait_for(hub.submit(_batch("b")), 30)  # type: ignore[arg-type]
            assert later.first_offset == 1

    async def test_an_output_whose_hand_off_fails_reads_the_batch_back(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        config = load(write_config(tmp_path))
        async with Hub(config) as hub:
            broken = hub.subscribe("broken")
            healthy = hub.subscribe("healthy")
            real_offer = Subscription._offer

            def offer(self: Subscription, batch: object) -> None:
                if self is broken and not getattr(self, "_failed_once", False):
                    self._failed_once = True  # type: ignore[attr-defined]
                    raise RuntimeError("a bug in one output's hand-off")
                real_offer(self, batch)  # type: ignore[arg-type]

            monkeypatch.setattr(Subscription, "_offer", offer)
            for topic in ("a", "b"):
                await asyncio.wait_for(hub.submit(_batch(topic)), 30)  # type: ignore[arg-type]

            async def two(sub: Subscription) -> list[str]:
                topics: list[str] = []
                async for committed in sub:
                    topics += [r.topic for r in committed.records()]
                    if len(topics) == 2:
                        return topics
                return topics

            assert await asyncio.wait_for(two(healthy), 10) == ["a", "b"]
            assert await asyncio.wait_for(two(broken), 10) == ["a", "b"]
            labels = {"output": "hub", "reason": "internal_error"}
            assert _sample(hub.metrics, "taproom_hub_output_errors_items_total", labels) == 1


class TestEveryLoop:
    async def test_every_long_lived_task_of_a_hub_is_supervised(self, tmp_path: Path) -> None:
        """With every service on, each task the hub runs is a supervised loop (or one of the
        helper waits a Subscription makes while it waits for a batch)."""
        from tests.support import running_app

        services = ["lumberjack", "logtk", "logjam", "eventbus", "lager"]
        async with running_app(tmp_path, enable=services, eventbus={"chp": True}) as app:
            await asyncio.sleep(0)
            me = asyncio.current_task()
            helpers = {"Queue.get", "Event.wait"}  # Subscription.__anext__'s own waits
            unsupervised = sorted(
                task.get_name()
                for task in asyncio.all_tasks()
                if task is not me
                and getattr(task.get_coro(), "__qualname__", "")
                not in {"Supervisor._run", *helpers}
            )
            assert unsupervised == []
            loops = set(app.hub.supervisor.loops)
            for name in (
                "hub.commit",
                "web.stats",
                "lumberjack.sweep",
                "logtk.expire",
                "logtk.checkpoint",
                "logjam.router",
                "logjam.pull",
                "logjam.pub",
                "logjam.replay",
                "eventbus.collector",
                "eventbus.chp_collector",
                "eventbus.broadcast",
                "lager.forwarder.data",
                "lager.registrar.collector",
            ):
                assert name in loops, name

    async def test_ready_names_a_dead_loop_and_turns_503_while_it_keeps_dying(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Over HTTP: one death is listed under degraded (200); dying again and again, the
        loop makes /ready 503 with its name, when and why."""
        import orjson
        from aiohttp import ClientSession

        from taproom.servers.eventbus.collector import Collector
        from tests.support import running_app

        starts = [0]
        again = asyncio.Event()

        async def dying(self: Collector) -> None:
            starts[0] += 1
            if starts[0] == 2:
                await again.wait()  # restarted once: hold here until the test has looked
            raise RuntimeError(f"collector bug {starts[0]}")

        monkeypatch.setattr(Collector, "_collector_loop", dying)
        hub = {"loop_death_limit": 3, "loop_restart_max_s": 0.2, "loop_settle_s": 3600}
        async with running_app(tmp_path, enable=["eventbus"], hub=hub) as app:
            url = f"http://{app.addresses['web']}/ready"
            async with ClientSession() as http:

                async def ready() -> tuple[int, dict[str, object]]:
                    async with http.get(url) as r:
                        return r.status, orjson.loads(await r.read())

                await until(lambda: starts[0] == 2, 20, "the first restart")
                status, body = await ready()
                assert status == 200 and body["reasons"] == []
                (line,) = body["degraded"]  # type: ignore[misc]
                assert line.startswith("loop eventbus.collector died at")
                assert "RuntimeError: collector bug 1" in line and line.endswith("restarted")
                again.set()  # now it keeps dying
                deadline = time.monotonic() + 30
                while (answer := await ready())[0] != 503:
                    assert time.monotonic() < deadline, answer
                    await asyncio.sleep(0.02)
                (reason,) = answer[1]["reasons"]  # type: ignore[misc]
                assert reason.startswith("loop eventbus.collector died at")
                # it goes on dying meanwhile: the third death or a later one
                found = re.search(r"collector bug (\d+)\).*; (\d+) deaths within 60s$", reason)
                assert found and int(found[1]) >= 3 and int(found[2]) >= 3, reason
