"""The process-wide memory budget: one total, split by design between named holders.

Every large thing the hub keeps in memory belongs to one *holder*, and each holder has a bound
(a setting). The bounds add up to at most ``[hub] memory_budget_bytes`` (checked when the
configuration loads), so whatever senders do, and however many connections they open, what the
hub holds stays within that total: the promise of issue 26 is a peak RSS within the budget plus
the ~100 MB an idle hub takes (interpreter, libraries, sockets, journal index), which with the
defaults is ``2 x max_pending_bytes + 100 MB``.

The split is strict: a holder never lends its room to another, so an attack on one (unfinished
frames filling ``connection_buffers``) cannot starve another (an honest sender's batches in
``pending``). A holder that cannot get room *waits* (in FIFO order, :meth:`Holder.reserve`) or
*refuses* (:meth:`Holder.try_reserve`); the caller decides which, and it reserves **before** it
allocates. ``docs/operations.md`` has the table: each holder, its bound, what happens at the
bound, and its metrics.

Holders are loop-only objects: call them on the hub's event loop (no locks; a reservation made
and released on the loop costs a few attribute updates).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .config import Config, ConfigError, config_check, known_sections
from .metrics import Metrics

__all__ = [
    "CONNECTION_BUFFERS",
    "HOLDERS",
    "Holder",
    "HolderSpec",
    "MemoryBudget",
    "check_budget",
]

# The holder every listener's per-connection buffers share: Lumberjack's and LogTK's incomplete
# frames, and the ZeroMQ transport's unfinished messages (issue 26 part 2).
CONNECTION_BUFFERS = "connection_buffers"


@dataclass(frozen=True, slots=True)
class HolderSpec:
    """A holder as declared here: where its bound is set and what happens at the bound."""

    name: str
    section: str
    key: str
    holds: str
    at_bound: str


HOLDERS: tuple[HolderSpec, ...] = (
    HolderSpec(
        "pending",
        "hub",
        "max_pending_bytes",
        "journal batches submitted and not yet committed and acked, and the batch a Lumberjack "
        "connection is building",
        "batches wait in submission order; servers stop reading their sockets",
    ),
    HolderSpec(
        "inflate",
        "hub",
        "max_inflate_bytes",
        "inflated bytes in flight: Lumberjack C frames (the piece being parsed, an incomplete "
        "event) and logjam zlib/snappy/lz4 bodies",
        "the connection stops reading and waits its turn (FIFO)",
    ),
    HolderSpec(
        CONNECTION_BUFFERS,
        "hub",
        "connection_buffer_bytes",
        "bytes received and not yet parsed, of every connection of every listener "
        "(incomplete frames; unfinished ZeroMQ messages)",
        "the connection stops reading until room frees (TCP backpressure)",
    ),
    HolderSpec(
        "output_queues",
        "hub",
        "output_queue_bytes",
        "committed batches queued in memory for the outputs",
        "a lossless output reads back from the journal (lag counted); a lossy one (the "
        "console's tail) drops and counts",
    ),
    HolderSpec(
        "eventbus_hashmap",
        "eventbus",
        "max_hashmap_bytes",
        "the Event BUS latest-value hashmap (frames + per-entry overhead)",
        "the update is refused (hashmap_full), counted and logged",
    ),
    HolderSpec(
        "console_tail",
        "console",
        "tail_bytes",
        "live-tail rows queued for console pages",
        "the rows a page would queue are skipped and counted",
    ),
)


def _bound(config: Config | None, spec: HolderSpec) -> int:
    """A holder's bound from ``config`` (the setting's default when the section is absent)."""
    if config is not None:
        try:
            return int(getattr(config.section(spec.section), spec.key))
        except (KeyError, AttributeError):
            pass
    cls = known_sections()[spec.section]
    default = {f.name: f.default for f in dataclasses.fields(cls)}[spec.key]
    assert isinstance(default, int)
    return default


def _total(config: Config | None) -> int:
    if config is not None:
        try:
            return int(config.section("hub").memory_budget_bytes)
        except KeyError:
            pass
    from .config import HubConfig

    return int(HubConfig().memory_budget_bytes)


@config_check
def check_budget(config: Config) -> None:
    """The holders' bounds must fit in ``hub.memory_budget_bytes`` (``taproom validate``)."""
    total = _total(config)
    parts = [(f"{s.section}.{s.key}", _bound(config, s)) for s in HOLDERS]
    used = sum(size for _key, size in parts)
    if used > total:
        listed = ", ".join(f"{key} {size}" for key, size in parts)
        raise ConfigError(
            f"{total} is less than its holders' bounds together ({used}: {listed}); raise it "
            "or lower a holder",
            key="hub.memory_budget_bytes",
        )


