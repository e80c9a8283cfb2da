"""The Binary Star failover state machine (zguide chapter 4), sans-I/O: time is passed in."""

from __future__ import annotations

from enum import IntEnum

__all__ = ["BStarEvent", "BStarState", "BinaryStar"]


class BStarState(IntEnum):
    """Server states of the zguide's Binary Star pattern (bstar.c ``state_t``)."""

    PRIMARY = 1  # "Primary, waiting for peer to connect"
    BACKUP = 2  # "Backup, waiting for peer to connect"
    ACTIVE = 3  # "Active - accepting connections"
    PASSIVE = 4  # "Passive - not accepting connections"


class BStarEvent(IntEnum):
    """Binary Star events (bstar.c ``event_t``): the peer's state, or a client request."""

    PEER_PRIMARY = 1  # "HA peer is pending primary"
    PEER_BACKUP = 2  # "HA peer is pending backup"
    PEER_ACTIVE = 3  # "HA peer is active"
    PEER_PASSIVE = 4  # "HA peer is passive"
    CLIENT_REQUEST = 5  # "Client makes request"


class BinaryStar:
    """The Binary Star finite state machine; time (seconds, any monotonic origin) is passed in.

    Differences from bstar.c, all towards "never two actives": a primary that has not heard its
    peer accepts clients only once ``peer_timeout`` has passed since it started; dual actives
    make the backup step down instead of aborting the process; dual passives make the primary
    active. ``role`` "standalone" is always active.
    """

    def __init__(self, role: str, peer_timeout: float, now: float) -> None:
        if role not in ("primary", "backup", "standalone"):
            raise ValueError(f"unknown role {role!r}")
        self.role = role
        self.peer_timeout = peer_timeout
        self.state = {
            "primary": BStarState.PRIMARY,
            "backup": BStarState.BACKUP,
            "standalone": BStarState.ACTIVE,
        }[role]
        self.peer_expiry = now + peer_timeout
        self.problem = ""  # the last dual-active / dual-passive conflict, for logs

    @property
    def active(self) -> bool:
        return self.state is BStarState.ACTIVE

    def peer_alive(self, now: float) -> bool:
        return self.role != "standalone" and now < self.peer_expiry

    def on_peer(self, peer_state: int, now: float) -> BStarState:
        """The peer's heartbeat said ``peer_state``. Returns the (possibly new) state."""
        if self.role == "standalone":
            return self.state
        self.peer_expiry = now + self.peer_timeout
        try:
            event = BStarEvent(peer_state)
        except ValueError:
            return self.state
        s = self.state
        if s is BStarState.PRIMARY:
            if event is BStarEvent.PEER_BACKUP:
                self.state = BStarState.ACTIVE  # "connected to backup (passive), ready active"
            elif event is BStarEvent.PEER_ACTIVE:
                self.state = BStarState.PASSIVE  # "connected to backup (active), ready passive"
        elif s is BStarState.BACKUP:
            if event is BStarEvent.PEER_ACTIVE:
                self.state = BStarState.PASSIVE  # "connected to primary (active), ready passive"
        elif s is BStarState.ACTIVE:
            if event is BStarEvent.PEER_ACTIVE:
                self.problem = "dual actives"
                if self.role == "backup":
                    self.state = BStarState.PASSIVE
        elif s is BStarState.PASSIVE:
            if event in (BStarEvent.PEER_PRIMARY, BStarEvent.PEER_BACKUP):
                self.state = BStarState.ACTIVE  # "peer (passive) is restarting, ready active"
            elif event is BStarEvent.PEER_PASSIVE:
                self.problem = "dual passives"
                if self.role == "primary":
                    self.state = BStarState.ACTIVE
        return self.state

    def on_client_request(self, now: float) -> bool:
        """A client asked for a snapshot: may this server serve it?"""
        s = self.state
        if s is BStarState.ACTIVE:
            return True
        if s in (BStarState.PASSIVE, BStarState.PRIMARY) and now >= self.peer_expiry:
            self.state = BStarState.ACTIVE  # "failover successful, ready active"
            return True
        return False
