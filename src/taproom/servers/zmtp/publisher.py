"""taproom's own ZeroMQ publishers: PUB / XPUB on its ZMTP transport (issue 26 part 3, issue 32).

libzmq's PUB counts what it queues for a subscriber in messages (the send HWM), so one that
never reads cost a hub hundreds of MiB (20,000 x 16 KB events: 420 MiB), and what a subscriber
misses is invisible: a pipe at its HWM drops silently until it drains to half, so a subscriber
slightly slower than a burst missed a quarter of a run with two drops counted. A
:class:`ZmtpPublisher` bounds and counts instead:

* every message offered to a subscriber (its filter takes it) is **delivered** (handed to the
  kernel), **dropped and counted** by reason, or still queued: ``sent = delivered + dropped
  + queued`` exactly (``taproom_output_*_messages_total{output}``);
* a subscriber's queue holds what the kernel did not take, bounded in messages (the output's
  HWM setting) and in bytes: ``[zmtp] max_subscriber_bytes``, and its share of the budget's
  ``output_queues`` holder (the holder's bound over the number of subscribers in the process).
  Past either bound the messages that do not fit are dropped for that subscriber alone
  (``hwm``, ``subscriber_bytes``); the holder refusing room is ``output_budget``; what a
  subscriber had queued when it went away is ``disconnected``;
* publishing never waits: a slow subscriber costs a fast one nothing (no I/O thread, no pipe
  shared between them);
* a burst's wire bytes are built once (:class:`~taproom.protocols.zmtp.pubsub.Burst`) and the
  same bytes object goes to every subscriber whose filter takes all of it; subscribers with
  the same filter share one selected burst. A subscriber that takes what the kernel does not
  keeps a view of the shared bytes (reserved from the holder once, whoever holds it), or a
  copy of its part when that part is small (so a few messages never pin a large burst).

Each connection is a plain non-blocking socket on the event loop (``add_reader`` /
``add_writer``): writes go straight from the shared bytes to the kernel (``sendmsg`` of many
queued views in one call), and the hub knows exactly which messages the kernel took; an
asyncio transport would copy what the kernel does not take, for every subscriber. The
handshake (NULL or CURVE), the access policy and the refusals are the ingest transport's
(:mod:`.transport`). Subscriptions (ZMTP 3.0 messages and 3.1 commands) are read, bounded,
and applied to the subscriber's prefix set; ``on_subscription`` tells the service of each one
(libzmq's XPUB passes them up: the Lager forwarder answers hellos with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from ... import zmqburst
from ...access import ListenerAccess, access_for
from ...budget import Holder as BudgetHolder
from ...hub import Hub
from ...protocols import zmtp as zp
from ...protocols.zmtp.pubsub import Burst, Subscription
from .. import ACCEPT_BATCH
from .config import ZmtpConfig
from .listener import RateLimitedLog, listening, zmtp_config
from .subscriber import (
    DISCONNECTED,
    HWM,
    OUTPUT_BUDGET,
    SUBSCRIBER_BYTES,
    Subscriber,
    _Shared,
)

__all__ = ["OUTPUT_QUEUES", "Subscriber", "ZmtpPublisher"]

log = logging.getLogger("taproom.zmtp")

OUTPUT_QUEUES = "output_queues"  # the budget holder subscriber queues reserve from
_SWEEP_S = 1.0


class _Shares:
    """How many subscribers the process has per holder: each may hold ``bound / count`` of it,
    so whatever a slow subscriber keeps, every other one still has its share."""

    _counts: dict[int, int] = {}

    @classmethod
    def join(cls, holder: BudgetHolder) -> None:
        cls._counts[id(holder)] = cls._counts.get(id(holder), 0) + 1

    @classmethod
    def leave(cls, holder: BudgetHolder) -> None:
        left = cls._counts.get(id(holder), 1) - 1
        if left:
            cls._counts[id(holder)] = left
        else:
            cls._counts.pop(id(holder), None)

    @classmethod
    def share(cls, holder: BudgetHolder) -> int:
        return holder.bound // max(1, cls._counts.get(id(holder), 1))


class ZmtpPublisher:
    """One bound PUB or XPUB socket of taproom's transport (see the module docstring).

    ``output``: the metric label (the listener's name unless given); ``hwm``: messages queued
    per subscriber; ``max_subscription_bytes``: the longest subscription a peer may send
    (longer ones disconnect it: a topic longer than any the output publishes matches nothing).
    ``on_subscription(subscriber, prefix, subscribe)`` runs for every change of a subscriber's
    filter, and for each of its prefixes (cancelled) when it goes away.
    """

    def __init__(
        self,
        kind: str,
        *,
        hub: Hub,
        protocol: str,
        name: str,
        hwm: int,
        max_subscription_bytes: int,
        output: str = "",
        on_subscription: Callable[[Subscriber, bytes, bool], None] | None = None,
        config: ZmtpConfig | None = None,
        holder: BudgetHolder | None = None,
        access: ListenerAccess | None = None,
    ) -> None:
        if kind not in ("PUB", "XPUB"):
            raise ValueError(f"a publisher is a PUB or an XPUB, not {kind}")
        self.kind = kind.encode()
        self.hub = hub
        self.protocol = protocol
        self.name = name
        self.output = output or name
        self._guard = hub.supervisor.guard(f"zmtp.{name}", protocol=protocol, logger=log)
        self.hwm = hwm
        self.max_subscription_bytes = max_subscription_bytes
        self.on_subscription = on_subscription
        self.config = config or zmtp_config(hub)
        self.holder: BudgetHolder = holder or hub.budget.holder(OUTPUT_QUEUES)
        self.access = access or access_for(hub.config, name, hub.metrics)
        self.address = ""
        self.queued_messages = 0
        self.queued_bytes = 0
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._connections: set[Subscriber] = set()
        self._groups: dict[tuple[bytes, ...], set[Subscriber]] = {}
        self._prefixes: dict[bytes, int] = {}  # prefix -> subscribers that have it
        self._joined_set: set[Subscriber] = set()  # past the handshake
        self._rlog = RateLimitedLog()
        m = hub.metrics
        labels = {"output": self.output}
        # Tallies (taproom.metrics): counted on every publish, always on the loop
        self._m_sent = m.tally(
            "output",
            "sent",
            "messages",
            "Messages offered to subscribers (one per subscriber whose filter takes it): "
            "delivered + dropped + queued",
            **labels,
        )
        self._m_delivered = m.tally(
            "output",
            "delivered",
            "messages",
            "Messages handed to the kernel for a subscriber",
            **labels,
        )
        self._m_dropped = m.counter(
            "output",
            "dropped",
            "messages",
            "Messages a subscriber missed, by reason (hwm, subscriber_bytes, output_budget, "
            "disconnected)",
            ("output", "reason"),
        )
        for reason in (HWM, SUBSCRIBER_BYTES, OUTPUT_BUDGET, DISCONNECTED):
            self._m_dropped.labels(output=self.output, reason=reason)  # shown at 0 from the start
        m.gauge(
            "output", "queued", "messages", "Messages queued for subscribers", ("output",)
        ).labels(**labels).set_function(lambda: self.queued_messages)
        m.gauge(
            "output",
            "queued",
            "bytes",
            "Bytes subscriber queues count against their bounds",
            ("output",),
        ).labels(**labels).set_function(lambda: self.queued_bytes)
        m.gauge("output", "subscribers", "count", "Connected subscribers", ("output",)).labels(
            **labels
        ).set_function(lambda: len(self._joined_set))
        self._m_connections = m.connections(protocol, name)

    # --- binding -----------------------------------------------------------------------------------

    async def bind(self, host: str, port: int) -> str:
        """Listen on ``host:port`` (0: any free port); returns ``host:port`` as bound."""
        loop = self._loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, type_, proto, _canon, sockaddr = infos[0]
        listener = socket.socket(family, type_, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(sockaddr)
            listener.listen(4096)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        loop.add_reader(listener.fileno(), self._accept)
        bound = listener.getsockname()[1]
        self.address, self._sweeper = listening(self.hub, self.name, host, bound, self._sweep, loop)
        return self.address

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "not bound"
        return self._loop

    def _accept(self) -> None:
        listener = self._listener
        if listener is None:
            return
        for _ in range(ACCEPT_BATCH):
            try:
                sock, peername = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: the next wakeup tries again
                self._rlog("zmtp: %s cannot accept: %s", self.name, exc)
                return
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.config.subscriber_send_buffer_bytes:
                    sock.setsockopt(
                        socket.SOL_SOCKET,
                        socket.SO_SNDBUF,
                        self.config.subscriber_send_buffer_bytes,
                    )
            host = peername[0] if isinstance(peername, tuple) else None
            address = f"{host}:{peername[1]}" if host is not None else "?"
            if len(self._connections) >= self.config.max_connections:
                self._refused("too_many_connections", f"{address}: over max_connections")
                sock.close()
                continue
            sub = Subscriber(self, sock, address)
            if not self.access.allows(host):
                # counted now; the peer is told at the handshake, as on the ingest side
                self.access.refused(address, "address_not_allowed", "not in allow")
                sub.denied = True
            self._connections.add(sub)
            self._m_connections.inc()
            self.loop.add_reader(sub.fd, sub.readable)
            sub._write_control(sub.handshake.initial)

    def close(self) -> None:
        """Stop listening and close every subscriber (what they had queued is counted)."""
        if self._listener is not None:
            self.loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for sub in list(self._connections):
            sub.close()

    # --- publishing ----------------------------------------------------------------------------

    @property
    def has_subscribers(self) -> bool:
        """Some subscriber's filter takes something (an output with none need not build)."""
        return bool(self._groups)

    def subscribers(self) -> int:
        return len(self._joined_set)

    def subscribed(self) -> int:
        """Subscribers whose filter takes something."""
        return sum(map(len, self._groups.values()))

    def prefixes(self) -> int:
        """Distinct prefixes subscribed to (what libzmq's XPUB passes up as new ones)."""
        return len(self._prefixes)

    def takes(self, topic: bytes) -> bool:
        """Whether any subscriber's filter takes a message whose first frame is ``topic``."""
        return any(topic.startswith(key) for key in self._groups)

    def publish(self, burst: Burst) -> None:
        """Offer a burst to every subscriber: each distinct filter selects once, and the
        subscribers sharing it get the same bytes."""
        if not burst.ends:
            return
        for key, group in list(self._groups.items()):
            selected = burst.select(key)
            if selected is None:
                continue
            shared = _Shared(selected) if len(group) > 1 else None
            for sub in list(group):
                sub.offer(selected, shared)

    def publish_prepared(
        self,
        buf: Any,
        frame_end: Any,
        counts: Any,
        n: int,
        runs: list[tuple[bytes, int]] | None = None,
    ) -> None:
        """Messages a protocol kernel laid out in C arrays (``tb_send``'s shape: the Event BUS
        collector's BROADCASTs) as one burst, made wire bytes in C: compiled path only.
        ``runs``: their topics, when the caller knows them (:class:`Burst`'s ``runs``: a
        filter then reads no message's frames)."""
        if not self._groups or not n:
            return
        frames = counts[0] if n == 1 else sum(zmqburst.ffi_lib()[0].unpack(counts, n))
        wire, ends = zmqburst.zmtp_wire_prepared(
            buf, frame_end, counts, n, frames, frame_end[frames - 1]
        )
        self.publish(Burst(wire, ends, runs))

    def send(self, messages: Sequence[Sequence[bytes]]) -> None:
        """Encode whole messages (lists of frames) once, in C where it is built, and publish
        them."""
        if self._groups and messages:
            self.publish(self.encode(messages))

    @staticmethod
    def encode(messages: Sequence[Sequence[bytes]]) -> Burst:
        """Whole messages as one burst (in C where it is built)."""
        if zmqburst.active() == "ext":
            return Burst(*zmqburst.zmtp_wire(messages))
        return Burst.encode(messages)

    def send_to(self, sub: Subscriber, messages: Sequence[Sequence[bytes]]) -> None:
        """Messages for one subscriber (a reply to its subscription), through its filter."""
        if sub.closed or sub not in self._joined_set or not messages:
            return
        selected = self.encode(messages).select(sub.filter.key)
        if selected is not None:
            sub.offer(selected, None)

    # --- the subscribers' side -------------------------------------------------------------------

    def _limit(self) -> int:
        return min(self.config.max_subscriber_bytes, _Shares.share(self.holder))

    def _reserve(self, shared: _Shared, *, force: bool) -> bool:
        n = len(shared.burst.wire)
        if self.holder.try_reserve(n):
            shared.reserved = n
            return True
        if force:  # one half-written message per subscriber, at most, beyond the bound
            self.holder.charge(n)
            shared.reserved = n
            return True
        return False

    def _dropped(self, reason: str, n: int) -> None:
        self._m_dropped.labels(output=self.output, reason=reason).inc(n)

    def _joined(self, sub: Subscriber) -> None:
        self._joined_set.add(sub)
        _Shares.join(self.holder)

    def _left(self, sub: Subscriber) -> None:
        if sub in self._connections:
            self._connections.discard(sub)
            self._m_connections.dec()
        if sub in self._joined_set:
            self._joined_set.discard(sub)
            _Shares.leave(self.holder)
            self._regroup(sub, sub.filter.key, ())
            for prefix in list(sub.filter.prefixes):
                self._count_prefix(prefix, -1)
                if self.on_subscription is not None:
                    self.on_subscription(sub, prefix, False)

    def _subscription(self, sub: Subscriber, subscription: Subscription) -> None:
        if len(subscription.prefix) > self.max_subscription_bytes:
            sub.refuse("message_too_large", f"a {len(subscription.prefix)}-byte subscription")
            return
        before = sub.filter.key
        try:
            changed = sub.filter.apply(subscription)
        except zp.ZmtpError as exc:
            sub.refuse(exc.reason, str(exc))
            return
        if not changed:
            return
        self._regroup(sub, before, sub.filter.key)
        self._count_prefix(subscription.prefix, 1 if subscription.subscribe else -1)
        if self.on_subscription is not None:
            self.on_subscription(sub, subscription.prefix, subscription.subscribe)

    def _regroup(
        self, sub: Subscriber, before: tuple[bytes, ...], after: tuple[bytes, ...]
    ) -> None:
        if before == after:
            return
        if before:
            group = self._groups.get(before)
            if group is not None:
                group.discard(sub)
                if not group:
                    del self._groups[before]
        if after and not sub.closed:
            self._groups.setdefault(after, set()).add(sub)

    def _count_prefix(self, prefix: bytes, delta: int) -> None:
        count = self._prefixes.get(prefix, 0) + delta
        if count > 0:
            self._prefixes[prefix] = count
        else:
            self._prefixes.pop(prefix, None)

    def _refused(self, reason: str, detail: str) -> None:
        self.hub.metrics.rejected(self.protocol, reason)
        self._rlog("zmtp: %s refused %s (%s)", self.name, detail, reason)

    def _failed(self, exc: Exception, sub: Subscriber) -> None:
        """A subscriber's read (handshake, subscriptions) failed unexpectedly: counted as an
        ``internal_error`` of the protocol and logged with its traceback (taproom.supervise);
        that subscriber is disconnected, the others go on."""
        self._guard.failed(exc, f"read from subscriber {sub.address}")
        sub.close()

    async def _sweep(self) -> None:
        """Handshake timeouts (a subscriber's own pace is its queue's business)."""
        timeout = self.config.handshake_timeout_s
        while True:
            await asyncio.sleep(_SWEEP_S)
            now = time.monotonic()
            for sub in list(self._connections):
                if sub.peer is None and now - sub.connected_at > timeout:
                    sub.refuse("handshake_timeout", "no READY in time", tell=False)
