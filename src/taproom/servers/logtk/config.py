"""The ``[logtk]`` settings and the apps allowed to log."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from ...config import config_section, setting
from ...errors import ConfigError
from ...protocols.logtk import PongPolicy, ServerSettings

__all__ = ["APP_NAME", "LogTKApp", "LogTKConfig", "hash_token"]

_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
APP_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True)
class LogTKApp:
    """One application allowed to log: ``[logtk.apps.<name>]``."""

    token_sha256: str = setting(
        "", "hex SHA-256 of the app's 64-byte token: the hub never stores the token itself"
    )

    def validate(self) -> None:
        if not _HEX64.match(self.token_sha256):
            raise ConfigError("must be 64 hex digits (sha256 of the token)", key="token_sha256")


@config_section("logtk")
@dataclass(frozen=True)
class LogTKConfig:
    enabled: bool = setting(True, "browser and app loggers speak LogTK")
    host: str = setting("127.0.0.1", "loopback until an operator opts in to exposure")
    ws_port: int = setting(7080, "LogTK over WebSocket", min=0, max=65535)
    tcp_port: int = setting(7081, "LogTK over raw TCP", min=0, max=65535)
    apps: dict[str, LogTKApp] = setting(
        None, "apps and their hashed tokens; none configured means nobody can log", factory=dict
    )
    path_prefix: str = setting("/logging/", "the reference client's convention: /logging/<app>")
    wildcard_namespace: bool = setting(
        False,
        "accept any /logging/<name> whose token matches some app (stream = <name>); off: 404",
    )
    formats: tuple[str, ...] = setting(
        ("protobuf", "bson", "json"), "the formats taproom can decode for tail and outputs"
    )
    max_frame_bytes: int = setting(
        1024 * 1024, "one log entry per frame; a megabyte is a bug, not a log line", min=64
    )
    max_data_bytes: int = setting(
        512 * 1024,
        "the serialized entry inside a data frame; a longer one is stored cut to this and acked",
        min=16,
        max=64 * 1024 * 1024,
    )
    max_auth_frame_bytes: int = setting(
        256,
        "TCP: an auth frame is 67 bytes; an unauthenticated peer gets no more room than this",
        min=69,
        max=65536,
    )
    max_unacked: int = setting(
        4096, "data frames read but not yet acked per connection before reading pauses", min=1
    )
    max_connections: int = setting(
        1024, "per listener; each costs a task and buffers", min=1, max=1_000_000
    )
    max_connections_per_peer: int = setting(
        256,
        "per listener and address: a logtkjs reconnect storm (1,026 sockets in 2 s from one "
        "address) leaves 3/4 of max_connections to everyone else; a NAT of 256 browsers fits",
        min=1,
        max=1_000_000,
    )
    peer_connections_per_s: float = setting(
        64.0,
        "new connections one address may open a second once its burst is spent (a storm "
        "runs at ~500/s; an app reconnects once)",
        min=0.01,
    )
    peer_connection_burst: int = setting(
        256, "new connections one address may open at once (max_connections_per_peer)", min=1
    )
    listen_backlog: int = setting(
        4096,
        "each listener's kernel accept queue (capped by net.core.somaxconn): with asyncio's "
        "100 a connect/RST flood of ~300 cycles/s dropped SYNs, so honest connects waited 1 s",
        min=16,
        max=65535,
    )
    handshake_timeout_s: float = setting(
        10.0, "auth and init take one round trip each; slow handshakes hold slots", min=0.1
    )
    idle_timeout_s: float = setting(
        600.0, "the reference client never pongs: silence this long ends a connection", min=1
    )
    ping_enabled: bool = setting(True, "the server's ping_recv: LogTK pings find dead TCP peers")
    ping_min_delta_ms: int = setting(
        1000, "the server's side of max(client, server)/2 (the seed's example value)", min=1
    )
    pong_policy: str = setting(
        "after_first_pong",
        "two missed pongs close a connection once it has ponged (taproom's client does); "
        "the reference client never pongs and is tolerated",
        choices=("always", "after_first_pong", "never"),
    )
    ws_ping_interval_s: float = setting(
        20.0,
        "WebSocket pings (websockets' default): an answer counts as activity, so an app that "
        "logs rarely keeps its connection; 0 disables them",
        min=0,
    )
    ws_ping_timeout_s: float = setting(
        20.0, "a WebSocket ping unanswered this long means the peer is gone", min=0.1
    )
    ws_compression: bool = setting(
        False,
        "permessage-deflate costs CPU on the hub's one core; LogTK entries are compact binary",
    )
    dedup_window_s: float = setting(
        3600.0,
        "idempotency tokens remembered this long: covers 1 s resends and cache replays after "
        "a client restart within the hour",
        min=1,
    )
    dedup_max_entries: int = setting(
        4_000_000, "bounds the index's memory (~60 B each); the oldest bucket goes first", min=1000
    )
    dedup_rebuild_max_records: int = setting(
        10_000_000, "journal records read at most at start to rebuild the index", min=0
    )
    dedup_checkpoint_interval_s: float = setting(
        60.0,
        "the index is saved beside the journal at least this often while anything changed "
        "(and at stop) so a restart reads only the journal after it; 0: never, a restart "
        "reads the whole window",
        min=0,
    )
    dedup_checkpoint_after_events: int = setting(
        100_000,
        "the index is also saved once this many keys were added since the last save: a "
        "restart re-reads at most about that many LogTK records (~2 us each)",
        min=1,
    )
    dedup_checkpoint_size_ratio: float = setting(
        0.1,
        "...and at least this share of the keys it holds: a save writes every key (~0.05 us "
        "each, numpy), so it costs at most ~0.5 us per key added, and a restart re-reads at "
        "most a tenth of a big index (4 M keys: 400 k records, ~0.8 s)",
        min=0.0,
        max=100.0,
    )
    auth_failures_per_minute: float = setting(
        10.0, "failed authentications refill this fast per peer address", min=0.1
    )
    auth_failure_burst: int = setting(
        20, "failed authentications a peer may make at once before being refused", min=1
    )
    max_tracked_peers: int = setting(10_000, "rate-limiter memory bound (oldest dropped)", min=1)

    def validate(self) -> None:
        for name in self.apps:
            if not APP_NAME.match(name):
                raise ConfigError("app names are 1-64 of [A-Za-z0-9_.-]", key=f"apps.{name}")
        if not self.path_prefix.startswith("/") or not self.path_prefix.endswith("/"):
            raise ConfigError("must start and end with '/'", key="path_prefix")

    def server_settings(self) -> ServerSettings:
        return ServerSettings(
            formats=tuple(self.formats),
            max_frame_bytes=self.max_frame_bytes,
            max_data_bytes=min(self.max_data_bytes, self.max_frame_bytes),
            max_auth_frame_bytes=self.max_auth_frame_bytes,
            ping_recv=self.ping_enabled,
            ping_min_delta_ms=self.ping_min_delta_ms,
            pong_policy=PongPolicy(self.pong_policy),
            handshake_timeout_s=self.handshake_timeout_s,
            idle_timeout_s=self.idle_timeout_s,
        )


def hash_token(token: bytes) -> str:
    """What goes into ``token_sha256``."""
    return hashlib.sha256(token).hexdigest()
