"""Event BUS (Clone pattern), sans-I/O: the seed's commands and the Binary Star state machine.

``commands`` frames and parses the seed's SYNCSTART / SYNC / SYNCEND / BROADCAST / PUB (and
taproom's HUGZ and replication commands); ``kvmsg`` is the ØMQ Guide's own Clone wire (CHP),
served beside the seed's; ``bstar`` is the failover state machine. The glue is
``taproom.servers.eventbus`` (server) and ``taproom.clients.eventbus`` (client).
"""

from __future__ import annotations

from . import kvmsg
from .bstar import BinaryStar, BStarEvent, BStarState
from .commands import (
    DEFAULT_LIMITS,
    HUGZ_TOPIC,
    SEQUENCE,
    Command,
    Event,
    EventBusError,
    Heartbeat,
    Limits,
    SyncEnd,
    SyncStart,
    broadcast_frames,
    encode_sequence,
    format_subtrees,
    hugz_frames,
    matches,
    parse_broadcast,
    parse_pub,
    parse_replicate,
    parse_replicated,
    parse_snapshot_reply,
    parse_subtrees,
    parse_syncstart,
    parse_timestamp,
    pub_frames,
    replicate_frames,
    replicated_frames,
    sync_frames,
    syncend_frames,
    syncstart_frames,
)

__all__ = [
    "DEFAULT_LIMITS",
    "HUGZ_TOPIC",
    "SEQUENCE",
    "BStarEvent",
    "BStarState",
    "BinaryStar",
    "Command",
    "Event",
    "EventBusError",
    "Heartbeat",
    "Limits",
    "SyncEnd",
    "SyncStart",
    "broadcast_frames",
    "encode_sequence",
    "format_subtrees",
    "hugz_frames",
    "kvmsg",
    "matches",
    "parse_broadcast",
    "parse_pub",
    "parse_replicate",
    "parse_replicated",
    "parse_snapshot_reply",
    "parse_subtrees",
    "parse_syncstart",
    "parse_timestamp",
    "pub_frames",
    "replicate_frames",
    "replicated_frames",
    "sync_frames",
    "syncend_frames",
    "syncstart_frames",
]
