"""Logjam ZeroMQ ingest and PUB output (to be built under issue 5). Declares the config section."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import config_section, setting


@config_section("logjam")
@dataclass(frozen=True)
class LogjamConfig:
    enabled: bool = setting(True, "logjam agents and consumers")
    host: str = setting("127.0.0.1", "loopback until an operator opts in to exposure")
    router_port: int = setting(
        9604, "logjam-device's ROUTER port for DEALER agents", min=0, max=65535
    )
    pull_port: int = setting(9605, "logjam-device's PULL port for PUSH agents", min=0, max=65535)
    pub_port: int = setting(9606, "logjam-device's PUB port for consumers", min=0, max=65535)
