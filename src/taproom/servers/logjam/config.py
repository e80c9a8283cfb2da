"""The ``[logjam]`` configuration section: ports, limits, output and replay settings."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import Config, config_check, config_section, setting
from ...errors import ConfigError
from ...protocols import logjam as lj

__all__ = ["LogjamConfig"]


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
    replay_port: int = setting(
        9607, "replay side channel: the port after logjam-device's three", min=0, max=65535
    )
    rcv_hwm: int = setting(
        1000,
        "messages libzmq queues per connection of the libzmq sockets (replay requests, "
        "subscriptions); the ROUTER and PULL are taproom's transport, bounded in bytes",
        min=1,
    )
    snd_hwm: int = setting(
        100_000,
        "messages queued per subscriber beyond what the kernel took (about 50 MB of logjam "
        "requests; [zmtp] max_subscriber_bytes bounds the bytes) before drops, counted",
        min=1,
    )
    max_message_bytes: int = setting(
        4 * 1024 * 1024,
        "a body frame may be at most this (400 body_too_large): logjam request bodies are KBs",
        min=1024,
        max=1 << 30,
    )
    max_frame_bytes: int = setting(
        8 * 1024 * 1024,
        "a whole message on the ROUTER and PULL (every frame, checked at each header before "
        "the frame is read): bodies over max_message_bytes are still read and answered 400; "
        "a peer sending more is disconnected and counted (message_too_large)",
        min=1024,
        max=1 << 30,
    )
    max_decompressed_bytes: int = setting(
        8 * 1024 * 1024,
        "a body may inflate to at most this (zlib bombs), checked before allocating; with "
        "burst_bytes it is what a burst reserves from hub.max_inflate_bytes, shared with "
        "Lumberjack (logjam request bodies are KBs)",
        min=1024,
        max=64 * 1024 * 1024,
    )
    burst_messages: int = setting(
        4096, "messages drained per read before one batch goes to the journal", min=1
    )
    burst_bytes: int = setting(
        4 * 1024 * 1024,
        "decompressed bytes one burst may hold before its batch goes to the journal: small "
        "compressed bodies cannot inflate a burst past this plus one body",
        min=1024,
        max=1 << 30,
    )
    device_number: int = setting(
        1,
        "non-zero so importers track gaps; must be unique across logjam producers (seed)",
        min=0,
        max=(1 << 32) - 1,
    )
    heartbeat_interval_s: float = setting(
        5.0, "logjam-device publishes a heartbeat every 5 s", min=0.01, max=3600
    )
    sequence_wrap: int = setting(
        (1 << 64) - 1,
        "the last sequence number before restarting at 1 (seed); lower only for tests",
        min=2,
        max=(1 << 64) - 1,
    )
    output_compression: str = setting(
        "none",
        "logjam-device forwards uncompressed by default; consumers decompress any method",
        choices=("none", "zlib", "snappy", "lz4"),
    )
    meta_size: int = setting(
        24, "24-byte meta is what logjam-tools reads; 22 is the seed's form", choices=(22, 24)
    )
    grammar: str = setting(
        "device",
        "accept what logjam-device accepts (its well_formed_stream_name and well_formed_topic); "
        "'seed' is the seed's stricter ABNF",
        choices=lj.GRAMMARS,
    )
    routes: tuple[str, ...] = setting(
        ("*",), "protocols whose events reach the PUB output; '*' is every protocol"
    )
    default_app_env: str = setting(
        "taproom-{protocol}",
        "app-env for events whose stream is not a valid app-env",
    )
    event_protocols: tuple[str, ...] = setting(
        ("eventbus", "lager"), "protocols mapped to events.* topics (others to logs.*)"
    )
    replay_max_count: int = setting(
        10_000, "events examined per replay request: bounds one reply's memory", min=1
    )
    replay_index_size: int = setting(
        1_000_000,
        "sequence numbers remembered for 'seq' replay requests (8 bytes each)",
        min=16,
        max=100_000_000,
    )
    hostname: str = setting(
        "",
        "heartbeat and ping replies; empty means the canonical host name (getaddrinfo "
        "AI_CANONNAME), as logjam-device names itself",
    )

    def validate(self) -> None:
        if self.meta_size == 22 and self.device_number > 0xFFFF:
            raise ConfigError("the 22-byte meta holds a 16-bit device number", key="device_number")
        try:
            sample = self.default_app_env.format(protocol="lumberjack")
        except (KeyError, IndexError, ValueError):
            raise ConfigError("only {protocol} may be filled in", key="default_app_env") from None
        if self.max_frame_bytes < self.max_message_bytes:
            raise ConfigError(
                "must be at least max_message_bytes, or no oversized body could be answered",
                key="max_frame_bytes",
            )
        if not lj.is_valid_app_env(sample.encode(), grammar=self.grammar):
            raise ConfigError(
                f"gives {sample!r}, not an app-env (application-environment)",
                key="default_app_env",
            )


@config_check
def _burst_fits_the_inflate_share(config: Config) -> None:
    """A burst reserves burst_bytes + max_decompressed_bytes of the budget's inflate holder
    (taproom.budget): it must fit, or bursts would pass the bound."""
    try:
        section = config.section("logjam")
        hub = config.section("hub")
    except KeyError:
        return
    if not section.enabled:
        return
    need = section.burst_bytes + section.max_decompressed_bytes
    if need > hub.max_inflate_bytes:
        raise ConfigError(
            f"burst_bytes + max_decompressed_bytes ({need}) is over hub.max_inflate_bytes "
            f"({hub.max_inflate_bytes}), what a burst may inflate: raise that or lower these",
            key="logjam.max_decompressed_bytes",
        )
