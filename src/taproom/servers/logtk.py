"""LogTK WebSocket/TCP server glue (to be built under issue 4). Declares the config section."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import config_section, setting


@config_section("logtk")
@dataclass(frozen=True)
class LogTKConfig:
    enabled: bool = setting(True, "browser and app loggers speak LogTK")
    host: str = setting("127.0.0.1", "loopback until an operator opts in to exposure")
    ws_port: int = setting(7080, "LogTK over WebSocket", min=0, max=65535)
    tcp_port: int = setting(7081, "LogTK over raw TCP", min=0, max=65535)
