"""Supervision: one poison message never stops a loop, and a loop that dies comes back.

Every loop that reads from a socket or a queue (each protocol's ingest loops, the outputs, the
Event BUS and Lager services, the web tail, the commit thread's hand-off) uses two layers, both
from the hub's one :class:`Supervisor` (``hub.supervisor``):

1. **Per message** (:class:`Guard`). The loop catches an unexpected exception around the work
   for one message (or one batch) and hands it to :meth:`Guard.failed`, which counts it
   (``reason="internal_error"``: ``taproom_ingest_rejected_items_total{protocol}`` for ingest,
   ``taproom_hub_output_errors_items_total{output}`` for outputs), logs it with its traceback
   (once per ``hub.error_log_interval_s`` per loop, then how many were not logged), and
   returns; the loop refuses that message with the protocol's own refusal where it has one and
   goes on with the next, so valid messages around it are kept::

       for msg in burst:
           try:
               handle(msg)
           except Exception as exc:
               guard.failed(exc, "COLLECTOR message")
               refuse(msg)          # the protocol's own refusal, where it has one
               continue

   Hot loops write the ``try``/``except`` inline (free in CPython 3.11 until something
   raises); others may call :meth:`Guard.call`, which returns :data:`FAILED` instead.

2. **Per loop** (:meth:`Supervisor.spawn`). The loop runs in a task; an exception that still
   escapes it (a bug outside any guard) is logged with its traceback, counted
   (``taproom_hub_loop_restarts_calls_total{loop}``) and the loop is started again after a
   backoff (0.1 s, doubling up to ``hub.loop_restart_max_s``). ``/ready`` lists the loop under
   ``degraded`` with when and why it died until it has run ``hub.loop_settle_s`` again (it is
   back); a loop that died ``hub.loop_death_limit`` times within ``hub.loop_death_window_s``
   makes ``/ready`` 503 until it has stayed up that long. A loop that returns, is cancelled or
   meets :class:`~taproom.errors.HubStopped` (shutdown) ends without a restart.

   Threads (the commit thread) report to the same table with :meth:`Supervisor.died` and
   :meth:`Supervisor.running`.

Loop names are fixed in the code (``"eventbus.collector"``, ``"logjam.router"``, ...), so they
are a bounded label set.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, TypeVar

from .errors import HubStopped

if TYPE_CHECKING:
    from .config import HubConfig
    from .metrics import Metrics

__all__ = ["FAILED", "Guard", "LoopStatus", "Supervisor"]

log = logging.getLogger("taproom.supervise")

T = TypeVar("T")


class _Failed:
    __slots__ = ()

    def __repr__(self) -> str:
        return "FAILED"


FAILED: Final = _Failed()
"""What :meth:`Guard.call` returns when the call raised (and was counted and logged)."""

# The first restart waits this long; each death in a row doubles it, up to loop_restart_max_s.
_FIRST_BACKOFF_S = 0.1


class Guard:
    """Per-message supervision of one loop: count, log (rate-limited), go on."""

    __slots__ = ("_count", "_interval", "_log", "_next_log", "_suppressed", "errors", "loop")

    def __init__(
        self, loop: str, count: Callable[[int], None], interval: float, logger: logging.Logger
    ) -> None:
        self.loop = loop
        self._count = count
        self._interval = interval
        self._log = logger
        self._next_log = 0.0
        self._suppressed = 0
        self.errors = 0  # unexpected exceptions handled by this guard, for tests and tools

    def failed(self, exc: BaseException, what: str = "message", items: int = 1) -> None:
        """One message (or a batch of ``items``) failed with ``exc``: count and log it.

        The caller refuses what failed and goes on with its loop.
        """
        self.errors += 1
        self._count(items)
        now = time.monotonic()
        if now < self._next_log:
            self._suppressed += 1
            return
        self._next_log = now + self._interval
        more = f" ({self._suppressed} more since the last one logged)" if self._suppressed else ""
        self._suppressed = 0
        self._log.error(
            "%s: internal error handling a %s; refused it, the loop goes on%s",
            self.loop,
            what,
            more,
            exc_info=(type(exc), exc, exc.__traceback__),
        )

    def call(self, fn: Callable[..., T], *args: Any, what: str = "message") -> T | _Failed:
        """``fn(*args)``, or :data:`FAILED` after :meth:`failed` when it raised."""
        try:
            return fn(*args)
        except Exception as exc:
            self.failed(exc, what)
            return FAILED


@dataclass(slots=True)
class LoopStatus:
    """One supervised loop's deaths, for ``/ready`` and the console."""

    name: str
    deaths: deque[float] = field(default_factory=deque)  # monotonic times within the window
    total_deaths: int = 0
    last_death_at: float = 0.0  # wall clock (time.time()) of the last death
    last_error: str = ""
    running_since: float | None = None  # monotonic; None while down

    def describe(self) -> str:
        when = datetime.fromtimestamp(self.last_death_at, UTC).isoformat(timespec="seconds")
        state = "restarting" if self.running_since is None else "restarted"
        return f"loop {self.name} died at {when} ({self.last_error}); {state}"


