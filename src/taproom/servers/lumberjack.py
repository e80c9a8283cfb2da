"""Lumberjack v1/v2 server glue (to be built under issue 3). Declares the config section."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import config_section, setting


@config_section("lumberjack")
@dataclass(frozen=True)
class LumberjackConfig:
    enabled: bool = setting(True, "Filebeat-style shippers are the most common source")
    host: str = setting("127.0.0.1", "loopback until an operator opts in to exposure")
    port: int = setting(5044, "the Beats/Logstash convention", min=0, max=65535)
