"""The logjam service: binds the four sockets and runs ingest, the PUB output and replay."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from functools import partial

import zmq
import zmq.asyncio

from ...hub import Hub
from ...payloads import decode_payload
from ...protocols import logjam as lj
from ...zmqaccess import ZmqAccess
from ..zmtp import ZmtpPublisher, ZmtpSocket
from .config import LogjamConfig
from .ingest import Ingest, RejectLog
from .pub import PubOutput
from .replay import ReplayChannel

__all__ = ["LogjamService", "canonical_host_name", "create_service"]

# ZMQ_MAXMSGSIZE of the replay socket: request frames are at most 255 bytes, and a little more
# is still read so it can be answered 400. libzmq drops the connection of a peer sending a
# bigger frame before allocating it. (The PUB is taproom's transport: a subscription longer
# than an app-env prefix can be disconnects its peer, counted message_too_large.)
_REPLAY_FRAME_MAX_BYTES = 4096


def canonical_host_name() -> str:
    """This host's name as logjam-device gives it (my_fqdn in logjam-tools src/logjam-util.c):
    the canonical name getaddrinfo reports for gethostname() with AI_CANONNAME, or the plain
    host name when the lookup fails."""
    name = socket.gethostname()
    try:
        infos = socket.getaddrinfo(
            name, None, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_CANONNAME
        )
    except OSError:
        return name
    canonical = [info[3] for info in infos if info[3]]
    return canonical[-1] if canonical else name


class LogjamService:
    """The logjam ROUTER/PULL ingest, XPUB output and replay channel (the ROUTER, PULL and
    XPUB on taproom's own transport, the replay ROUTER on libzmq)."""

    def __init__(self, hub: Hub, config: LogjamConfig) -> None:
        self.hub = hub
        self.config = config
        self.hostname = (config.hostname or canonical_host_name()).encode()
        mapper = lj.OutputMapper(
            routes=config.routes,
            default_app_env=config.default_app_env,
            event_protocols=config.event_protocols,
            payload_decoder=decode_payload,
        )
        reject = RejectLog(hub.metrics)
        self.ingest = Ingest(hub, config, self.hostname, reject)
        self.pub = PubOutput(hub, config, self.hostname, mapper)
        self.replay = ReplayChannel(hub, config, self.pub, reject)
        self._ctx: zmq.asyncio.Context | None = None
        self._access: ZmqAccess | None = None
        self._sockets: list[zmq.asyncio.Socket] = []
        self._own: list[ZmtpSocket | ZmtpPublisher] = []  # taproom's transport
        self._tasks: list[asyncio.Task[None]] = []
        self.addresses: dict[str, str] = {}

    def _bind(
        self, kind: int, port: int, name: str, max_frame: int
    ) -> tuple[zmq.asyncio.Socket, zmq.Socket]:
        assert self._ctx is not None
        cfg = self.config
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
        sock.setsockopt(zmq.RCVHWM, cfg.rcv_hwm)
        sock.setsockopt(zmq.SNDHWM, cfg.snd_hwm)
        self._sockets.append(sock)
        assert self._access is not None
        self._access.secure(sock, name)  # allowlist and CURVE, before bind
        sock.bind(f"tcp://{cfg.host}:{port or '*'}")
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.addresses[name] = endpoint.removeprefix("tcp://")
        return sock, zmq.Socket.shadow(sock.underlying)

    async def _bind_own(self, kind: str, port: int, name: str) -> ZmtpSocket:
        """An ingest socket on taproom's transport: a whole message is at most
        ``max_frame_bytes`` on the wire (a bigger one disconnects its peer, counted)."""
        sock = ZmtpSocket(
            kind,
            hub=self.hub,
            protocol="logjam",
            name=name,
            max_message_bytes=self.config.max_frame_bytes,
        )
        self._own.append(sock)
        self.addresses[name] = await sock.bind(self.config.host, port)
        return sock

    async def _bind_pub(self) -> ZmtpPublisher:
        """The XPUB on taproom's transport: ``snd_hwm`` messages and the [zmtp] byte bounds
        per subscriber, every message a subscriber misses counted."""
        pub = ZmtpPublisher(
            "XPUB",
            hub=self.hub,
            protocol="logjam",
            name="logjam_pub",
            hwm=self.config.snd_hwm,
            max_subscription_bytes=lj.MAX_PREFIX_BYTES,
        )
        self._own.append(pub)
        self.addresses["logjam_pub"] = await pub.bind(self.config.host, self.config.pub_port)
        return pub

    async def start(self) -> dict[str, str]:
        cfg = self.config
        self._ctx = zmq.asyncio.Context()
        self._access = ZmqAccess(self._ctx, self.hub.config, self.hub.metrics, "logjam")
        try:
            router = await self._bind_own("ROUTER", cfg.router_port, "logjam_router")
            pull = await self._bind_own("PULL", cfg.pull_port, "logjam_pull")
            pub = await self._bind_pub()
            replay, replay_sync = self._bind(
                zmq.ROUTER, cfg.replay_port, "logjam_replay", _REPLAY_FRAME_MAX_BYTES
            )
        except (zmq.ZMQError, OSError):
            self._close_sockets()
            raise
        self.pub.attach(pub, self.addresses["logjam_pub"].rsplit(":", 1)[1])
        # Every loop supervised (taproom.supervise): restarted if it dies, shown on /ready.
        spawn = self.hub.supervisor.spawn
        self._access.start(spawn)  # logjam.zap, logjam.handshakes.<listener> (CURVE)
        self._tasks = [
            spawn("logjam.router", partial(self.ingest.router_loop, router)),
            spawn("logjam.pull", partial(self.ingest.pull_loop, pull)),
            spawn("logjam.pub", self.pub.publish_loop),
            spawn("logjam.heartbeat", self.pub.heartbeat_loop),
            spawn("logjam.replay", partial(self.replay.replay_loop, replay, replay_sync)),
        ]
        return dict(self.addresses)

    async def stop(self) -> None:
        """Stop reading; let submitted batches commit so their 202s go out; close."""
        for task in self._tasks[:2]:
            task.cancel()
        if self.ingest.unacked:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self.ingest.settled.wait(), self.hub.config.hub.grace_period_s
                )
        for task in self._tasks[2:]:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.pub.subscription.close()
        if self._access is not None:
            await self._access.stop()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for own in self._own:
            own.close()
        self._own = []
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets = []
        if self._access is not None:
            self._access.close()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def subscriber_count(self) -> int:
        """Distinct live SUB prefixes on the XPUB."""
        return self.pub.subscriber_count()


def create_service(hub: Hub, config: LogjamConfig) -> LogjamService:
    return LogjamService(hub, config)
