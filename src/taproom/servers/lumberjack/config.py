"""The ``[lumberjack]`` section, and the TLS context it describes."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass

from ...config import Config, config_check, config_section, setting
from ...errors import ConfigError
from ...protocols.lumberjack import (
    Limits,
)

_CLIENT_AUTH = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}

_FRAME_HEAD = 10  # the longest frame header (D and J: version, type, seq, length)


@config_section(
    "lumberjack",
    retired={
        "max_frame_bytes": "frames are read as a stream now; max_event_bytes bounds one event",
        "max_decompressed_bytes": "inflating is bounded by the memory budget's inflate share "
        "and max_event_bytes, not per window",
        "max_buffered_bytes": "unfinished frames reserve from the memory budget's "
        "connection_buffers share",
    },
)
@dataclass(frozen=True)
class LumberjackConfig:
    enabled: bool = setting(True, "Filebeat-style shippers are the most common source")
    host: str = setting("127.0.0.1", "loopback until an operator opts in to exposure")
    port: int = setting(5044, "the Beats/Logstash convention", min=0, max=65535)
    tls_cert: str = setting(
        "", "PEM certificate (chain); empty serves plain TCP like Beats' default"
    )
    tls_key: str = setting("", "PEM private key, PKCS#8 or PKCS#1 (Logstash users have both)")
    tls_ca: str = setting("", "PEM CA bundle that client certificates must chain to")
    tls_client_auth: str = setting(
        "none",
        "Logstash's default; 'required' is for fleets with client certificates",
        choices=("none", "optional", "required"),
    )
    max_window: int = setting(
        10_000, "go-lumber closes on a larger W; Filebeat sends at most 2048", min=1, max=1 << 24
    )
    max_event_bytes: int = setting(
        12 * 1024 * 1024,
        "one event (a J payload or a D frame): the journal stores it whole, so it is the one "
        "size bound; Filebeat caps a message at 10 MiB (max_bytes) and adds ~1 KiB of fields "
        "and its JSON escaping. Windows and C frames have no size bound: they are streamed",
        min=1024,
        max=63 * 1024 * 1024,  # under the journal's bound on one record's payload
    )
    max_pairs: int = setting(
        1024, "logstash-forwarder sends ~5 pairs per D frame; thousands is an attack", min=1
    )
    max_nesting: int = setting(
        3, "real senders nest C at most once; recursion must stay bounded", min=1, max=16
    )
    max_batch_bytes: int = setting(
        8 * 1024 * 1024,
        "a window larger than this is journaled in parts (its ack waits for the last part)",
        min=64 * 1024,
    )
    max_connections: int = setting(
        4096, "one or a few connections per shipper; an idle one costs ~5 KiB (bench)", min=1
    )
    accept_backlog: int = setting(
        128,
        "asyncio accepts this many in one go: 1024 let a connect/RST flood hold the loop long "
        "enough that /health took over 1 s; the kernel's SYN retries pace the flood instead",
        min=16,
        max=65535,
    )
    max_connections_per_peer: int = setting(
        256,
        "Filebeat opens one per worker; room for a NAT gateway in front of a fleet, while one "
        "host can hold at most 1/16 of max_connections",
        min=1,
    )
    peer_connections_per_s: float = setting(
        64.0,
        "new connections one address may open a second once its burst is spent: shippers "
        "reconnect after errors with backoff; a connect loop costs a TLS handshake each",
        min=0.01,
    )
    peer_connection_burst: int = setting(
        256,
        "new connections one address may open at once: a NAT gateway's whole fleet "
        "reconnecting after a restart of the hub (max_connections_per_peer)",
        min=1,
    )
    resend_memory_events: int = setting(
        100_000,
        "events remembered (8 bytes each) of windows whose connection ended before they were "
        "complete, so the sender's resend of them is stored once: 48 of Filebeat's 2048-event "
        "windows",
        min=0,
        max=10_000_000,
    )
    idle_timeout_s: float = setting(
        60.0,
        "no complete frame for this long: Filebeat's default client timeout is 30 s; twice that "
        "is surely dead (a trickle of bytes does not count as alive)",
        min=0.1,
    )
    handshake_timeout_s: float = setting(
        10.0, "a TLS handshake that takes longer is a stuck or hostile peer", min=0.1
    )
    tls_shutdown_timeout_s: float = setting(
        2.0,
        "closing TLS flushes our acks, then waits for close_notify, which go-lumber and "
        "logstash-forwarder never send (asyncio waits 30 s)",
        min=0.1,
        max=60,
    )
    idle_ack_s: float = setting(
        0.2,
        "streaming v1 senders (npm lumberjack-protocol) never finish a window: ack when quiet",
        min=0.001,
        max=60,
    )
    keepalive_s: float = setting(
        3.0, "v2 only: go-lumber sends keepalive acks every 3 s while a commit is pending", min=0.1
    )
    stream_fields: tuple[str, ...] = setting(
        ("fields.app", "beat.name", "agent.name"),
        "Beats put the app in fields.app by convention; else the shipper's name",
    )
    topic_fields: tuple[str, ...] = setting(
        ("type", "fields.type"), "logstash-forwarder and old Beats set type; new ones fields.type"
    )

    def validate(self) -> None:
        """Check the limits fit together and the TLS files load (``taproom validate``)."""
        if self.tls_key and not self.tls_cert:
            raise ConfigError("tls_key given without tls_cert", key="tls_cert")
        if self.tls_ca and not self.tls_cert:
            raise ConfigError("tls_ca given without tls_cert", key="tls_cert")
        if self.tls_client_auth != "none" and not self.tls_ca:
            raise ConfigError(
                f"client auth {self.tls_client_auth!r} needs tls_ca", key="tls_client_auth"
            )
        if not self.tls_cert:
            return
        if not self.tls_key:
            raise ConfigError("tls_cert given without tls_key", key="tls_key")
        for key in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, key)
            if path and not os.path.isfile(path):
                raise ConfigError(f"{path}: no such file", key=key)
        server_ssl_context(self)

    @property
    def limits(self) -> Limits:
        return Limits(
            max_window=self.max_window,
            max_event_bytes=self.max_event_bytes,
            max_pairs=self.max_pairs,
            max_nesting=self.max_nesting,
            max_batch_bytes=self.max_batch_bytes,
        )


@config_check
def _event_fits_the_budget(config: Config) -> None:
    """One event must fit in the holders it passes through, or it could never be received."""
    try:
        section = config.section("lumberjack")
        hub = config.section("hub")
    except KeyError:
        return
    if not section.enabled:
        return
    need = section.max_event_bytes + _FRAME_HEAD
    for key in ("connection_buffer_bytes", "max_inflate_bytes"):
        if getattr(hub, key) < need:
            raise ConfigError(
                f"{section.max_event_bytes} does not fit in hub.{key} ({getattr(hub, key)}) "
                "with its frame header: raise that or lower this",
                key="lumberjack.max_event_bytes",
            )


def server_ssl_context(config: LumberjackConfig) -> ssl.SSLContext:
    """TLS 1.2+ server context; raises :class:`ConfigError` naming the key at fault."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)
    except ssl.SSLError as exc:
        raise ConfigError(
            f"certificate and key do not load together: {exc}", key="tls_key"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc}", key="tls_cert") from None
    if config.tls_ca:
        try:
            ctx.load_verify_locations(cafile=config.tls_ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"not a PEM CA bundle: {exc}", key="tls_ca") from None
    ctx.verify_mode = _CLIENT_AUTH[config.tls_client_auth]
    return ctx
