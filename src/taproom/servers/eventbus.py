"""Event BUS (Clone pattern) server (to be built under issue 6). Declares the config section."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import config_section, setting


@config_section("eventbus")
@dataclass(frozen=True)
class EventBusConfig:
    enabled: bool = setting(True, "the durable Clone-pattern bus")
    host: str = setting("127.0.0.1", "loopback until an operator opts in to exposure")
    port: int = setting(
        5556,
        "P: SNAPSHOT at P, PUBLISHER at P+1, COLLECTOR at P+2 (the seed; zguide's 5556)",
        min=0,
        max=65533,
    )
