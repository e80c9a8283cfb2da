"""Lager Bartender: registrar and forwarder (to be built under issue 7). Declares the config section."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import config_section, setting


@config_section("lager")
@dataclass(frozen=True)
class LagerConfig:
    enabled: bool = setting(True, "robot telemetry taps and mugs")
    host: str = setting("127.0.0.1", "loopback until an operator opts in to exposure")
    registrar_port: int = setting(
        12345, "CHP registrar: SNAPSHOT at P, PUBLISHER at P+1, COLLECTOR at P+2", min=0, max=65533
    )
    forwarder_port: int = setting(
        12348, "forwarder: taps publish to P, mugs subscribe at P+1", min=0, max=65534
    )
