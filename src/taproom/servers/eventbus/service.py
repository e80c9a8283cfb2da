"""The Event BUS service: start (rebuild, bind, tasks), stop, checkpoints."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from ...checkpoint import CheckpointSchedule
from ...hub import Hub
from ...zmqaccess import ZmqAccess
from ..zmtp import ZmtpPublisher, ZmtpSocket
from .checkpoint import BusState, checkpoint_path, rebuild_state, write_checkpoint
from .config import EventBusConfig
from .snapshot import SnapshotServer
from .state import PROTOCOL
from .wire import endpoint

log = logging.getLogger("taproom.eventbus")


class EventBusService(SnapshotServer):
    """The sockets, the broadcaster, the heartbeat and the Binary Star peer link."""

    _broadcaster: asyncio.Task[None] | None = None
    _schedule: CheckpointSchedule
    _saved_seq = 0  # the bus sequence of the state the last checkpoint saved

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> dict[str, str]:
        started = time.monotonic()
        state = await asyncio.to_thread(
            rebuild_state, self.hub, self.config.dedup_window, checkpoint_path(self.hub)
        )
        self.last_seq = self.assigned_seq = state.sequence
        self._applied_offset = state.offset
        cfg = self.config
        self._schedule = CheckpointSchedule(
            self.hub.metrics,
            "eventbus",
            interval_s=cfg.checkpoint_interval_s,
            after_events=cfg.checkpoint_after_events,
            min_gap_s=min(1.0, cfg.checkpoint_interval_s),
        )
        # A state that holds records read from the journal is saved at the first chance.
        self._schedule.started(
            seconds=time.monotonic() - started,
            replayed=state.replayed,
            covered=state.checkpoint_offset,
        )
        self._saved_seq = state.sequence if not self._schedule.unsaved else -1
        for key, seq in state.recent_uuids:
            self.dedup.add(key, seq)
        self._ctx = zmq.asyncio.Context()
        self._zmq_access = ZmqAccess(self._ctx, self.hub.config, self.hub.metrics, "eventbus")
        try:
            addresses = await self._bind()
        except BaseException:
            # The app stops only the services that started: close what bound (the seed's
            # group when the CHP group's ports are taken) and the context here.
            self._close_sockets()
            raise
        self._install(state.hashmap)
        log.info(
            "eventbus: %d topics, sequence %d rebuilt from %s (%d bus records read) in %.2fs; "
            "role %s",
            len(self.hashmap),
            self.last_seq,
            "a checkpoint and the journal" if state.from_checkpoint else "the journal",
            state.replayed,
            time.monotonic() - started,
            self.config.role,
        )
        # Every loop runs supervised (taproom.supervise): restarted if it dies, on /ready.
        spawn = self.hub.supervisor.spawn
        loops: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("eventbus.collector", self._collector_loop),
            ("eventbus.snapshot", self._snapshot_loop),
            ("eventbus.heartbeat", self._heartbeat_loop),
            ("eventbus.checkpoint", self._checkpoint_loop),
        ]
        if self.config.chp:
            loops += [
                ("eventbus.chp_collector", self._chp_collector_loop),
                ("eventbus.chp_snapshot", self._chp_snapshot_loop),
                ("eventbus.expiry", self._expiry_loop),
            ]
        if self.config.role != "standalone":
            self._connect_peer()
            loops += [
                ("eventbus.peer_hugz", self._peer_hugz_loop),
                ("eventbus.peer_ack", self._peer_ack_loop),
            ]
        self._tasks = [spawn(name, factory) for name, factory in loops]
        # The ZAP handler and the listeners' handshake monitors (eventbus.zap,
        # eventbus.handshakes.<listener>), supervised too.
        self._zmq_access.start(spawn)
        self._broadcaster = spawn("eventbus.broadcast", self._broadcast_loop)
        return addresses

    def _close_sockets(self) -> None:
        for own in self._own:
            own.close()
        self._own.clear()
        for sock in self._sockets:
            sock.close(0)
        self._sockets.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def _refused_handshake(self, listener: str) -> Callable[[], None]:
        def count() -> None:
            self._reject("handshake_refused", f"{listener}: a peer refused at the handshake")

        return count

    async def _bind(self) -> dict[str, str]:
        """The seed's group (and the CHP dialect's, when on); see :meth:`_bind_group`."""
        cfg = self.config
        snapshot, publisher, collector, base = await self._bind_group(
            cfg.port,
            ("eventbus_snapshot", "eventbus_publisher", "eventbus_collector"),
            (
                zmq.ROUTER,
                {
                    "SNDHWM": cfg.snapshot_hwm,
                    "ROUTER_MANDATORY": 1,
                    "MAXMSGSIZE": self.limits.max_topic_bytes * self.limits.max_subtrees + 4096,
                },
            ),
            "ROUTER",
        )
        self._snapshot, self._publisher, self._collector = snapshot, publisher, collector
        # A synchronous shadow of the same socket: NOBLOCK sends and receives in hot loops
        # without a future per call.
        self._snapshot_raw = zmq.Socket.shadow(snapshot.underlying)
        addresses = {
            "eventbus_snapshot": f"{cfg.host}:{base}",
            "eventbus_publisher": f"{cfg.host}:{base + 1}",
            "eventbus_collector": f"{cfg.host}:{base + 2}",
        }
        if not cfg.chp:
            return addresses
        collector_kind = "SUB" if cfg.chp_collector == "sub" else "PULL"
        snapshot, publisher, collector, base = await self._bind_group(
            cfg.chp_port,
            ("eventbus_chp_snapshot", "eventbus_chp_publisher", "eventbus_chp_collector"),
            (
                zmq.ROUTER,
                {
                    "SNDHWM": cfg.snapshot_hwm,
                    "ROUTER_MANDATORY": 1,
                    "MAXMSGSIZE": self.limits.max_topic_bytes + 4096,
                },
            ),
            collector_kind,
        )
        self._chp_snapshot, self._chp_collector = snapshot, collector
        self._chp_snapshot_raw = zmq.Socket.shadow(snapshot.underlying)
        self._chp_publisher = publisher
        addresses["eventbus_chp_snapshot"] = f"{cfg.host}:{base}"
        addresses["eventbus_chp_publisher"] = f"{cfg.host}:{base + 1}"
        addresses["eventbus_chp_collector"] = f"{cfg.host}:{base + 2}"
        return addresses

    async def _bind_group(
        self,
        port: int,
        names: tuple[str, str, str],
        snapshot_kind: tuple[int, dict[str, int]],
        collector_kind: str,
    ) -> tuple[zmq.asyncio.Socket, ZmtpPublisher, ZmtpSocket, int]:
        """Three sockets at P, P+1, P+2 (the libzmq snapshot ROUTER; the publisher and the
        collector on taproom's transport); port 0 finds three consecutive free ones (the OS
        picks P, and all three are closed and tried again if P+1 or P+2 is taken).

        Each gets its listener's access policy before it binds; peers of the wrong kind (a
        PUSH or PUB on the ROUTER SNAPSHOT...) are refused by ZeroMQ without a word to the
        application: their monitors count them (``handshake_refused``); the publisher and the
        collector count their own refusals (``socket_type``...).

        The publisher queues at most ``publisher_hwm`` messages per subscriber and the [zmtp]
        byte bounds; a subscription longer than any topic matches nothing, so a longer one
        disconnects its peer (issue 19: libzmq grew its subscription trie by a node per byte,
        4 x 1 MiB = 264 MB)."""
        host = self.config.host
        assert self._zmq_access is not None
        for _attempt in range(100):
            snapshot = self._socket(snapshot_kind[0], **snapshot_kind[1])
            self._zmq_access.secure(snapshot, names[0], self._refused_handshake(names[0]))
            publisher = ZmtpPublisher(
                "PUB",
                hub=self.hub,
                protocol=PROTOCOL,
                name=names[1],
                hwm=self.config.publisher_hwm,
                max_subscription_bytes=self.limits.max_topic_bytes + 64,
            )
            collector = ZmtpSocket(
                collector_kind,
                hub=self.hub,
                protocol=PROTOCOL,
                name=names[2],
                max_message_bytes=self._max_frame,
                subscribe=(b"",) if collector_kind == "SUB" else (),
            )
            try:
                if port:
                    base = port
                    snapshot.bind(endpoint(host, base))
                else:
                    snapshot.bind(endpoint(host, 0).rsplit(":", 1)[0] + ":*")
                    bound = snapshot.getsockopt(zmq.LAST_ENDPOINT)
                    assert isinstance(bound, bytes)
                    base = int(bound.rsplit(b":", 1)[1])
                    if base > 65533:
                        raise zmq.ZMQError(errno.EADDRINUSE)
                await publisher.bind(host, base + 1)
                await collector.bind(host, base + 2)
            except (zmq.ZMQError, OSError) as exc:
                publisher.close()
                collector.close()
                self._zmq_access.forget(snapshot)
                snapshot.close(0)
                self._sockets.remove(snapshot)
                if port or exc.errno != errno.EADDRINUSE:
                    raise
                continue
            self._own += [publisher, collector]
            return snapshot, publisher, collector, base
        raise OSError(errno.EADDRINUSE, "no three consecutive free ports for the event bus")

    async def stop(self) -> None:
        """Stop reading, let submitted bursts commit and go out, close the sockets."""
        self._stopping = True
        others = list(self._tasks)
        if self._resync_task is not None:
            others.append(self._resync_task)
        others.extend(self._snapshot_tasks)
        for task in others:
            task.cancel()
        broadcaster = self._broadcaster
        if broadcaster is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained(), self.hub.config.hub.grace_period_s)
            broadcaster.cancel()
            others.append(broadcaster)
            self._broadcaster = None
            self._broadcast_guard = None  # commits delivered from now on are not applied
        for task in others:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._zmq_access is not None:
            await self._zmq_access.stop()
        if self.config.checkpoint_interval_s:
            try:
                await self.checkpoint()
            except OSError as exc:
                log.warning("eventbus: checkpoint at stop failed: %s", exc)
        self._close_sockets()
        # The hashmap's share of the budget goes with it.
        self._hashmap_holder.release(min(self._accepted_bytes, self._hashmap_holder.used))
        self._accepted_bytes = 0

    # --- checkpoint ------------------------------------------------------------------------

    def _covered(self) -> int:
        """The journal offset the applied state covers: the journal's end while no bus burst
        is between its submit and its apply (every bus record committed is then applied), else
        the end of the last burst applied."""
        if not self._bursts_open and not self._resyncing:
            covered = max(self._applied_offset, self.hub.journal.end_offset)
        else:
            covered = self._applied_offset
        return min(covered, self._cover_limit)

    def _capture(self) -> BusState:
        """The applied state, taken in one step on the loop (entries are immutable tuples)."""
        return BusState(
            hashmap=dict(self.hashmap),
            sequence=self.last_seq,
            recent_uuids=list(self.dedup.recent()),
            offset=self._covered(),
        )

    async def checkpoint(self) -> None:
        """Save the applied state beside the journal (a no-op when nothing changed)."""
        schedule = self._schedule
        if (
            not schedule.unsaved
            and self.last_seq == self._saved_seq
            and self._covered() == schedule.covered
        ):
            return
        state = self._capture()
        previous, self._saved_seq = self._saved_seq, state.sequence
        began = time.monotonic()
        try:
            await asyncio.to_thread(write_checkpoint, checkpoint_path(self.hub), state)
        except BaseException:
            self._saved_seq = previous
            schedule.failed(0)
            raise
        schedule.written(state.offset, time.monotonic() - began)

    async def _checkpoint_loop(self) -> None:
        """Checkpoints by progress (CheckpointSchedule): checked about once a second."""
        interval = self.config.checkpoint_interval_s
        if not interval:
            return
        await self._schedule.run(
            check_s=min(1.0, interval),
            # Bus events applied since the state last saved: the sequence counts them.
            applied=lambda: max(0, self.last_seq - self._saved_seq),
            covered=self._covered,
            size=lambda: len(self.hashmap),
            save=self.checkpoint,
            what="eventbus",
        )


def create_service(hub: Hub, config: EventBusConfig) -> EventBusService:
    return EventBusService(hub, config)
