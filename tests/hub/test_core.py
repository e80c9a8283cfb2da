"""Hub core: commit-then-ack, group commit, fan-out from committed data, backpressure."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

from taproom.config import load_config
from taproom.errors import HubStopped
from taproom.hub import Hub
from taproom.journal.segments import scan_segment, segment_name
from taproom.records import BatchBuilder
from taproom.web.stats import StatsRing


def _config(tmp_path, **hub):
    text = f'[journal]\ndir = "{tmp_path / "j"}"\n'
    if hub:
        text += "[hub]\n" + "".join(f"{k} = {v}\n" for k, v in hub.items())
    return load_config(text=text, env={})


def _batch(n, tag="e"):
    b = BatchBuilder()
    for i in range(n):
        b.add("test", f"{tag}{i}".encode(), stream="s", seq=i)
    return b.build()


async def test_ingest_resolves_with_contiguous_offsets(tmp_path):
    async with Hub(_config(tmp_path)) as hub:
        commits = await asyncio.gather(*(hub.ingest(_batch(10, f"b{k}-")) for k in range(20)))
        starts = sorted(c.first_offset for c in commits)
        assert starts == list(range(0, 200, 10))
        assert all(c.count == 10 for c in commits)
        assert hub.journal.end_offset == 200
    # reopen: everything acked is there, byte for byte
    async with Hub(_config(tmp_path)) as hub:
        payloads = [r.payload for r in hub.journal.read(0)]
        assert len(payloads) == 200
        first = next(c for c in commits if c.first_offset == 0)
        k = commits.index(first)
        assert payloads[:10] == [f"b{k}-{i}".encode() for i in range(10)]


async def test_group_commit_shares_fsyncs(tmp_path):
    async with Hub(_config(tmp_path)) as hub:
        await asyncio.gather(*(hub.ingest(_batch(1)) for _ in range(500)))
        fsyncs = hub.metrics.registry.get_sample_value("taproom_journal_fsync_calls_total")
        assert fsyncs is not None and fsyncs < 500


async def test_subscription_sees_only_committed_in_order(tmp_path):
    async with Hub(_config(tmp_path)) as hub:
        sub = hub.subscribe("t")
        await asyncio.gather(*(hub.ingest(_batch(5)) for _ in range(10)))
        seen = []
        while len(seen) < 50:
            batch = await asyncio.wait_for(sub.__anext__(), 5)
            seen.extend(r.offset for r in batch.records())
        assert seen == list(range(50))


async def test_slow_subscription_catches_up_from_journal(tmp_path):
    async with Hub(_config(tmp_path, output_queue_batches=2)) as hub:
        sub = hub.subscribe("slow")
        for _ in range(30):  # far more than the queue holds
            await hub.ingest(_batch(3))
        seen = []
        while len(seen) < 90:
            batch = await asyncio.wait_for(sub.__anext__(), 5)
            seen.extend(r.offset for r in batch.records())
        assert seen == list(range(90))
        lagged = hub.metrics.registry.get_sample_value(
            "taproom_hub_output_lagged_events_total", {"output": "slow"}
        )
        assert lagged and lagged >= 1


async def test_lossy_subscription_counts_drops(tmp_path):
    async with Hub(_config(tmp_path, output_queue_batches=2)) as hub:
        sub = hub.subscribe("lossy", lossy=True)
        for _ in range(10):
            await hub.ingest(_batch(3))
        dropped = hub.metrics.registry.get_sample_value(
            "taproom_hub_output_dropped_events_total", {"output": "lossy"}
        )
        got = []
        while not sub._queue.empty():
            got.extend(r.offset for r in (await sub.__anext__()).records())
        assert dropped == 30 - len(got)
        assert got == list(range(len(got)))


async def test_subscription_from_offset_replays_history(tmp_path):
    async with Hub(_config(tmp_path)) as hub:
        for _ in range(4):
            await hub.ingest(_batch(5))
        sub = hub.subscribe("replay", from_offset=7)
        await hub.ingest(_batch(5))
        seen = []
        while len(seen) < 18:
            seen.extend(r.offset for r in (await asyncio.wait_for(sub.__anext__(), 5)).records())
        assert seen == list(range(7, 25))


async def test_backpressure_when_pending_bytes_over_bound(tmp_path):
    async with Hub(_config(tmp_path, max_pending_bytes=65536)) as hub:
        big = BatchBuilder()
        big.add("test", b"x" * 70000)
        future = hub.submit(big.build())
        assert not hub.has_capacity
        await future
        await asyncio.sleep(0)
        assert hub.has_capacity


async def test_read_back_walks_past_quarantined_damage_and_counts_the_gap(tmp_path):
    async with Hub(_config(tmp_path)) as hub:
        for k in range(6):
            await hub.ingest(_batch(5, f"b{k}-"))
    seg = tmp_path / "j" / segment_name(0)
    position = dict(scan_segment(str(seg)).index)[10]  # the batch of offsets 10-14
    with open(seg, "r+b") as f:
        f.seek(position + 40)
        f.write(b"\xff\xff")
    async with Hub(_config(tmp_path)) as hub:
        sub = hub.subscribe("replay", from_offset=0)
        await hub.ingest(_batch(5, "new-"))
        seen = []
        while len(seen) < 30:
            seen.extend(r.offset for r in (await asyncio.wait_for(sub.__anext__(), 5)).records())
        assert seen == [*range(10), *range(15, 35)]  # later offsets as they were acked
        gap = hub.metrics.registry.get_sample_value(
            "taproom_hub_output_dropped_events_total", {"output": "replay"}
        )
        assert gap == 5
        assert any("offsets 10-14 lost" in line for line in hub.degraded())
        assert hub.readiness() == []  # damage is reported, not a reason to stop serving


async def test_outputs_are_public_and_the_console_reads_their_lag(tmp_path):
    """The console's per-output lag comes from Hub.outputs(), not the hub's private set."""
    async with Hub(_config(tmp_path)) as hub:
        fast, slow = hub.subscribe("fast"), hub.subscribe("slow")
        await hub.ingest(_batch(5))
        await asyncio.wait_for(fast.__anext__(), 5)
        assert sorted(sub.name for sub in hub.outputs()) == ["fast", "slow"]
        row = StatsRing(hub, 10, dict).sample()
        assert (row["lag/fast"], row["lag/slow"]) == (0, 5)
        slow.close()
        assert [sub.name for sub in hub.outputs()] == ["fast"]
        assert "lag/slow" not in StatsRing(hub, 10, dict).sample()


def _sample(hub, name, **labels):
    return hub.metrics.registry.get_sample_value(name, labels) or 0


class TestInlineCommits:
    """Issue 32: a small group admitted while the commit thread is idle is committed by the
    loop itself (no thread hand-offs); group commit still batches under load."""

    async def test_a_lone_small_batch_is_committed_by_the_loop(self, tmp_path):
        # a loaded test machine's fsync can average past the 5 ms default (inline turns off)
        async with Hub(_config(tmp_path, inline_commit_max_ms=1000)) as hub:
            commits = [await hub.ingest(_batch(2, tag=f"b{i}")) for i in range(3)]
            assert [c.first_offset for c in commits] == [0, 2, 4]
            assert _sample(hub, "taproom_hub_inline_commits_calls_total") == 3
            assert _sample(hub, "taproom_hub_commits_calls_total") == 3
            assert _sample(hub, "taproom_journal_fsync_calls_total") == 3  # durable as ever
        # and on disk for a reader that opens the journal afresh
        assert scan_segment(str(tmp_path / "j" / segment_name(0))).next_offset == 6

    async def test_concurrent_senders_share_commits_on_both_paths(self, tmp_path):
        """40 senders, one batch in flight each: each loop iteration's batches are one group,
        small groups inline, larger ones in the commit thread; offsets follow submit order and
        an output sees every batch once, in order."""
        async with Hub(_config(tmp_path, inline_commit_max_ms=1000)) as hub:
            sub = hub.subscribe("check")
            order: list[tuple[int, int]] = []  # (first offset, sender) in submit order

            async def sender(k: int, size: int) -> None:
                for i in range(10):
                    b = BatchBuilder()
                    b.add("test", b"x" * size, stream=str(k), seq=i)
                    commit = await hub.ingest(b.build())
                    order.append((commit.first_offset, k))

            # 40 x 100 B fit one inline group; 40 x 4 KiB do not
            await asyncio.gather(*(sender(k, 100) for k in range(40)))
            inline = _sample(hub, "taproom_hub_inline_commits_calls_total")
            await asyncio.gather(*(sender(k, 4096) for k in range(40)))
            commits = _sample(hub, "taproom_hub_commits_calls_total")
            assert commits <= 40  # 800 batches, far fewer commits: group commit
            assert 0 < inline <= 20 and commits - inline >= 10  # both paths took groups
            offsets = sorted(first for first, _ in order)
            assert offsets == list(range(800))
            seen = []
            while len(seen) < 800:
                committed = await asyncio.wait_for(sub.__anext__(), 10)
                seen += [r.offset for r in committed.records()]
            assert seen == list(range(800))

    async def test_a_failed_inline_commit_is_retried_by_the_commit_thread(
        self, tmp_path, monkeypatch
    ):
        from taproom.errors import JournalFailed

        async with Hub(_config(tmp_path, inline_commit_max_ms=1000)) as hub:
            real, calls = hub.journal.commit, []

            def fails_once(batches):
                calls.append(len(batches))
                if len(calls) == 1:
                    raise JournalFailed("injected")
                return real(batches)

            monkeypatch.setattr(hub.journal, "commit", fails_once)
            commit = await asyncio.wait_for(hub.ingest(_batch(3)), 30)
            assert commit.first_offset == 0 and len(calls) == 2
            assert _sample(hub, "taproom_hub_inline_commits_calls_total") == 0
            reason = "journal_failed"
            assert _sample(hub, "taproom_hub_commit_failures_events_total", reason=reason) == 1
            assert [r.payload for r in hub.journal.read(0)] == [b"e0", b"e1", b"e2"]

    async def test_a_slow_disk_turns_inline_commits_off(self, tmp_path, monkeypatch):
        async with Hub(_config(tmp_path, inline_commit_max_ms=1)) as hub:
            real = hub.journal.commit

            def slow(batches):
                import time

                time.sleep(0.01)  # 10 ms a commit: the loop must not wait on that
                return real(batches)

            monkeypatch.setattr(hub.journal, "commit", slow)
            for i in range(5):
                await hub.ingest(_batch(1, tag=str(i)))
            # the first one went inline and showed the disk slow; the rest went to the thread
            assert _sample(hub, "taproom_hub_inline_commits_calls_total") == 1
            assert _sample(hub, "taproom_hub_commits_calls_total") == 5


class TestCommitNow:
    """Issue 32: a server with nothing more to submit has its lone inline group committed in
    its own turn of the loop (``Hub.commit_now``), not a turn later; a group that others in
    the same turn may still join is left to batch."""

    async def test_a_lone_group_is_committed_in_the_submitters_turn(self, tmp_path):
        async with Hub(_config(tmp_path, inline_commit_max_ms=1000)) as hub:
            got = []
            for i in range(3):
                await asyncio.sleep(0)  # this turn: this test alone
                hub.submit_callback(_batch(1, tag=f"n{i}-"), lambda c, e: got.append((c, e)))
                assert len(got) == i  # never before the commit
                assert hub.commit_now() is True
                # durable and acked before this turn ends, after its own fsync
                assert [c.first_offset for c, _ in got] == [0, 1, 2][: i + 1]
                assert _sample(hub, "taproom_journal_fsync_calls_total") == i + 1
            assert hub.commit_now() is False  # nothing waits
            # a batch of more than one event (not one request) is left to its turn's end
            hub.submit_callback(_batch(2, tag="m"), lambda c, e: got.append((c, e)))
            assert hub.commit_now() is False and len(got) == 3
            deadline = time.monotonic() + 30
            while len(got) < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # committed at its turn's end, as before
            assert [c.first_offset for c, _ in got] == [0, 1, 2, 3]
            assert _sample(hub, "taproom_hub_inline_commits_calls_total") == 4
        assert scan_segment(str(tmp_path / "j" / segment_name(0))).next_offset == 5

    async def test_a_group_others_may_join_still_batches(self, tmp_path):
        """Two servers' reads in the same turn: the first one's commit_now leaves the group
        (the second is still to run), the second's too (two requests: a group); both are
        committed as one group at the turn's end, as before."""
        async with Hub(_config(tmp_path, inline_commit_max_ms=1000)) as hub:
            loop = asyncio.get_running_loop()
            done = loop.create_future()
            acks, now = [], []

            def server(k: int) -> None:
                def on_commit(commit, error):
                    acks.append((k, commit.first_offset))
                    if len(acks) == 2:
                        done.set_result(None)

                hub.submit_callback(_batch(1, tag=f"s{k}"), on_commit)
                now.append(hub.commit_now())

            loop.call_soon(server, 0)
            loop.call_soon(server, 1)
            await asyncio.wait_for(done, 30)
            assert now == [False, False]
            assert acks == [(0, 0), (1, 1)]
            assert _sample(hub, "taproom_hub_commits_calls_total") == 1  # one group
            assert _sample(hub, "taproom_journal_fsync_calls_total") == 1

    async def test_a_group_for_the_commit_thread_is_left_to_it(self, tmp_path):
        async with Hub(_config(tmp_path, inline_commit_max_bytes=0)) as hub:
            future = hub.submit(_batch(1))
            assert hub.commit_now() is False
            assert (await asyncio.wait_for(future, 30)).first_offset == 0
            assert _sample(hub, "taproom_hub_inline_commits_calls_total") == 0


