"""The ``[zmtp]`` section: bounds of taproom's own ZeroMQ transport, shared by every socket it
binds (the message bound itself is each service's: logjam ``max_frame_bytes``, ...; so is a
publisher's HWM in messages: logjam ``snd_hwm``, ...)."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import config_section, setting

__all__ = ["ZmtpConfig"]


@config_section("zmtp")
@dataclass(frozen=True)
class ZmtpConfig:
    max_connections: int = setting(
        4096,
        "connections per ZeroMQ listener (a fleet's agents each keep one); more are closed at "
        "accept and counted (too_many_connections)",
        min=1,
        max=1_000_000,
    )
    handshake_timeout_s: float = setting(
        10.0,
        "a peer has this long from connect to READY (libzmq peers take milliseconds); then it "
        "is closed and counted (handshake_timeout)",
        min=0.1,
        max=3600,
    )
    max_handshake_bytes: int = setting(
        16384,
        "greeting + the peer's READY with its metadata (libzmq sends ~40 bytes; an Identity is "
        "at most 255)",
        min=512,
        max=1 << 20,
    )
    max_command_bytes: int = setting(
        4096,
        "a command after the handshake (PING, PONG, SUBSCRIBE, ERROR: tens of bytes; a "
        "subscription topic is bounded by the service too)",
        min=64,
        max=1 << 20,
    )
    read_buffer_bytes: int = setting(
        16384,
        "what a connection reads into at first: a few logjam messages; a busy connection grows "
        "to busy_buffer_bytes, a bigger message to its size, all reserved from the budget",
        min=1024,
        max=1 << 24,
    )
    busy_buffer_bytes: int = setting(
        262144,
        "a connection that fills its buffer gets this much (when the budget has room): fewer, "
        "larger reads at full rate",
        min=1024,
        max=1 << 28,
    )
    partial_timeout_s: float = setting(
        30.0,
        "an unfinished message may hold reserved room this long (a peer sends a message in "
        "one write); then the peer is closed and counted (partial_timeout)",
        min=0.1,
        max=3600,
    )
    max_reply_bytes: int = setting(
        4 * 1024 * 1024,
        "bytes queued to one peer that does not read (ROUTER replies); further replies to it "
        "are dropped and counted, as libzmq's ROUTER drops at its send HWM",
        min=4096,
        max=1 << 30,
    )
    max_subscriber_bytes: int = setting(
        4 * 1024 * 1024,
        "what one subscriber of a publisher may have queued beyond what the kernel took (also "
        "at most its share of hub.output_queue_bytes): a logjam burst (burst_bytes) fits whole, "
        "so one that keeps up on average loses nothing to bursts; past it, messages it misses "
        "are dropped and counted (subscriber_bytes)",
        min=4096,
        max=1 << 30,
    )
    max_subscriptions: int = setting(
        4096,
        "prefixes one subscriber may hold (a logjam importer subscribes per app-env: hundreds "
        "at most); each is compared with every message's topic; more: disconnected and "
        "counted (too_many_subscriptions)",
        min=1,
        max=1_000_000,
    )
    subscriber_send_buffer_bytes: int = setting(
        0,
        "the kernel send buffer of each subscriber connection (SO_SNDBUF); 0 leaves it to the "
        "OS (Linux grows it to net.ipv4.tcp_wmem's maximum, 4 MiB, per slow subscriber: kernel "
        "memory, outside the process budget); set it to bound that with many subscribers",
        min=0,
        max=1 << 30,
    )
