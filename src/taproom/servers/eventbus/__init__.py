"""Event BUS server: the durable Clone-pattern bus (SNAPSHOT, PUBLISHER, COLLECTOR) with failover.

Glue between :mod:`taproom.protocols.eventbus` and pyzmq on the hub's event loop:

* COLLECTOR (ROUTER, P+2): PUB commands are drained in bursts, validated, deduplicated by
  event UUID, given the next bus sequence and submitted to the journal as one batch. Bursts are
  committed in submit order; the broadcaster awaits each commit (and, with a synced Binary Star
  peer, the peer's REPLICATED) before it publishes the burst, so a BROADCAST is never taken
  back and sequences go out strictly increasing.
* PUBLISHER (PUB, P+1): BROADCAST commands, and a HUGZ heartbeat every ``heartbeat_ms``
  carrying the current sequence and the Binary Star state.
* SNAPSHOT (ROUTER, P): SYNCSTART gets the latest event per topic (the Clone hashmap) in the
  requested subtrees above the sequence filter, then SYNCEND with the snapshot's cut.
* With ``chp = true``, the ØMQ Guide's own Clone wire on a second group of ports (ROUTER for
  ``ICANHAZ?``, PUB of kvmsg updates and HUGZ, a SUB or PULL collector of kvmsg updates),
  feeding the same hashmap, sequence and journal. Keys with a ``ttl`` expire.

The hashmap is bounded (``max_keys``, ``max_hashmap_bytes``); what does not fit is refused
when it arrives and counted.

State after a restart is rebuilt from the journal: every ``protocol = "eventbus"`` record is
one bus event (``seq`` is the bus sequence, the producer's ISO timestamp is in ``attrs``), and
a record with ``attrs = {"eventbus": "reset"}`` starts a full state copied from the peer.

Roles (``[eventbus] role``): ``standalone`` is always active. ``primary`` / ``backup`` form a
Binary Star pair (zguide chapter 4): each subscribes to the other's HUGZ, the active one sends
every committed burst to the passive one's COLLECTOR as REPLICATE, and the passive one copies
the whole state from the active one whenever it is not in step. A passive server becomes
active only when its peer has been silent for ``peer_timeout_ms`` and a client asks it for a
snapshot; it holds the client updates it receives meanwhile and applies, at takeover, those
the old active server never replicated.
"""

from __future__ import annotations

from .checkpoint import BusState, checkpoint_path, read_checkpoint, rebuild_state, write_checkpoint
from .config import EventBusConfig
from .service import EventBusService, create_service

__all__ = [
    "BusState",
    "EventBusConfig",
    "EventBusService",
    "checkpoint_path",
    "create_service",
    "read_checkpoint",
    "rebuild_state",
    "write_checkpoint",
]
