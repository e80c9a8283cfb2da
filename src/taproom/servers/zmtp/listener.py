"""What taproom's ZeroMQ listeners share (readers in ``transport``, publishers in
``publisher``): the ``[zmtp]`` settings, a rate-limited refusal log, how a handshake's
failure is counted, and the supervised sweep each bound listener runs."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ...hub import Hub
from ...protocols import zmtp as zp
from .config import ZmtpConfig

__all__ = ["RateLimitedLog", "handshake_refusal", "listening", "zmtp_config"]

log = logging.getLogger("taproom.zmtp")

_CURVE_REASONS = {
    "mechanism": "mechanism_mismatch",
    "handshake_failed": "handshake_failed",
    "curve_key_not_allowed": "curve_key_not_allowed",
    "bad_handshake": "handshake_failed",
}
_LOG_PER_SECOND = 10


def zmtp_config(hub: Hub) -> ZmtpConfig:
    try:
        return hub.config.zmtp
    except AttributeError:
        return ZmtpConfig()


class RateLimitedLog:
    def __init__(self) -> None:
        self._window = 0.0
        self._count = self._suppressed = 0

    def __call__(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._window >= 1.0:
            if self._suppressed:
                log.info("zmtp: %d more refusals not logged", self._suppressed)
            self._window, self._count, self._suppressed = now, 0, 0
        if self._count < _LOG_PER_SECOND:
            self._count += 1
            log.info(msg, *args)
        else:
            self._suppressed += 1


def handshake_refusal(exc: zp.ZmtpError, curve: bool) -> tuple[str, bool]:
    """The reason a failed handshake is counted under, and whether it is an access refusal
    (a CURVE listener's: counted by the access policy, as the ZAP handler counts them)."""
    if curve and exc.reason in _CURVE_REASONS:
        return _CURVE_REASONS[exc.reason], True
    return exc.reason, False


def listening(
    hub: Hub,
    name: str,
    host: str,
    bound: int,
    sweep: Callable[[], Coroutine[Any, Any, None]],
    loop: asyncio.AbstractEventLoop,
) -> tuple[str, asyncio.Task[None]]:
    """A bound listener's ``host:port`` and its sweep loop, supervised when the hub has a
    supervisor (restarted if it ever dies: taproom.supervise)."""
    address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
    supervisor = getattr(hub, "supervisor", None)
    if supervisor is not None:
        return address, supervisor.spawn(f"zmtp.{name}", sweep)
    return address, loop.create_task(sweep(), name=f"zmtp.{name}")