def _big(tag):  # 40 KiB: two of them do not fit max_pending_bytes = 64 KiB
    b = BatchBuilder()
    b.add("test", tag.encode() * (40960 // len(tag)), stream="s", seq=0)
    return b.build()


class TestCommitCallbacks:
    """Issue 32: ``submit_callback`` calls the server straight from the commit's delivery (no
    future, no scheduled callback), only once the batch is durable, on both commit paths."""

    async def _three_and_a_future(self, hub):
        fsyncs_seen, commits, errors = [], [], []

        def on_commit(commit, error):
            fsyncs_seen.append(_sample(hub, "taproom_journal_fsync_calls_total"))
            commits.append(commit)
            errors.append(error)
            if len(commits) == 1:
                raise RuntimeError("a server's bug in its ack path")

        for i in range(3):
            hub.submit_callback(_batch(2, tag=f"c{i}-"), on_commit)
        future = hub.submit(_batch(1, tag="f"))
        # The failing first callback costs nothing else: the next ones and the future resolve.
        assert (await asyncio.wait_for(future, 30)).first_offset == 6
        return fsyncs_seen, commits, errors

    async def test_called_after_the_fsync_inline(self, tmp_path):
        async with Hub(_config(tmp_path, inline_commit_max_ms=1000)) as hub:
            fsyncs_seen, commits, errors = await self._three_and_a_future(hub)
            assert _sample(hub, "taproom_hub_inline_commits_calls_total") == 1
            assert [c.first_offset for c in commits] == [0, 2, 4]
            assert errors == [None] * 3
            assert fsyncs_seen == [1, 1, 1]  # each called after the one fsync of the group
            assert hub._deliver_guard.errors == 1  # the bug counted
        assert scan_segment(str(tmp_path / "j" / segment_name(0))).next_offset == 7

    async def test_called_after_the_fsync_from_the_commit_thread(self, tmp_path):
        async with Hub(_config(tmp_path, inline_commit_max_bytes=0)) as hub:
            fsyncs_seen, commits, errors = await self._three_and_a_future(hub)
            assert _sample(hub, "taproom_hub_inline_commits_calls_total") == 0
            assert [c.first_offset for c in commits] == [0, 2, 4]
            assert errors == [None] * 3
            assert all(n >= 1 for n in fsyncs_seen)
            assert hub._deliver_guard.errors == 1

    async def test_refused_at_stop_while_waiting_for_room(self, tmp_path, monkeypatch):
        """A batch still waiting for room when the grace period ends is refused through its
        callback (never acked: its sender resends it)."""
        config = _config(
            tmp_path, max_pending_bytes=65536, grace_period_s=0.0, inline_commit_max_bytes=0
        )
        async with Hub(config) as hub:
            got = []
            release = threading.Event()
            real = hub.journal.commit

            def held(batches):  # the first commit waits, so the second batch has no room
                while not release.is_set():
                    time.sleep(0.005)
                return real(batches)

            monkeypatch.setattr(hub.journal, "commit", held)
            first = hub.submit(_big("first"))
            hub.submit_callback(_big("second"), lambda c, e: got.append((c, e)))
            stopping = asyncio.ensure_future(hub.stop())
            while not got:
                await asyncio.sleep(0.01)
            release.set()
            await stopping
            assert (await first).first_offset == 0
            ((commit, error),) = got
            assert commit is None and isinstance(error, HubStopped)


class TestDirectConsumers:
    """Issue 32: an output caught up and parked gets each committed batch from the commit's
    delivery itself (consume_directly); otherwise through its queue, in the same order."""

    async def test_caught_up_batches_come_directly_the_rest_through_the_queue(self, tmp_path):
        async with Hub(_config(tmp_path, inline_commit_max_ms=1000)) as hub:
            sub = hub.subscribe("direct")
            seen: list[tuple[str, int, int]] = []  # (how, base offset, end offset)
            sub.consume_directly(lambda b: seen.append(("direct", b.base_offset, b.end_offset)))
            # Nobody is iterating yet: the first batches queue up.
            await hub.ingest(_batch(2, tag="q0-"))
            await hub.ingest(_batch(3, tag="q1-"))
            assert seen == []

            async def iterate() -> None:
                async for b in sub:
                    seen.append(("queue", b.base_offset, b.end_offset))

            consumer = asyncio.ensure_future(iterate())
            while len(seen) < 2:  # it drains the queue, then parks
                await asyncio.sleep(0.01)
            while sub._waiter is None:
                await asyncio.sleep(0.01)
            for i in range(3):  # caught up and parked: straight from the commit
                commit = await hub.ingest(_batch(1, tag=f"d{i}-"))
                assert seen[-1] == ("direct", commit.first_offset, commit.end_offset)
            # several batches of one group: each handed over, in order
            await asyncio.gather(*(hub.ingest(_batch(1, tag=f"g{i}-")) for i in range(4)))
            assert seen[-4:] == [("direct", k, k + 1) for k in range(8, 12)]
            # reading back from the journal (as after its queue overflowed): passed over, the
            # iterator reads it back
            sub._lagging = True
            sub._wake()
            lagged = await hub.ingest(_batch(2, tag="lag-"))
            assert seen[-1][2] == 12
            deadline = asyncio.get_running_loop().time() + 30
            while seen[-1][2] < 14 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            consumer.cancel()
            assert seen[-1] == ("queue", 12, lagged.end_offset)
            bases = [base for _how, base, _end in seen]
            assert bases == [0, *(end for _how, _base, end in seen[:-1])]  # each once, in order
            assert seen[:2] == [("queue", 0, 2), ("queue", 2, 5)]


async def test_read_back_catching_up_while_a_commit_lands_loses_nothing(tmp_path, monkeypatch):
    """An output reading back from the journal must not declare itself caught up on a read
    that missed a commit which finished meanwhile: that batch was passed over while it was
    lagging, and it would never come (a silent gap for that output)."""
    async with Hub(_config(tmp_path, inline_commit_max_ms=1000)) as hub:
        real = hub.journal.read_batches
        reading, go_on = threading.Event(), threading.Event()

        def read_batches(start, *args, **kwargs):  # the read-back's thread
            found = list(itertools.islice(real(start, *args, **kwargs), 1))
            if not found and not go_on.is_set():
                reading.set()  # found nothing: a commit lands before the loop hears it
                go_on.wait(30)
            return iter(found)

        monkeypatch.setattr(hub.journal, "read_batches", read_batches)
        sub = hub.subscribe("small", maxsize=1)
        seen: list[tuple[int, int]] = []

        async def iterate() -> None:
            async for b in sub:
                seen.append((b.base_offset, b.end_offset))

        consumer = asyncio.ensure_future(iterate())
        while sub._waiter is None:
            await asyncio.sleep(0.01)
        # one group of two batches: the second overflows the queue, the output reads back
        await asyncio.gather(hub.ingest(_batch(1, "a")), hub.ingest(_batch(1, "b")))
        while not reading.is_set():
            await asyncio.sleep(0.01)
        third = await hub.ingest(_batch(1, "c"))  # committed and offered while it reads
        go_on.set()
        deadline = asyncio.get_running_loop().time() + 30
        while len(seen) < 3 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        consumer.cancel()
        assert seen == [(0, 1), (1, 2), (2, third.end_offset)]
