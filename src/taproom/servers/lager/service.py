"""The Bartender service: the registrar and the forwarder on one ZeroMQ context, started and
stopped together on the hub's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import zmq
import zmq.asyncio

from ...access import LISTENERS
from ...hub import Hub
from ...zmqaccess import ZmqAccess
from ..zmtp import ZmtpPublisher, ZmtpSocket
from .config import FORWARDER_FOLLOWS_REGISTRAR, FORWARDER_OFFSET, LagerConfig
from .forwarder import Forwarder
from .registrar import RegistrarServer
from .sockets import Bindable, bind_offsets

__all__ = ["LagerService", "create_service"]

log = logging.getLogger("taproom.lager")


class LagerService:
    """The Bartender: registrar + forwarder. ``start()`` binds; ``stop()`` checkpoints."""

    def __init__(self, hub: Hub, config: LagerConfig) -> None:
        self.hub = hub
        self.config = config
        self._ctx: zmq.asyncio.Context | None = None
        self._access: ZmqAccess | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._last_log: dict[str, float] = {}
        self.forwarder = Forwarder(
            hub,
            config,
            lambda: self.registrar.registrar,
            self._reject,
            touch=lambda uuids, now: self.registrar.touch(uuids, now),
        )
        self.registrar = RegistrarServer(
            hub,
            config,
            self._reject,
            on_change=self.forwarder.formats_changed,
            on_applied=self.forwarder.registered,
            on_hugz=self.forwarder.repeat_marks,
        )

    async def start(self) -> dict[str, str]:
        await asyncio.to_thread(self.registrar.restore)
        self._ctx = ctx = zmq.asyncio.Context()
        self.registrar.open(ctx)
        self.forwarder.open()
        self._access = access = ZmqAccess(ctx, self.hub.config, self.hub.metrics, "lager")
        try:
            for sock, name in zip(
                # the registrar's sockets, then the forwarder's: access.LISTENERS' order
                (*self.registrar.sockets, *self.forwarder.sockets),
                LISTENERS["lager"],
                strict=True,
            ):
                if not isinstance(sock, ZmtpSocket | ZmtpPublisher):  # theirs at accept
                    access.secure(sock, name)  # allowlist and CURVE, before bind
            addresses = await self._bind()
        except (zmq.ZMQError, OSError):
            self.registrar.collector.close()
            self.registrar.publisher.close()
            self.forwarder.close()
            access.close()
            ctx.destroy(linger=0)  # the app never calls stop() for a service that failed
            self._ctx = None
            raise
        access.start(self.hub.supervisor.spawn)  # lager.zap, lager.handshakes.<listener>
        # Every loop supervised (taproom.supervise): restarted if it dies, shown on /ready.
        for part, loops in (
            ("registrar", self.registrar.loops),
            ("forwarder", self.forwarder.loops),
        ):
            for loop in loops:
                name = f"lager.{part}.{loop.__name__.strip('_').removesuffix('_loop')}"
                self._tasks.append(self.hub.supervisor.spawn(name, loop))
        return addresses

    async def _bind(self) -> dict[str, str]:
        """nasa/lager's layout by default: registrar at P..P+2, forwarder at P+10..P+12 (with
        port 0, one free base for all six); or the forwarder at its own configured base."""
        cfg = self.config
        registrar: list[tuple[Bindable, int]] = list(
            zip(self.registrar.sockets, range(3), strict=True)
        )
        forwarder: list[tuple[Bindable, int]] = list(
            zip(self.forwarder.sockets, range(3), strict=True)
        )
        if cfg.forwarder_port == FORWARDER_FOLLOWS_REGISTRAR:
            shifted = [(sock, FORWARDER_OFFSET + i) for sock, i in forwarder]
            base = await bind_offsets(
                registrar + shifted, cfg.host, cfg.registrar_port, cfg.port_retries
            )
            fwd_base = base + FORWARDER_OFFSET
        else:
            base = await bind_offsets(registrar, cfg.host, cfg.registrar_port, cfg.port_retries)
            fwd_base = await bind_offsets(forwarder, cfg.host, cfg.forwarder_port, cfg.port_retries)
        return {**self.registrar.bound(base), **self.forwarder.bound(fwd_base)}

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        inflight = self.forwarder.inflight
        if inflight:  # rows already accepted: let their commits land and forward them
            await asyncio.wait(set(inflight), timeout=self.hub.config.hub.grace_period_s)
        self.forwarder.closing = True
        await self.registrar.close()
        self.forwarder.close()
        if self._access is not None:
            await self._access.stop()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _reject(self, reason: str, detail: str) -> None:
        self.hub.metrics.rejected("lager", reason)
        now = time.monotonic()
        if now - self._last_log.get(reason, 0.0) >= 1.0:  # a flood of bad input, one line a second
            self._last_log[reason] = now
            log.warning("lager: rejected (%s): %s", reason, detail[:200])


def create_service(hub: Hub, section: LagerConfig) -> LagerService:
    return LagerService(hub, section)