class Supervisor:
    """The table of supervised loops and the guards that count their bad messages."""

    def __init__(self, config: HubConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.loops: dict[str, LoopStatus] = {}
        self._m_restarts = metrics.counter(
            "hub",
            "loop_restarts",
            "calls",
            "Supervised loops that died (an exception escaped them) and were started again",
            ("loop",),
        )

    # --- per message ------------------------------------------------------------------------

    def guard(
        self,
        loop: str,
        *,
        protocol: str | None = None,
        output: str | None = None,
        logger: logging.Logger | None = None,
    ) -> Guard:
        """A guard for ``loop``, counting into ingest rejections of ``protocol`` or into the
        errors of output ``output`` (exactly one of them)."""
        if (protocol is None) == (output is None):
            raise ValueError("a guard counts for a protocol or for an output")
        if protocol is not None:
            counter = self.metrics.counter(
                "ingest",
                "rejected",
                "items",
                "Frames, messages or connections refused, by reason",
                ("protocol", "reason"),
            ).labels(protocol=protocol, reason="internal_error")
        else:
            counter = self.metrics.counter(
                "hub",
                "output_errors",
                "items",
                "Committed batches or events an output skipped after an internal error",
                ("output", "reason"),
            ).labels(output=output, reason="internal_error")
        return Guard(loop, counter.inc, self.config.error_log_interval_s, logger or log)

    # --- per loop ---------------------------------------------------------------------------

    def spawn(
        self,
        loop: str,
        factory: Callable[[], Awaitable[None]],
        *,
        first: Awaitable[None] | None = None,
    ) -> asyncio.Task[None]:
        """Run ``await factory()`` in a task, starting it again whenever it dies.

        ``first``: an awaitable already made to run the first time (a coroutine that had to
        set something up at once, such as a socket monitor); ``factory`` makes the next ones.
        """
        task = asyncio.create_task(self._run(loop, factory, first), name=loop)
        if first is not None and inspect.iscoroutine(first):
            coroutine = first

            def close_unstarted(_task: asyncio.Task[None]) -> None:
                # Cancelled before it ever ran: closed, so no "never awaited" warning.
                if inspect.getcoroutinestate(coroutine) == inspect.CORO_CREATED:
                    coroutine.close()

            task.add_done_callback(close_unstarted)
        return task

    async def _run(
        self, loop: str, factory: Callable[[], Awaitable[None]], first: Awaitable[None] | None
    ) -> None:
        backoff = _FIRST_BACKOFF_S
        while True:
            self.running(loop)
            started = time.monotonic()
            try:
                if first is not None:
                    run, first = first, None
                    await run
                else:
                    await factory()
                return
            except HubStopped:
                return
            except Exception as exc:
                self.died(loop, exc)
            if time.monotonic() - started >= self.config.loop_settle_s:
                backoff = _FIRST_BACKOFF_S  # it had been fine for a while: a fresh start
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.loop_restart_max_s)

    def running(self, loop: str) -> None:
        """``loop`` is (again) running."""
        status = self.loops.get(loop)
        if status is None:
            status = self.loops[loop] = LoopStatus(loop)
        status.running_since = time.monotonic()

    def died(self, loop: str, exc: BaseException) -> None:
        """``loop`` died of ``exc``: log, count, remember for ``/ready``."""
        status = self.loops.get(loop)
        if status is None:
            status = self.loops[loop] = LoopStatus(loop)
        now = time.monotonic()
        status.deaths.append(now)
        status.total_deaths += 1
        status.last_death_at = time.time()
        status.last_error = "".join(traceback.format_exception_only(exc)).strip()[:200]
        status.running_since = None
        self._m_restarts.labels(loop=loop).inc()
        log.error(
            "%s died (death %d); starting it again",
            loop,
            status.total_deaths,
            exc_info=(type(exc), exc, exc.__traceback__),
        )

    def _prune(self, status: LoopStatus, now: float) -> None:
        window = self.config.loop_death_window_s
        while status.deaths and now - status.deaths[0] > window:
            status.deaths.popleft()

    def readiness(self) -> list[str]:
        """Loops that keep dying: each one makes ``/ready`` 503."""
        now = time.monotonic()
        reasons = []
        for status in self.loops.values():
            self._prune(status, now)
            if len(status.deaths) >= self.config.loop_death_limit:
                reasons.append(
                    f"{status.describe()}; {len(status.deaths)} deaths within "
                    f"{self.config.loop_death_window_s:g}s"
                )
        return reasons

    def degraded(self) -> list[str]:
        """Loops that died and are not back yet (restarting, or up less than loop_settle_s)."""
        now = time.monotonic()
        settle = self.config.loop_settle_s
        shown = []
        for status in self.loops.values():
            if not status.total_deaths:
                continue
            since = status.running_since
            if since is None or now - since < settle:
                shown.append(status.describe())
        return shown