class _Waiter:
    __slots__ = ("alive", "callback", "holding", "size")

    def __init__(self, size: int, callback: Callable[[], None], holding: int) -> None:
        self.size = size
        self.callback = callback
        self.holding = holding  # what the waiting party already holds of this holder
        self.alive = True  # False once granted or cancelled


def _holding(waiter: _Waiter) -> int:
    return waiter.holding


class Holder:
    """One named share of the budget: ``used`` of ``bound`` bytes, waiters in FIFO order.

    A request larger than the bound is granted only when nothing else is held (it goes alone),
    so one oversized item can never wait forever; callers that must refuse such items (one
    event over its limit) check against ``bound`` themselves.

    A party that waits for more while it holds part of what it needs (the start of a large
    frame) says so with ``holding=``: when everything held belongs to parties that are all
    waiting, nothing would ever be released, so the waiter that holds the most (the oldest of
    those) is granted beyond the bound, one request at a time. Granting the one closest to
    done, not the oldest, keeps the excess to one party's growth (one frame): when the party
    granted asked again, the oldest was another, and each in turn grew past the bound (64
    connections of zlib bombs held 74 MB in a 16 MiB holder).
    """

    __slots__ = (
        "_held_by_waiters",
        "_listeners",
        "_m_refusals",
        "_m_waits",
        "_waiters",
        "bound",
        "name",
        "peak",
        "used",
        "waiting_bytes",
    )

    def __init__(self, name: str, bound: int, metrics: Metrics | None = None) -> None:
        self.name = name
        self.bound = bound
        self.used = 0
        self.peak = 0  # the most held at once since the start
        self.waiting_bytes = 0
        self._held_by_waiters = 0
        self._waiters: deque[_Waiter] = deque()
        self._listeners: list[Callable[[], None]] = []
        metrics = metrics or Metrics()
        self._m_waits = metrics.counter(
            "budget", "waits", "calls", "Reservations that had to wait for room", ("holder",)
        ).labels(holder=name)
        self._m_refusals = metrics.counter(
            "budget", "refusals", "calls", "try_reserve calls refused for lack of room", ("holder",)
        ).labels(holder=name)
        for metric, doc, fn in (
            ("held", "Bytes held", lambda: self.used),
            ("bound", "The holder's bound", lambda: self.bound),
            ("waiting", "Bytes asked for by reservations waiting for room", self._waiting),
            ("peak", "The most bytes held at once since the start", lambda: self.peak),
        ):
            metrics.gauge("budget", metric, "bytes", doc, ("holder",)).labels(
                holder=name
            ).set_function(fn)

    def _waiting(self) -> int:
        return self.waiting_bytes

    # -- reserving ----------------------------------------------------------------------------

    def _fits(self, n: int) -> bool:
        return self.used + n <= self.bound or self.used == 0

    def _take(self, n: int) -> None:
        self.used += n
        if self.used > self.peak:
            self.peak = self.used

    @property
    def waiting(self) -> int:
        """Reservations waiting for room."""
        return len(self._waiters)

    def try_reserve(self, n: int) -> bool:
        """Take ``n`` bytes now if they fit and nobody waits before us; never blocks.

        False (counted in ``taproom_budget_refusals_calls_total``) when they do not: the caller
        refuses its item, or waits with :meth:`reserve`.
        """
        if n <= 0:
            return True
        if self._waiters or not self._fits(n):
            self._m_refusals.inc()
            return False
        self._take(n)
        return True

    def charge(self, n: int) -> None:
        """Count ``n`` bytes the caller keeps whatever the bound says: state decided elsewhere
        (a passive Event BUS server mirrors what its active peer admitted under the same bound;
        a restart rebuilds what the journal holds). Visible in ``used`` and ``peak``."""
        if n > 0:
            self._take(n)

    async def reserve(self, n: int, *, holding: int = 0) -> None:
        """Take ``n`` bytes, waiting in FIFO order until they fit. Cancelling the wait takes
        nothing. ``holding``: what the caller already holds here (see the class)."""
        if n <= 0:
            return
        if not self._waiters and self._fits(n):
            self._take(n)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def granted() -> None:
            if future.done():  # the waiting task was cancelled meanwhile: give it back
                self.release(n)
            else:
                future.set_result(None)

        waiter = self.wait(n, granted, holding=holding)
        try:
            await future
        except asyncio.CancelledError:
            if not self.cancel(waiter) and not future.cancelled():
                self.release(n)  # granted just as the wait was cancelled
            raise

    def wait(self, n: int, callback: Callable[[], None], *, holding: int = 0) -> object:
        """Queue a reservation of ``n`` bytes; ``callback()`` runs (inside a ``release``, or
        at once when everything held belongs to waiters) once they are taken for the caller.
        Returns a handle for :meth:`cancel`."""
        waiter = _Waiter(n, callback, holding)
        self._waiters.append(waiter)
        self.waiting_bytes += n
        self._held_by_waiters += holding
        self._m_waits.inc()
        if holding:
            self._grant()  # everything held may belong to waiters now
        return waiter

    def cancel(self, handle: object) -> bool:
        """Withdraw a queued reservation: True if it was still waiting (nothing was taken)."""
        assert isinstance(handle, _Waiter)
        if not handle.alive:
            return False
        handle.alive = False
        self._waiters.remove(handle)
        self.waiting_bytes -= handle.size
        self._held_by_waiters -= handle.holding
        self._grant()  # a large head leaving may let smaller ones behind it in
        self._changed()
        return True

    def release(self, n: int) -> None:
        """Give back ``n`` bytes; waiters that now fit are granted in order."""
        if n <= 0:
            return
        self.used -= n
        if self.used < 0:  # a caller released more than it took: a bug, kept visible
            self.used = 0
            raise ValueError(f"holder {self.name}: released more than was reserved")
        self._grant()
        self._changed()

    def _grant(self) -> None:
        waiters = self._waiters
        while waiters:
            head = waiters[0]
            # Deadlocked: all that is held belongs to waiters, so nothing would be released.
            stuck = self._held_by_waiters and self.used <= self._held_by_waiters
            if self._fits(head.size):
                waiters.popleft()
            elif stuck:
                head = max(waiters, key=_holding)  # the first of the largest: the oldest
                waiters.remove(head)
            else:
                return
            head.alive = False
            self.waiting_bytes -= head.size
            self._held_by_waiters -= head.holding
            self._take(head.size)
            head.callback()

    # -- observers ----------------------------------------------------------------------------

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every release or cancel (the hub's capacity event)."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def __repr__(self) -> str:
        return f"Holder({self.name!r}, used={self.used}, bound={self.bound})"


class MemoryBudget:
    """The hub's budget: ``total`` bytes, one :class:`Holder` per entry of :data:`HOLDERS`."""

    def __init__(self, config: Config | None = None, metrics: Metrics | None = None) -> None:
        self.total = _total(config)
        metrics = metrics or Metrics()
        self._holders = {s.name: Holder(s.name, _bound(config, s), metrics) for s in HOLDERS}
        metrics.gauge_fn("budget", "total", "bytes", "hub.memory_budget_bytes", lambda: self.total)
        metrics.gauge_fn("budget", "held_total", "bytes", "Bytes held by all holders", self.used)

    def holder(self, name: str) -> Holder:
        """The holder ``name`` (one of :data:`HOLDERS`); KeyError for any other name."""
        return self._holders[name]

    def holders(self) -> list[Holder]:
        return list(self._holders.values())

    def used(self) -> int:
        return sum(h.used for h in self._holders.values())
