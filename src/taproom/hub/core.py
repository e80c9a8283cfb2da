"""The hub: one ingest API for every protocol, commit-then-ack, committed-tail fan-out.

Protocol servers hand in :class:`~taproom.records.EncodedBatch` objects and await the
:class:`Commit` that says they are durable; only then do they acknowledge their senders.
A single commit thread owns the journal's write side and turns everything that queued up while
the previous fsync ran into one write and one fsync (group commit).

Fan-out reads committed data only. Each output has a bounded queue; an output that falls behind
is not allowed to slow ingest: its queue is abandoned and it reads back from the journal until it
has caught up (counted as a lag), or, for outputs created ``lossy``, the batches are dropped and
counted.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ..budget import MemoryBudget
from ..config import Config, load_config
from ..errors import DiskFull, HubStopped, JournalError, JournalFailed
from ..journal import CursorStore, Journal
from ..metrics import Metrics
from ..records import EncodedBatch, Record, decode_batch
from ..supervise import Supervisor

__all__ = ["Commit", "CommittedBatch", "Hub", "OnCommit", "Subscription"]

log = logging.getLogger("taproom.hub")

# Commit latency buckets (seconds): fsync on SSDs is 0.1-5 ms, on cloud disks up to ~50 ms.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


@dataclass(frozen=True, slots=True)
class Commit:
    """A durable batch: offsets ``first_offset`` .. ``first_offset + count - 1``."""

    first_offset: int
    count: int

    @property
    def end_offset(self) -> int:
        return self.first_offset + self.count


class CommittedBatch:
    """One committed batch as outputs see it; records are decoded once, on first use."""

    __slots__ = ("_records", "base_offset", "body", "count", "queued")

    def __init__(self, base_offset: int, count: int, body: bytes) -> None:
        self.base_offset = base_offset
        self.count = count
        self.body = body
        self._records: list[Record] | None = None
        # Output queues holding it: its body is charged to the budget's output_queues holder
        # once, while any queue holds it (the outputs share one body).
        self.queued = 0

    @property
    def end_offset(self) -> int:
        return self.base_offset + self.count

    def records(self) -> list[Record]:
        if self._records is None:
            self._records = decode_batch(self.body, self.base_offset)
        return self._records


# Called on the hub's loop once a batch is durable (its Commit, None) or refused (None, the
# error): :meth:`Hub.submit_callback`.
OnCommit = Callable[["Commit | None", "BaseException | None"], None]


@dataclass(slots=True)
class _Pending:
    batch: EncodedBatch
    # Exactly one of the two is set: the future submit() returned, or submit_callback's
    # callback, called directly where the future would be resolved.
    future: asyncio.Future[Commit] | None
    callback: OnCommit | None
    loop: asyncio.AbstractEventLoop
    submitted: float
    waiter: object = None  # its reservation in the pending holder while it waits for room

    @property
    def size(self) -> int:
        return len(self.batch.body)


class Subscription:
    """Committed batches for one output, in offset order, without gaps unless ``lossy``.

    Iterate with ``async for batch in subscription``. ``maxsize`` bounds the in-memory queue.
    """

    def __init__(self, hub: Hub, name: str, from_offset: int, maxsize: int, lossy: bool) -> None:
        self.hub = hub
        self.name = name
        self.lossy = lossy
        self.next_offset = from_offset
        self._queue: asyncio.Queue[CommittedBatch] = asyncio.Queue(maxsize)
        self._lagging = from_offset < hub.journal.end_offset
        self.closed = False
        # The consumer waiting for the next batch (one future, woken by _offer and close):
        # cheaper per batch than waiting on the queue and the hub's stop together.
        self._waiter: asyncio.Future[None] | None = None
        # consume_directly's consumer: called by the hub itself while the output is caught up.
        self._direct: Callable[[CommittedBatch], None] | None = None
        m = hub.metrics
        self._m_lag = m.counter(
            "hub",
            "output_lagged",
            "events",
            "Times an output fell behind and read back from the journal",
            ("output",),
        ).labels(output=name)
        self._m_drop = m.counter(
            "hub",
            "output_dropped",
            "events",
            "Events an output never got: lossy and behind, deleted by retention, or lost in the journal",
            ("output",),
        ).labels(output=name)
        m.gauge(
            "hub", "output_queue", "batches", "Committed batches waiting per output", ("output",)
        ).labels(output=name).set_function(self._queue.qsize)

    def consume_directly(self, consume: Callable[[CommittedBatch], None]) -> None:
        """Have the hub call ``consume(batch)`` itself, from the commit's delivery (after the
        acks), with each batch that comes while this output is caught up: its queue empty,
        not reading back, and its consumer parked waiting for the next batch. No queue, no
        future, no task woken (issue 32: one request in flight paid a turn of the loop per
        output). Otherwise batches go through the queue as before, in the same order: the
        iterator and ``consume`` never both have one. ``consume`` runs on the loop, must be
        quick and must not raise (it counts its own failures, as the iterator's loop does)."""
        self._direct = consume

    def _offer(self, batch: CommittedBatch) -> None:
        """Called on the hub's loop after each commit. The queue is bounded in batches and,
        with the other outputs' queues, in bytes (the budget's ``output_queues``): past either
        bound a lossy output drops and counts, the others read back from the journal."""
        if self.closed or self._lagging:
            return
        direct, waiter = self._direct, self._waiter
        if (
            direct is not None
            and waiter is not None
            and not waiter.done()
            and self._queue.empty()
            and self.next_offset <= batch.base_offset
        ):
            self.next_offset = batch.end_offset
            direct(batch)
            return
        holder = self.hub._output_queues
        if self._queue.full() or (not batch.queued and not holder.try_reserve(len(batch.body))):
            if self.lossy:
                self._m_drop.inc(batch.count)  # the consumer sees a gap in offsets
                return
            self._m_lag.inc()
            self._lagging = True  # read from the journal from next_offset on
            self._wake()  # the consumer reads back from the journal
            return
        batch.queued += 1
        self._queue.put_nowait(batch)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _taken(self, batch: CommittedBatch) -> CommittedBatch:
        """``batch`` left this queue: its bytes are free once no queue holds it."""
        batch.queued -= 1
        if not batch.queued:
            self.hub._output_queues.release(len(batch.body))
        return batch

    async def __anext__(self) -> CommittedBatch:
        while True:
            if self.closed:
                raise StopAsyncIteration
            if not self._queue.empty():
                batch = self._taken(self._queue.get_nowait())
                if batch.end_offset <= self.next_offset:
                    continue  # already delivered from the journal while catching up
                self.next_offset = batch.end_offset
                return batch
            if self._lagging:
                batch_or_none = await self._read_back()
                if batch_or_none is not None:
                    self.next_offset = batch_or_none.end_offset
                    return batch_or_none
                continue
            if self.hub._stopped.is_set():
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter  # a batch offered, lagging, or closed (the hub stops)
            finally:
                self._waiter = None

    async def _read_back(self) -> CommittedBatch | None:
        """The next batch from the journal, or None once caught up with the live queue."""
        journal = self.hub.journal
        start = self.next_offset
        if start < journal.first_offset:
            # Retention deleted what this output had not read: count it, move on.
            self._m_drop.inc(journal.first_offset - start)
            start = self.next_offset = journal.first_offset

        def one() -> tuple[int, int, bytes] | None:
            for item in journal.read_batches(start):
                return item
            return None

        end_before = journal.end_offset
        item = await asyncio.to_thread(one)
        if item is None:
            if journal.end_offset != end_before:
                # A commit finished while the thread read: it may have been offered (and
                # passed over, lagging) after the read missed it. Read again, or it is lost.
                return None
            # Caught up. Drain the stale queue so the live path starts after next_offset.
            while not self._queue.empty():
                b = self._queue.get_nowait()
                if b.end_offset > self.next_offset:
                    self._queue.put_nowait(b)
                    break
                self._taken(b)
            self._lagging = False
            return None
        base, count, body = item
        if base > start:
            # Offsets the journal quarantined (or that are in no segment): a counted gap.
            self._m_drop.inc(base - start)
        batch = CommittedBatch(base, count, body)
        if base < start:  # the subscription started inside this batch: trim the front
            records = [r for r in batch.records() if r.offset >= start]
            batch._records = records
        return batch

    def __aiter__(self) -> AsyncIterator[CommittedBatch]:
        return self

    def close(self) -> None:
        self.closed = True
        self.hub._subscriptions.discard(self)
        while not self._queue.empty():
            self._taken(self._queue.get_nowait())
        self._wake()


class Hub:
    """Owns the journal, the commit thread and the outputs' subscriptions.

    Use as ``async with Hub(config) as hub`` or call :meth:`start` / :meth:`stop`.
    """

    def __init__(self, config: Config | None = None, *, metrics: Metrics | None = None) -> None:
        self.config = config or load_config()
        self.metrics = metrics or Metrics()
        jc = self.config.journal
        self.journal = Journal(
            jc.dir,
            fsync=jc.fsync,
            segment_bytes=jc.segment_bytes,
            cache_keep_bytes=jc.cache_keep_bytes,
            metrics=self.metrics,
        )
        self.cursors = CursorStore(jc.dir)
        # The process-wide memory budget (taproom.budget); what is admitted to the commit queue
        # and not yet committed and acked is its "pending" holder.
        self.budget = MemoryBudget(self.config, self.metrics)
        self._pending = self.budget.holder("pending")
        self._output_queues = self.budget.holder("output_queues")
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._pending_lock = threading.Lock()
        # Submitted while there was no room: each holds a place in the pending holder's FIFO
        # and is admitted when that reservation is granted (loop only).
        self._waiting: deque[_Pending] = deque()
        self._waiting_bytes = 0
        self._capacity = asyncio.Event()
        self._capacity.set()
        self._pending.on_change(self._update_capacity)
        self._subscriptions: set[Subscription] = set()
        self._stopped = asyncio.Event()
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.last_commit_at = time.monotonic()
        self.oldest_pending_since: float | None = None
        self.journal_problem: str | None = None
        # Every loop that reads a socket or a queue is supervised (taproom.supervise); the
        # services reach the one table through the hub.
        self.supervisor = Supervisor(self.config.hub, self.metrics)
        self._deliver_guard = self.supervisor.guard("hub.deliver", output="hub")
        # The group the commit thread holds, kept here so a restarted thread retries it.
        self._in_hand: list[_Pending] = []
        # Inline commits (docs/architecture.md, "Commits on the loop"): a small group admitted
        # while the commit thread has nothing in hand is written and fsynced by the loop itself,
        # which saves the two thread hand-offs and wakeups that cost more CPU than the fsync.
        hc = self.config.hub
        self._inline_max_bytes = hc.inline_commit_max_bytes
        self._inline_max_s = hc.inline_commit_max_ms / 1000
        self._inline: list[_Pending] = []  # admitted this loop iteration, committed at its end
        self._inline_bytes = 0
        # The loop's handle of the scheduled _commit_inline, which commit_now may take back.
        self._inline_handle: asyncio.Handle | None = None
        self._in_thread = 0  # batches handed to the commit thread and not yet delivered (loop)
        self._write_lock = threading.Lock()  # the journal's write side: commit thread or loop
        self._small_commit_s = 0.0  # recent write + fsync time of small groups (moving average)
        self._commit_stopping = False  # the stop sentinel was taken (survives a restart)
        m = self.metrics
        # Tallies (taproom.metrics): counted once a commit, by its committer, and commits never
        # overlap (the loop commits inline only while the commit thread holds nothing).
        self._m_commits = m.tally("hub", "commits", "calls", "Group commits (one write + fsync)")
        self._m_inline = m.tally(
            "hub", "inline_commits", "calls", "Group commits the loop made itself (small, idle)"
        )
        self._m_batches = m.tally("hub", "committed", "batches", "Batches committed")
        self._m_latency = m.tally_histogram(
            "hub", "commit_latency", "seconds", "Submit to durable, per batch", _LATENCY_BUCKETS
        )
        self._m_failures = m.counter(
            "hub", "commit_failures", "events", "Commit attempts that failed", ("reason",)
        )
        m.gauge_fn(
            "hub",
            "pending",
            "bytes",
            "Accepted, not yet committed and acked",
            lambda: self._pending.used,
        )
        m.gauge_fn(
            "hub",
            "admission_waiting",
            "bytes",
            "Submitted without room under max_pending_bytes, waiting to be admitted",
            lambda: self._waiting_bytes,
        )
        self._m_held = m.counter(
            "hub",
            "admission_held",
            "batches",
            "Batches that waited for room under max_pending_bytes before being admitted",
        )
        self._m_backpressure = m.counter(
            "hub", "backpressure_waits", "calls", "Times a server waited for commit capacity"
        )

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> Hub:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(
            target=self._commit_thread, name="taproom-commit", daemon=True
        )
        self._thread.start()
        return self

    async def stop(self) -> None:
        """Stop taking ingest, commit what is queued, stop the commit thread, close outputs."""
        self._accepting = False
        self._grace_deadline = time.monotonic() + self.config.hub.grace_period_s
        # Batches waiting for room were accepted by submit(): they go in as commits free room,
        # within the grace period; what is still waiting then is refused.
        while self._waiting and self._thread is not None and not self._grace_expired():
            await asyncio.sleep(0.01)
        while self._waiting:
            held = self._waiting.popleft()
            self._pending.cancel(held.waiter)
            _refuse(held, HubStopped("the hub stopped before room"))
        self._waiting_bytes = 0
        # An inline group still to come is committed now, so that one it hands to the commit
        # thread (a failure) reaches the thread before the stop sentinel does.
        self._commit_inline()
        if self._thread is not None:
            self._queue.put(None)
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self._stopped.set()
        for sub in list(self._subscriptions):
            sub.close()
        self.journal.close()

    async def __aenter__(self) -> Hub:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- ingest ---------------------------------------------------------------------------

    def submit(self, batch: EncodedBatch, *, reserved: bool = False) -> asyncio.Future[Commit]:
        """Queue ``batch`` for a group commit; the future resolves once durable.

        Never blocks. ``hub.max_pending_bytes`` (the budget's ``pending`` holder) is a hard
        bound on what is admitted to the commit queue: a batch that does not fit waits, in
        submission order, until commits make room (a batch larger than the bound is admitted
        alone). Servers call :meth:`wait_capacity` (or :meth:`ingest`) before reading more from
        their sockets, so what waits stays one batch per server.

        ``reserved=True``: the caller already holds ``len(batch.body)`` bytes of the pending
        holder for this batch (it reserved them before building it); the hub takes that
        reservation over and releases it once the batch is committed and acked.
        """
        if not self._accepting:
            raise HubStopped("the hub is shutting down")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Commit] = loop.create_future()
        if batch.count == 0:
            future.set_result(Commit(self.journal.end_offset, 0))
            return future
        self._enqueue(_Pending(batch, future, None, loop, time.monotonic()), reserved)
        return future

    def submit_callback(
        self, batch: EncodedBatch, callback: OnCommit, *, reserved: bool = False
    ) -> None:
        """:meth:`submit` without a future: ``callback(commit, None)`` is called on the loop
        as soon as ``batch`` is durable (from the commit's own delivery, before the outputs
        are fed), or ``callback(None, error)`` if it is refused (shutdown). No future to
        resolve and no callback to schedule: a server writes its acks in the same loop
        iteration as the commit (issue 32, one request in flight). An exception escaping
        ``callback`` is counted (``hub.deliver``) and costs nothing else."""
        if not self._accepting:
            raise HubStopped("the hub is shutting down")
        loop = asyncio.get_running_loop()
        if batch.count == 0:
            loop.call_soon(callback, Commit(self.journal.end_offset, 0), None)
            return
        self._enqueue(_Pending(batch, None, callback, loop, time.monotonic()), reserved)

    def _enqueue(self, pending: _Pending, reserved: bool) -> None:
        if reserved or self._pending.try_reserve(pending.size):
            self._admit(pending)
        else:
            self._m_held.inc()
            self._waiting.append(pending)
            self._waiting_bytes += pending.size
            pending.waiter = self._pending.wait(pending.size, self._admit_waiting)
        self._update_capacity()

    def _admit(self, pending: _Pending) -> None:
        """Into the next group commit; its room in the pending holder is already taken.

        The group goes inline (committed by the loop at the end of this iteration) while the
        commit thread has nothing in hand, the group is small and recent small commits were
        quick; otherwise to the commit thread, behind anything already there (submit order)."""
        with self._pending_lock:
            if self.oldest_pending_since is None:
                self.oldest_pending_since = time.monotonic()
        if (
            not self._in_thread
            and self._inline_bytes + pending.size <= self._inline_max_bytes
            and self._small_commit_s <= self._inline_max_s
            and self._accepting
            and self._loop is not None
        ):
            if not self._inline:
                self._inline_handle = self._loop.call_soon(self._commit_inline)
            self._inline.append(pending)
            self._inline_bytes += pending.size
            return
        if self._inline:  # commit order is admission order: the inline group goes first
            group, self._inline, self._inline_bytes = self._inline, [], 0
            self._to_thread(group)
        self._to_thread([pending])

    def _to_thread(self, group: list[_Pending]) -> None:
        self._in_thread += len(group)
        for pending in group:
            self._queue.put(pending)

    def commit_now(self) -> bool:
        """Called by a server on the loop when it has nothing more to submit for now (about to
        wait for its socket): a lone request (the inline group is one batch of one event)
        waiting for its commit is committed here, in this turn of the loop, if that commit is
        the only callback the loop has left to run in it. That is the group a commit at the
        start of the next turn would take, one turn of the loop sooner: a sender with one
        request in flight saves a turn (a ``select`` and the loop's bookkeeping) per request
        (issue 32). Anything else ready in this turn (another connection's read, a task woken)
        may still submit, so the commit stays scheduled and the group batches as before; so
        does a larger group (under load a committed-at-once small burst made the loop wait on
        fsyncs the commit thread would have shared: the logjam bench's hub made 288 of 593
        commits inline against 5 of 329) and a commit handed to the commit thread. True if it
        committed here.

        The loop's ready queue is asyncio's own (``BaseEventLoop._ready``, unchanged since
        Python 3.4); on a loop without one this does nothing."""
        handle = self._inline_handle
        group = self._inline
        if handle is None or len(group) != 1 or group[0].batch.count != 1:
            return False
        ready = getattr(self._loop, "_ready", None)
        if not isinstance(ready, deque) or len(ready) != 1 or ready[0] is not handle:
            return False
        ready.pop()
        self._commit_inline()
        return True

    def _commit_inline(self) -> None:
        """On the loop, at the end of the iteration that admitted the group (or in it:
        :meth:`commit_now`): one write and one fsync, then the acks at once. Anything unusual
        (the commit thread took work meanwhile, a journal failure, a bug) hands the group to
        the commit thread, which owns retries, failure reporting and supervision: the
        journal's commit is all or nothing, so the same offsets are handed out again there."""
        group, nbytes = self._inline, self._inline_bytes
        self._inline, self._inline_bytes = [], 0
        self._inline_handle = None
        if not group:
            return
        if self._in_thread or not self._write_lock.acquire(blocking=False):
            self._to_thread(group)
            return
        try:
            started = time.monotonic()
            bases = self.journal.commit([p.batch for p in group])
        except Exception as exc:
            self._write_lock.release()
            if isinstance(exc, (DiskFull, JournalFailed, JournalError, OSError)):
                reason = "disk_full" if isinstance(exc, DiskFull) else "journal_failed"
                self._m_failures.labels(reason=reason).inc(len(group))
            self._to_thread(group)
            return
        self._write_lock.release()
        now = time.monotonic()
        self._committed(group, now, now - started, nbytes)
        self._m_inline.inc()
        self._deliver(group, bases, nbytes)

    def _admit_waiting(self) -> None:
        """The pending holder granted the oldest waiting batch its room (FIFO: the grants
        come in the order the waits were queued)."""
        pending = self._waiting.popleft()
        self._waiting_bytes -= pending.size
        pending.waiter = None
        self._admit(pending)

    def _update_capacity(self) -> None:
        if self.has_capacity:
            self._capacity.set()
        else:
            self._capacity.clear()

    async def ingest(self, batch: EncodedBatch) -> Commit:
        """Wait for capacity, submit, and wait until ``batch`` is durable."""
        await self.wait_capacity()
        return await self.submit(batch)

    async def wait_capacity(self) -> None:
        """Return when the hub can take more; servers stop reading sockets while this waits."""
        if self.has_capacity:
            return
        self._m_backpressure.inc()
        while not self.has_capacity:
            self._capacity.clear()
            await self._capacity.wait()

    @property
    def has_capacity(self) -> bool:
        """True while nothing waits for room and admitted bytes are under the bound."""
        pending = self._pending
        return not pending.waiting and pending.used < pending.bound

    # --- commit thread --------------------------------------------------------------------

    def _commit_thread(self) -> None:
        """The commit loop, supervised: an exception escaping it (a bug: the journal's own
        failures are handled inside) is logged and counted, shows on /ready, and the loop
        starts again with the group it held, so nothing queued is lost or acked early."""
        backoff = 0.1
        while True:
            self.supervisor.running("hub.commit")
            try:
                self._commit_loop()
                return
            except Exception as exc:
                self.supervisor.died("hub.commit", exc)
            time.sleep(backoff)
            backoff = min(backoff * 2, self.config.hub.loop_restart_max_s)

    def _commit_loop(self) -> None:
        jc = self.config.journal
        max_bytes = jc.max_commit_bytes
        carry: list[_Pending] = self._in_hand
        stopping = self._commit_stopping
        last_sync = time.monotonic()
        last_retention = 0.0
        interval = jc.fsync_interval_ms / 1000
        while True:
            group = carry
            carry = []
            if not group and not stopping:
                timeout = interval if jc.fsync != "always" else 1.0
                try:
                    item = self._queue.get(timeout=timeout)
                except queue.Empty:
                    item = None
                    self._housekeeping(last_retention)
                    if jc.fsync == "interval":
                        self._sync_quietly()
                    continue
                if item is None:
                    stopping = self._commit_stopping = True
                else:
                    group.append(item)
            nbytes = sum(len(p.batch.body) for p in group)
            while nbytes < max_bytes:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = self._commit_stopping = True
                    continue
                group.append(item)
                nbytes += len(item.batch.body)
            if not group:
                if stopping:
                    self._sync_quietly()
                    return
                continue
            self._in_hand = group
            try:
                with self._write_lock:
                    started = time.monotonic()
                    bases = self.journal.commit([p.batch for p in group])
            except (DiskFull, JournalFailed, JournalError, OSError) as exc:
                reason = "disk_full" if isinstance(exc, DiskFull) else "journal_failed"
                self._m_failures.labels(reason=reason).inc(len(group))
                self.journal_problem = str(exc)
                log.error("commit failed (%s); holding %d batches, acks paused", exc, len(group))
                carry = group
                time.sleep(0.5)  # retry the same batches; senders stay un-acked meanwhile
                if self._shutdown_due(stopping):
                    # Shutting down and still not writable: these batches were never acked,
                    # so their senders resend them; refuse them now, within the grace period.
                    self._give_up(group, exc)
                    carry = []
                    if stopping:
                        return
                continue
            self.journal_problem = None
            self._in_hand = []
            now = time.monotonic()
            if jc.fsync == "interval" and now - last_sync >= interval:
                self._sync_quietly()
                last_sync = now
            self._committed(group, now, now - started, nbytes)
            assert self._loop is not None
            # The batches stay counted in pending bytes until _deliver: until then the loop
            # still holds their bodies (acks and outputs), so room made here would let the
            # loop admit more while they are in memory, past max_pending_bytes.
            self._loop.call_soon_threadsafe(self._deliver_from_thread, group, bases, nbytes)
            if time.monotonic() - last_retention > 10:
                last_retention = self._housekeeping(last_retention)

    def _committed(self, group: list[_Pending], now: float, seconds: float, nbytes: int) -> None:
        """Bookkeeping of a group commit, on whichever thread made it."""
        self.last_commit_at = now
        if nbytes <= self._inline_max_bytes:
            self._small_commit_s += (seconds - self._small_commit_s) / 4
        self._m_commits.inc()
        self._m_batches.inc(len(group))
        for p in group:
            self._m_latency.observe(now - p.submitted)
        with self._pending_lock:
            self.oldest_pending_since = None if self._queue.empty() else now

    _grace_deadline: float | None = None
    # Set by begin_shutdown (taproom serve, at the signal): when unwritable batches are given up.
    _shutdown_deadline: float | None = None
    unwritten_batches = 0  # given up at shutdown because the journal was not writable
    unwritten_events = 0

    def begin_shutdown(self, give_up_at: float) -> None:
        """Shutdown began (a signal): batches the journal still cannot take (disk full) are
        refused at ``give_up_at`` (monotonic), leaving the rest of the grace period for the
        services to stop, instead of being retried until it runs out."""
        self._shutdown_deadline = give_up_at

    def _grace_expired(self) -> bool:
        if self._grace_deadline is None:
            self._grace_deadline = time.monotonic() + self.config.hub.grace_period_s
        return time.monotonic() >= self._grace_deadline

    def _shutdown_due(self, stopping: bool) -> bool:
        """Time to give up on batches the journal cannot take: past begin_shutdown's deadline,
        or (in-process stop) the stop sentinel came and the grace period ran out."""
        deadline = self._shutdown_deadline
        if deadline is not None and time.monotonic() >= deadline:
            return True
        return stopping and not self._accepting and self._grace_expired()

    def _give_up(self, group: list[_Pending], exc: Exception) -> None:
        """Refuse ``group`` (never acked: the senders resend it) and count it for the exit."""
        self.unwritten_batches += len(group)
        self.unwritten_events += sum(p.batch.count for p in group)
        self._fail_all(group, HubStopped(f"journal not writable at shutdown: {exc}"))
        self._in_hand = []

    def _fail_all(self, group: list[_Pending], exc: Exception) -> None:
        for p in group:
            p.loop.call_soon_threadsafe(_refuse, p, exc)

    def _sync_quietly(self) -> None:
        try:
            with self._write_lock:
                self.journal.sync()
        except JournalError as exc:
            self.journal_problem = str(exc)

    def _housekeeping(self, last: float) -> float:
        jc = self.config.journal
        if jc.retention_bytes or jc.retention_age_s:
            try:
                with self._write_lock:  # the loop may commit inline meanwhile
                    self.journal.enforce_retention(
                        jc.retention_bytes,
                        jc.retention_age_s,
                        unread=self.cursors.offsets() if jc.retain_unread else None,
                        unread_max_bytes=jc.retain_unread_max_bytes,
                    )
            except OSError as exc:
                log.warning("retention failed: %s", exc)
        return time.monotonic()

    def _deliver_from_thread(self, group: list[_Pending], bases: list[int], nbytes: int) -> None:
        self._in_thread -= len(group)
        self._deliver(group, bases, nbytes)

    def _deliver(self, group: list[_Pending], bases: list[int], nbytes: int) -> None:
        """On the loop: resolve futures first (acks), then free the batches' room and feed
        outputs."""
        for p, base in zip(group, bases, strict=True):
            future = p.future
            if future is not None:
                if not future.done():
                    future.set_result(Commit(base, p.batch.count))
                continue
            assert p.callback is not None
            try:
                p.callback(Commit(base, p.batch.count), None)
            except Exception as exc:  # one server's bug never costs the other acks
                self._deliver_guard.failed(exc, "commit callback")
        # Admits waiting batches (and grants other reservations) in FIFO order as room frees;
        # the capacity event follows (on_change).
        self._pending.release(nbytes)
        if self._subscriptions:
            for p, base in zip(group, bases, strict=True):
                committed = CommittedBatch(base, p.batch.count, p.batch.body)
                for sub in list(self._subscriptions):
                    try:
                        sub._offer(committed)
                    except Exception as exc:
                        # One output's bug never costs the acks or the other outputs; that
                        # output reads this batch back from the journal instead.
                        self._deliver_guard.failed(exc, f"committed batch for {sub.name}")
                        sub._lagging = True
                        sub._wake()

    # --- outputs --------------------------------------------------------------------------

    def subscribe(
        self,
        name: str,
        *,
        from_offset: int | None = None,
        maxsize: int | None = None,
        lossy: bool = False,
    ) -> Subscription:
        """Committed batches from ``from_offset`` (default: only new ones) onward."""
        start = self.journal.end_offset if from_offset is None else from_offset
        sub = Subscription(
            self, name, start, maxsize or self.config.hub.output_queue_batches, lossy
        )
        self._subscriptions.add(sub)
        return sub

    def outputs(self) -> list[Subscription]:
        """The outputs subscribed now (each with its ``name`` and ``next_offset``)."""
        return list(self._subscriptions)

    # --- health ---------------------------------------------------------------------------

    def readiness(self) -> list[str]:
        """Reasons the hub is not ready; empty when it is."""
        reasons = []
        problem = self.journal_problem or self.journal.failed
        if problem:
            # Set by the first failed commit: senders are not being acked from then on.
            reasons.append(f"acks paused, journal not writable: {problem}")
        since = self.oldest_pending_since
        if since is not None and time.monotonic() - since > self.config.hub.stall_after_s:
            reasons.append(f"commit loop stalled for {time.monotonic() - since:.1f}s")
        if self._thread is None or not self._thread.is_alive():
            reasons.append("commit thread not running")
        reasons += self.supervisor.readiness()
        return reasons

    def degraded(self) -> list[str]:
        """What an operator must know that does not stop the hub serving: journal damage that
        was quarantined (its events are lost; everything else is served), and supervised loops
        that died and are not back yet."""
        return self.journal.damage_summary() + self.supervisor.degraded()


def _refuse(pending: _Pending, exc: Exception) -> None:
    """Refuse a batch at shutdown. Its server may be gone already, so a future's exception is
    marked retrieved: an unacked batch at shutdown is expected (its sender resends it), not a
    "Future exception was never retrieved" traceback at exit."""
    future = pending.future
    if future is None:
        assert pending.callback is not None
        try:
            pending.callback(None, exc)
        except Exception:
            log.exception("commit callback failed on a refused batch")
        return
    if not future.done():
        future.set_exception(exc)
        future.exception()
