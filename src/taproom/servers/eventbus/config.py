"""The ``[eventbus]`` configuration section: ports, roles, limits and timings."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import config_section, setting
from ...errors import ConfigError
from ...protocols.eventbus import (
    Limits,
)


@config_section(
    "eventbus",
    retired={
        "collector_hwm": "the collectors are read by taproom's own ZMTP transport: "
        "bounded in bytes by the memory budget's connection_buffers and [zmtp]"
    },
)
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
    chp: bool = setting(
        False,
        "the ØMQ Guide's own Clone wire (kvmsg) beside the seed's: off, as the seed is the "
        "contract and it opens three more ports",
    )
    chp_port: int = setting(
        5576,
        "P of the CHP group: SNAPSHOT at P, PUBLISHER at P+1, COLLECTOR at P+2 (the Guide's "
        "layout; its 5556 is the seed group's here)",
        min=0,
        max=65533,
    )
    chp_collector: str = setting(
        "sub",
        "sub: Clone model 6 clients publish to both servers of a pair; pull: model 5 clients "
        "push (ZeroMQ refuses the other kind at the handshake)",
        choices=("sub", "pull"),
    )
    role: str = setting(
        "standalone",
        "one bus needs no peer; primary/backup form a Binary Star pair (set peer too)",
        choices=("standalone", "primary", "backup"),
    )
    peer: str = setting(
        "", "the other server's host:P when role is primary or backup (zguide uses 5556/5566)"
    )
    heartbeat_ms: int = setting(
        1000, "HUGZ once a second, as the Clone pattern does", min=10, max=60_000
    )
    peer_timeout_ms: int = setting(
        3000,
        "a peer silent for 3 heartbeats is taken as dead (bstar uses 2; one spare for GC pauses)",
        min=20,
        max=600_000,
    )
    replicate_timeout_ms: int = setting(
        2000,
        "longest a broadcast waits for the peer's REPLICATED before going out unreplicated",
        min=10,
        max=600_000,
    )
    snapshot_timeout_ms: int = setting(
        10_000, "a snapshot (to a client or from the peer) that takes longer is abandoned", min=100
    )
    snapshot_settle_ms: int = setting(
        1000,
        "longest a snapshot waits for the updates accepted before it to commit; then it is served "
        "as it stands (a slow disk must not make a Clone client, whose server_ttl is a few "
        "seconds, take the server for dead)",
        min=0,
        max=600_000,
    )
    max_topic_bytes: int = setting(1024, "topics are paths, not payloads", min=8, max=65535)
    max_producer_bytes: int = setting(256, "a producer id names a process", min=1, max=65535)
    max_data_bytes: int = setting(
        1024 * 1024,
        "events are state updates; a MiB is far above any sane one",
        min=64,
        max=63 * 1024 * 1024,  # under the journal's 64 MiB per record, with room for the rest
    )
    max_subtrees: int = setting(64, "subtrees per SYNCSTART", min=1, max=4096)
    max_properties_bytes: int = setting(
        4096, "kvmsg properties are a few name=value lines", min=64, max=65535
    )
    max_keys: int = setting(
        100_000,
        "topics the hashmap holds (each costs ~0.6 KiB besides its data); an update that "
        "would add one more is refused",
        min=1,
    )
    max_hashmap_bytes: int = setting(
        12 * 1024 * 1024,
        "memory the latest-value hashmap may take (frames + per-entry overhead): its share of "
        "hub.memory_budget_bytes (about 19,000 small topics, or 12 of 1 MiB); an update that "
        "would grow it past this is refused",
        min=1024 * 1024,
    )
    max_held: int = setting(
        10_000,
        "client updates a passive server holds for a takeover (clonesrv6's pending list); "
        "the oldest go first",
        min=0,
    )
    max_held_bytes: int = setting(
        16 * 1024 * 1024, "bytes of held updates a passive server keeps", min=0
    )
    ttl_check_ms: int = setting(
        1000, "how often expired ttl keys are deleted (clonesrv's flush_ttl: once a second)", min=10
    )
    max_snapshots: int = setting(
        16, "snapshots sent at once; more SYNCSTARTs wait (each holds a list of its keys)", min=1
    )
    dedup_window: int = setting(
        100_000, "event UUIDs remembered to drop a retrying producer's duplicates", min=0
    )
    max_burst: int = setting(
        4096, "PUB commands drained into one journal batch before yielding", min=1, max=65536
    )
    max_burst_bytes: int = setting(
        4 * 1024 * 1024,
        "data bytes drained into one journal batch: the hub's capacity is checked between "
        "bursts, so a burst of large values must not hold many of them at once",
        min=64 * 1024,
    )
    burst_read_ms: float = setting(
        2.0,
        "how long one journal batch goes on reading commands that are ready: a longer batch "
        "costs less per event, and its first event waits that much longer for its commit",
        min=0.0,
        max=1000.0,
    )
    publisher_hwm: int = setting(
        100_000,
        "BROADCASTs queued per subscriber beyond what the kernel took ([zmtp] "
        "max_subscriber_bytes bounds the bytes) before drops, each counted (a client sees a gap)",
        min=1,
    )
    snapshot_hwm: int = setting(
        100_000, "SYNC commands queued per snapshot client: a 100k-key snapshot in one go", min=1
    )
    checkpoint_interval_s: float = setting(
        60.0,
        "the hashmap is saved beside the journal at least this often while anything changed, "
        "so a restart reads only the journal after it (0: never; a restart reads every bus "
        "record of the journal)",
        min=0,
    )
    checkpoint_after_events: int = setting(
        10_000,
        "the hashmap is also saved once this many bus events (and at least as many as it "
        "holds topics) were applied since the last save: a restart re-applies at most about "
        "that many (~3 us each), and a save costs about one topic per event applied",
        min=1,
    )
    resync_buffer: int = setting(
        1_000_000,
        "replicated events a passive server holds while it copies a snapshot from its peer",
        min=1,
    )

    def validate(self) -> None:
        if self.role != "standalone" and not self.peer:
            raise ConfigError("role primary/backup needs peer = 'host:port'", key="peer")
        if self.peer:
            host, _, port = self.peer.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) <= 65533:
                raise ConfigError("peer must be 'host:port' (the peer's P)", key="peer")
        if self.chp and self.port and self.chp_port and abs(self.chp_port - self.port) < 3:
            raise ConfigError("chp_port's three ports overlap port's", key="chp_port")

    def limits(self) -> Limits:
        return Limits(
            self.max_topic_bytes,
            self.max_producer_bytes,
            self.max_data_bytes,
            self.max_subtrees,
            self.max_properties_bytes,
        )
