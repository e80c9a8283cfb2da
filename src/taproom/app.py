"""``taproom serve``: start the hub, the web listener (ops endpoints, console) and every service.

Start-up order: journal and commit thread, web listener, protocol services; then the ready
file (JSON: listener name -> bound address) so scripts and tests using port 0 know where
everything is. Shutdown on SIGTERM/SIGINT: stop accepting, let in-flight commits finish and
their acks go out, close listeners, exit 0 within ``hub.grace_period_s``; a second signal
exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import logging
import os
import signal
import time
from typing import Any

import orjson
import zmq

from .access import open_listeners
from .config import Config
from .errors import StartupError
from .hub import Hub
from .servers import SERVICE_MODULES, Service
from .web.server import WebServer

__all__ = ["App", "run_app"]

log = logging.getLogger("taproom")


class App:
    """Everything ``taproom serve`` runs, usable in-process: ``async with App(config) as app``."""

    def __init__(self, config: Config, *, only: list[str] | None = None) -> None:
        self.config = config
        self.only = only
        try:
            self.hub = Hub(config)
        except OSError as exc:
            where = (
                f" ({exc.filename})" if exc.filename and exc.filename != config.journal.dir else ""
            )
            raise StartupError(
                f"journal.dir {config.journal.dir}: cannot open: {exc.strerror}{where}"
            ) from None
        self.services: dict[str, Service] = {}
        self.addresses: dict[str, str] = {}
        self._web: WebServer | None = None
        self.listeners_up = False

    def readiness(self) -> list[str]:
        reasons = self.hub.readiness()
        if not self.listeners_up:
            reasons.append("listeners not up")
        return reasons

    async def start(self) -> App:
        exposed = open_listeners(self.config)
        if exposed:
            log.warning(
                "open = true: %s accept%s connections from any address, with no access control",
                ", ".join(exposed),
                "s" if len(exposed) == 1 else "",
            )
        for warning in self.config.warnings:
            log.warning("configuration: %s", warning)
        await self.hub.start()
        web = self.config.web
        if web.enabled and (self.only is None or "web" in self.only):
            self._web = WebServer(
                self.hub, self.readiness, web, self.config.console, self.services, self.addresses
            )
            await self._listen("web", self._web)
        for name, module_name in SERVICE_MODULES.items():
            section = self.config.section(name) if name in self.config.names else None
            if section is None or not getattr(section, "enabled", False):
                continue
            if self.only is not None and name not in self.only:
                continue
            module = importlib.import_module(module_name)
            create = getattr(module, "create_service", None)
            if create is None:
                log.warning("%s: no server in this build; section ignored", name)
                continue
            service = create(self.hub, section)
            await self._listen(name, service)
            self.services[name] = service
        self.listeners_up = True
        return self

    async def _listen(self, name: str, service: Service | WebServer) -> None:
        try:
            self.addresses.update(await service.start())
        except (OSError, zmq.ZMQError) as exc:
            # asyncio's message names the address; pyzmq's names the endpoint.
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise StartupError(f"[{name}] cannot listen: {reason}") from None

    async def stop(self) -> None:
        self.listeners_up = False
        for name, service in reversed(list(self.services.items())):
            try:
                await service.stop()
            except Exception:
                log.exception("%s: error while stopping", name)
        if self._web is not None:
            await self._web.stop()
        await self.hub.stop()

    async def __aenter__(self) -> App:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _write_ready_file(path: str, addresses: dict[str, Any], journal_id: str) -> None:
    tmp = f"{path}.tmp"
    ready = {"pid": os.getpid(), "listeners": addresses, "journal_id": journal_id}
    with open(tmp, "wb") as f:
        f.write(orjson.dumps(ready, option=orjson.OPT_INDENT_2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


async def run_app(config: Config, ready_file: str | None = None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            log.warning("second signal: exiting at once")
            os._exit(1)
        log.info(
            "signal %s: shutting down (grace %.1fs)",
            signal.Signals(signum).name,
            config.hub.grace_period_s,
        )
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    app = App(config)
    try:
        await app.start()
    except BaseException:
        await app.stop()
        raise
    for name, address in sorted(app.addresses.items()):
        log.info("listening: %-22s %s", name, address)
    # What start-up made (modules, settings, the state services rebuilt) lives as long as the
    # process: out of the cyclic collector's generations, so that each full collection walks
    # only what came after (issue 32: 15-28% of the hub's CPU under Event BUS CHP updates was
    # the collector; see docs/architecture.md). Reference counting still frees these objects.
    gc.collect()
    gc.freeze()
    if ready_file:
        _write_ready_file(ready_file, app.addresses, app.hub.journal.id)
    log.info(
        "taproom ready; journal %s (id %s) at offset %d",
        config.journal.dir,
        app.hub.journal.id,
        app.hub.journal.next_offset,
    )
    await stop.wait()
    grace = config.hub.grace_period_s
    # Batches the journal still cannot take (disk full) are given up before the grace period
    # ends, so the services have the rest of it to stop (their waits end with those batches).
    app.hub.begin_shutdown(time.monotonic() + grace - min(2.0, grace / 2))
    try:
        await asyncio.wait_for(app.stop(), timeout=grace)
    except TimeoutError:
        log.error("grace period of %.1fs exceeded; exiting", grace)
        return 1
    finally:
        if ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ready_file)
    hub = app.hub
    if hub.unwritten_batches:
        # Not a failure of the stop: nothing of it was ever acknowledged, so the senders still
        # hold it and resend it to the next hub.
        log.warning(
            "stopped; %d events (batches: %d) were not written (%s) and never acknowledged: "
            "their senders resend them",
            hub.unwritten_events,
            hub.unwritten_batches,
            hub.journal_problem or "the journal was not writable",
        )
        return 0
    log.info("stopped cleanly")
    return 0
