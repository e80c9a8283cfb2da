"""Who may connect to each listener, and how many connections one address may hold.

One policy for the whole hub, read from the ``[access]`` section: an address allowlist
(CIDR, IPv4 and IPv6), ``open = true`` for a listener exposed on purpose, and CURVE keys for
the ZeroMQ listeners. Settings are given for every listener at the top of ``[access]``, for
every listener of one protocol section in ``[access.<section>]`` (``[access.logjam]``), and for
one listener in ``[access.<listener>]`` (``[access.logjam_pub]``); the most specific table that
sets a key wins (a listener's ``allow`` replaces its section's, it does not add to it).

Servers ask :func:`access_for` for a :class:`ListenerAccess` and use it where they accept:

* ``allows(host)``: the allowlist, at TCP accept (Lumberjack, LogTK, web) or in the ZAP
  handler (ZeroMQ listeners, :mod:`taproom.zmqaccess`), or in an own ZMTP transport;
* ``curve``: the server's key pair and ``curve_allows(public_key)`` for the clients' keys;
* ``refused(peer, reason)``: counted in ``taproom_access_refused_connections_total{listener,
  reason}`` and logged with the peer address, at most ``refusal_log_burst`` lines at once and
  ``refusal_log_per_s`` after that per listener (a flood costs a line a second, each line
  says how many refusals it stands for).

:class:`ConnectionGate` is the one connection limit every TCP listener uses: the allowlist,
the listener's ``max_connections``, a cap per peer address and a connection rate per peer
address (token bucket), each refusal counted by reason. So one address (a logtkjs reconnect
storm, a connect flood) cannot take the slots every other client needs.

``taproom validate`` and ``serve`` refuse a listener bound to a non-loopback address with no
access control as its protocol allows it (:func:`check_exposure`); ``open = true`` accepts
the exposure, with one warning at start (:func:`open_listeners`).

Nothing here does I/O on sockets: the glue lives in ``servers/`` and :mod:`taproom.zmqaccess`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import config_check, config_section, is_loopback, setting
from .errors import ConfigError

if TYPE_CHECKING:
    from .config import Config
    from .metrics import Metrics

__all__ = [
    "LISTENERS",
    "AccessConfig",
    "AccessRule",
    "ConnectionGate",
    "CurveKeys",
    "ListenerAccess",
    "access_for",
    "check_exposure",
    "load_curve_keys",
    "open_listeners",
    "z85_public_keys",
]

log = logging.getLogger("taproom.access")

# Every listener taproom binds, by the config section that enables it and names its host.
LISTENERS: dict[str, tuple[str, ...]] = {
    "web": ("web",),
    "lumberjack": ("lumberjack",),
    "logtk": ("logtk_ws", "logtk_tcp"),
    "logjam": ("logjam_router", "logjam_pull", "logjam_pub", "logjam_replay"),
    "eventbus": (
        "eventbus_snapshot",
        "eventbus_publisher",
        "eventbus_collector",
        "eventbus_chp_snapshot",
        "eventbus_chp_publisher",
        "eventbus_chp_collector",
    ),
    "lager": (
        "lager_registrar_snapshot",
        "lager_registrar_publisher",
        "lager_registrar_collector",
        "lager_forwarder_in",
        "lager_forwarder_out",
        "lager_forwarder_counted",
    ),
}
SECTION_OF = {listener: section for section, names in LISTENERS.items() for listener in names}
ZMQ_SECTIONS = frozenset({"logjam", "eventbus", "lager"})
_CURVE_KEY_Z85 = 40  # a 32-byte CURVE key in Z85


@dataclass(frozen=True)
class AccessRule:
    """``[access.<section>]`` or ``[access.<listener>]``: what differs there (unset inherits)."""

    allow: tuple[str, ...] | None = setting(None, "unset: the section's, else [access] allow")
    open: bool | None = setting(None, "unset: the section's, else [access] open")
    curve_secret_key_file: str | None = setting(None, "unset: the section's, else [access]'s")
    curve_allowed_clients: str | tuple[str, ...] | None = setting(
        None, "unset: the section's, else [access]'s"
    )

    def validate(self) -> None:
        _check_rule(self.allow, self.curve_secret_key_file, self.curve_allowed_clients)


@config_section("access")
@dataclass(frozen=True)
class AccessConfig:
    allow: tuple[str, ...] = setting(
        (),
        "addresses (CIDR, IPv4, IPv6) every listener accepts; empty: no allowlist, so a "
        "listener off loopback needs another access control or open = true",
    )
    open: bool = setting(
        False, "true: a listener off loopback without access control is exposed on purpose"
    )
    curve_secret_key_file: str = setting(
        "",
        "ZeroMQ listeners: the hub's CURVE key pair (zmq.auth / curve_keygen .key_secret "
        "file); empty: the NULL mechanism, as every existing logjam, Clone and Lager peer",
    )
    curve_allowed_clients: str | tuple[str, ...] = setting(
        "",
        "client public keys a CURVE listener accepts: a directory of .key files (re-read "
        "when it changes), or a list of Z85 keys or .key files; empty: any client key",
    )
    refusal_log_burst: int = setting(
        20,
        "refusal lines a listener logs at once, each with the peer address; past it a flood "
        "is summarised",
        min=1,
    )
    refusal_log_per_s: float = setting(
        1.0, "refusal lines a listener logs a second once its burst is spent", min=0.01
    )
    max_tracked_peers: int = setting(
        100_000,
        "peer addresses whose connection rate a listener remembers (~200 B each); the least "
        "recently seen is forgotten first",
        min=100,
    )
    web: AccessRule = setting(
        None, "the web listener (ops endpoints, console, journal API)", factory=AccessRule
    )
    lumberjack: AccessRule = setting(None, "the Lumberjack listener", factory=AccessRule)
    logtk: AccessRule = setting(None, "both LogTK listeners", factory=AccessRule)
    logtk_ws: AccessRule = setting(None, "LogTK over WebSocket", factory=AccessRule)
    logtk_tcp: AccessRule = setting(None, "LogTK over TCP", factory=AccessRule)
    logjam: AccessRule = setting(None, "every logjam listener", factory=AccessRule)
    logjam_router: AccessRule = setting(None, "logjam ROUTER (DEALER agents)", factory=AccessRule)
    logjam_pull: AccessRule = setting(None, "logjam PULL (PUSH agents)", factory=AccessRule)
    logjam_pub: AccessRule = setting(
        None, "logjam PUB output (consumers read every event)", factory=AccessRule
    )
    logjam_replay: AccessRule = setting(None, "logjam replay channel", factory=AccessRule)
    eventbus: AccessRule = setting(None, "every Event BUS listener", factory=AccessRule)
    eventbus_snapshot: AccessRule = setting(None, "Event BUS SNAPSHOT", factory=AccessRule)
    eventbus_publisher: AccessRule = setting(None, "Event BUS PUBLISHER", factory=AccessRule)
    eventbus_collector: AccessRule = setting(None, "Event BUS COLLECTOR", factory=AccessRule)
    eventbus_chp_snapshot: AccessRule = setting(None, "Event BUS CHP snapshot", factory=AccessRule)
    eventbus_chp_publisher: AccessRule = setting(
        None, "Event BUS CHP publisher", factory=AccessRule
    )
    eventbus_chp_collector: AccessRule = setting(
        None, "Event BUS CHP collector", factory=AccessRule
    )
    lager: AccessRule = setting(None, "every Lager listener", factory=AccessRule)
    lager_registrar_snapshot: AccessRule = setting(
        None, "Lager registrar snapshot", factory=AccessRule
    )
    lager_registrar_publisher: AccessRule = setting(
        None, "Lager registrar publisher", factory=AccessRule
    )
    lager_registrar_collector: AccessRule = setting(
        None, "Lager registrar collector", factory=AccessRule
    )
    lager_forwarder_in: AccessRule = setting(
        None, "Lager forwarder input (taps)", factory=AccessRule
    )
    lager_forwarder_out: AccessRule = setting(
        None, "Lager forwarder output (mugs)", factory=AccessRule
    )
    lager_forwarder_counted: AccessRule = setting(
        None, "Lager counted output (taproom's Mug)", factory=AccessRule
    )

    def validate(self) -> None:
        _check_rule(self.allow, self.curve_secret_key_file, self.curve_allowed_clients)
        for section, listeners in LISTENERS.items():
            if section in ZMQ_SECTIONS:
                for name in listeners:
                    if self.effective(name, "curve_allowed_clients") and not self.effective(
                        name, "curve_secret_key_file"
                    ):
                        raise ConfigError(
                            f"{name} has client keys but no key of its own: set "
                            "curve_secret_key_file too",
                            key=f"{name}.curve_allowed_clients",
                        )
                continue
            for name in (section, *listeners):
                rule: AccessRule = getattr(self, name)
                for key in ("curve_secret_key_file", "curve_allowed_clients"):
                    if getattr(rule, key):
                        raise ConfigError(
                            "CURVE is for the ZeroMQ listeners only (use TLS or the "
                            "allowlist here)",
                            key=f"{name}.{key}",
                        )

    def effective(self, listener: str, key: str) -> Any:
        """The value of ``key`` for ``listener``: its own table, its section's, then the top."""
        for name in (listener, SECTION_OF[listener]):
            value = getattr(getattr(self, name), key)
            if value is not None:
                return value
        return getattr(self, key)


def _parse_network(entry: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(entry.strip(), strict=True)
    except ValueError as exc:
        try:
            loose = ipaddress.ip_network(entry.strip(), strict=False)
        except ValueError:
            raise ConfigError(
                f"{entry!r} is not an address or CIDR network ({exc})", key="allow"
            ) from None
        raise ConfigError(
            f"{entry!r} has host bits set: did you mean {loose}?", key="allow"
        ) from None


def _check_rule(
    allow: tuple[str, ...] | None, secret: str | None, clients: str | tuple[str, ...] | None
) -> None:
    for entry in allow or ():
        _parse_network(entry)
    if secret:
        load_curve_keys(secret)
    if clients:
        z85_public_keys(clients)


# --- CURVE keys ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE key pair, raw (32 bytes each) and in Z85 (40 characters) as libzmq takes it."""

    public: bytes
    secret: bytes

    @property
    def public_z85(self) -> bytes:
        from zmq.utils import z85

        return z85.encode(self.public)

    @property
    def secret_z85(self) -> bytes:
        from zmq.utils import z85

        return z85.encode(self.secret)


def _read_key_file(path: str, key: str) -> tuple[bytes | None, bytes | None]:
    """(public, secret) in Z85 from a zmq.auth / curve_keygen certificate file."""
    public = secret = None
    try:
        with open(path, "rb") as f:
            for line in f:
                line = line.strip()
                for name in (b"public-key", b"secret-key"):
                    if line.startswith(name) and b"=" in line:
                        value = line.split(b"=", 1)[1].strip(b" \t'\"")
                        if name == b"public-key":
                            public = value
                        else:
                            secret = value
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}", key=key) from None
    return public, secret


def _z85_key(text: bytes, where: str, key: str) -> bytes:
    from zmq.utils import z85

    if len(text) != _CURVE_KEY_Z85:
        raise ConfigError(f"{where}: a CURVE key is 40 Z85 characters", key=key)
    try:
        return z85.decode(text)
    except (ValueError, KeyError, IndexError):
        raise ConfigError(f"{where}: not a Z85 key", key=key) from None


def load_curve_keys(path: str) -> CurveKeys:
    """The key pair in a ``.key_secret`` file (``taproom access keygen``, zmq.auth,
    curve_keygen); raises :class:`ConfigError` naming the file."""
    key = "curve_secret_key_file"
    public, secret = _read_key_file(path, key)
    if secret is None or public is None:
        raise ConfigError(f"{path}: no secret-key and public-key (a .key_secret file)", key=key)
    pair = CurveKeys(_z85_key(public, path, key), _z85_key(secret, path, key))
    from zmq.utils import z85

    try:
        import zmq

        derived = zmq.curve_public(pair.secret_z85)
    except (ImportError, AttributeError, zmq.ZMQError):  # libzmq without CURVE
        derived = z85.encode(pair.public)
    if derived != z85.encode(pair.public):
        raise ConfigError(f"{path}: the public key is not the secret key's", key=key)
    return pair


def z85_public_keys(spec: str | tuple[str, ...]) -> frozenset[bytes]:
    """Raw public keys from ``curve_allowed_clients``: a directory of ``.key`` files, one
    ``.key`` file, or a list of Z85 keys and ``.key`` files."""
    key = "curve_allowed_clients"
    entries = (spec,) if isinstance(spec, str) else spec
    found: set[bytes] = set()
    for entry in entries:
        if os.path.isdir(entry):
            for name in sorted(os.listdir(entry)):
                if name.endswith(".key"):
                    found.add(_public_from_file(os.path.join(entry, name), key))
        elif os.path.isfile(entry):
            found.add(_public_from_file(entry, key))
        elif len(entry) == _CURVE_KEY_Z85:
            found.add(_z85_key(entry.encode(), f"key {entry[:6]}...", key))
        else:
            raise ConfigError(
                f"{entry}: neither a directory, a .key file nor a 40-character Z85 key", key=key
            )
    return frozenset(found)


def _public_from_file(path: str, key: str) -> bytes:
    public, _ = _read_key_file(path, key)
    if public is None:
        raise ConfigError(f"{path}: no public-key line", key=key)
    return _z85_key(public, path, key)


# --- the policy of one listener --------------------------------------------------------------


class _Refusals:
    """Counts and logs refusals of one listener; the log is a token bucket of lines."""

    __slots__ = ("_burst", "_level", "_m", "_rate", "_stamp", "_unlogged", "_unlogged_peer")

    def __init__(self, metrics: Metrics | None, listener: str, burst: int, rate: float) -> None:
        self._m = (
            metrics.counter(
                "access",
                "refused",
                "connections",
                "Connections refused before any data was taken, by listener and reason",
                ("listener", "reason"),
            )
            if metrics is not None
            else None
        )
        self._burst, self._rate = float(burst), rate
        self._level, self._stamp = float(burst), time.monotonic()
        self._unlogged: Counter[str] = Counter()
        self._unlogged_peer = ""

    def refused(self, listener: str, peer: str, reason: str, detail: str) -> None:
        if self._m is not None:
            self._m.labels(listener=listener, reason=reason).inc()
        now = time.monotonic()
        self._level = min(self._burst, self._level + (now - self._stamp) * self._rate)
        self._stamp = now
        if self._level < 1.0:
            self._unlogged[reason] += 1
            self._unlogged_peer = peer
            return
        self._level -= 1.0
        more = ""
        if self._unlogged:
            counts = ", ".join(f"{r} {n}" for r, n in self._unlogged.most_common())
            more = f" [and {self._unlogged.total()} not logged before it: {counts}; the last "
            more += f"from {self._unlogged_peer}]"
            self._unlogged.clear()
        log.warning(
            "%s: refused %s: %s%s%s", listener, peer, reason, f" ({detail})" if detail else "", more
        )


class ListenerAccess:
    """The access policy of one listener (:func:`access_for`)."""

    __slots__ = ("_clients", "_clients_spec", "_clients_stamp", "_refusals", "curve", "listener",
                 "networks", "open")  # fmt: skip

    def __init__(
        self,
        listener: str,
        networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...],
        open_: bool,
        curve: CurveKeys | None,
        clients: str | tuple[str, ...],
        refusals: _Refusals,
    ) -> None:
        self.listener = listener
        self.networks = networks
        self.open = open_
        self.curve = curve
        self._clients_spec = clients
        self._clients: frozenset[bytes] | None = z85_public_keys(clients) if clients else None
        self._clients_stamp = _dir_stamp(clients)
        self._refusals = refusals

    @property
    def restricted(self) -> bool:
        """True when some peer can be refused: an allowlist or a list of CURVE client keys."""
        return bool(self.networks) or self._clients is not None

    def allows(self, host: str | None) -> bool:
        """Whether a peer at ``host`` (an address, as getpeername or ZAP gives it) may connect;
        always True without an allowlist. An unparsable address is refused."""
        if not self.networks:
            return True
        if not host:
            return False
        try:
            address = ipaddress.ip_address(host.split("%", 1)[0].strip("[]"))
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # a dual-stack socket's view of an IPv4 peer
        return any(address in network for network in self.networks)

    def curve_allows(self, public_key: bytes) -> bool:
        """Whether a CURVE client with this raw public key may connect (any key when no
        ``curve_allowed_clients`` is set). A directory of keys is re-read when it changes, so
        adding or deleting a client's ``.key`` file takes effect without a restart."""
        if self._clients is None:
            return True
        stamp = _dir_stamp(self._clients_spec)
        if stamp != self._clients_stamp:
            try:
                self._clients = z85_public_keys(self._clients_spec)
                self._clients_stamp = stamp
            except ConfigError as exc:
                log.error("%s: keeping the previous client keys: %s", self.listener, exc)
        return public_key in self._clients

    def refused(self, peer: str, reason: str, detail: str = "") -> None:
        """Count a refused connection and log it with the peer (rate-limited)."""
        self._refusals.refused(self.listener, peer or "?", reason, detail)


def _dir_stamp(spec: str | tuple[str, ...]) -> int:
    if isinstance(spec, str) and spec and os.path.isdir(spec):
        try:
            return os.stat(spec).st_mtime_ns
        except OSError:
            return -1
    return 0


def access_for(config: Config, listener: str, metrics: Metrics | None = None) -> ListenerAccess:
    """The policy of ``listener`` (one of :data:`LISTENERS`); refusals are counted in
    ``metrics`` when given."""
    if listener not in SECTION_OF:
        raise KeyError(f"unknown listener {listener!r}")
    cfg: AccessConfig = config.access
    secret = cfg.effective(listener, "curve_secret_key_file")
    return ListenerAccess(
        listener,
        tuple(_parse_network(entry) for entry in cfg.effective(listener, "allow")),
        bool(cfg.effective(listener, "open")),
        load_curve_keys(secret) if secret else None,
        cfg.effective(listener, "curve_allowed_clients") if secret else "",
        _Refusals(metrics, listener, cfg.refusal_log_burst, cfg.refusal_log_per_s),
    )


# --- the connection gate ---------------------------------------------------------------------


class ConnectionGate:
    """Admission of a TCP listener's connections: allowlist, ``max_connections``, a cap per
    peer address and a token bucket of new connections per peer address.

    ``admit(host)`` returns ``""`` and counts the connection in, or the reason it was refused
    (already counted and logged); ``leave(host)`` once an admitted connection is gone.
    ``max_connections`` 0 leaves the total to the server (the web listener evicts instead).
    """

    __slots__ = ("_buckets", "_burst", "_max_peers", "_rate", "access", "max_connections",
                 "max_per_peer", "open_connections", "per_peer")  # fmt: skip

    def __init__(
        self,
        access: ListenerAccess,
        *,
        max_connections: int,
        max_per_peer: int,
        per_peer_per_s: float,
        per_peer_burst: int,
        max_tracked_peers: int = 100_000,
    ) -> None:
        self.access = access
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self._rate = per_peer_per_s
        self._burst = float(per_peer_burst)
        self._max_peers = max_tracked_peers
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self.open_connections = 0
        self.per_peer: dict[str, int] = {}

    def admit(self, host: str | None, port: int | None = None, now: float | None = None) -> str:
        peer = f"{host}:{port}" if port is not None else (host or "?")
        reason = self._decide(host or "", time.monotonic() if now is None else now)
        if reason:
            detail = {
                "address_not_allowed": "not in allow",
                "max_connections": f"{self.open_connections} open",
                "max_connections_per_peer": f"{self.per_peer.get(host or '', 0)} open from it",
                "peer_connection_rate": f"over {self._rate:g}/s",
            }[reason]
            self.access.refused(peer, reason, detail)
            return reason
        self.open_connections += 1
        self.per_peer[host or ""] = self.per_peer.get(host or "", 0) + 1
        return ""

    def _decide(self, host: str, now: float) -> str:
        if not self.access.allows(host):
            return "address_not_allowed"
        if self.max_connections and self.open_connections >= self.max_connections:
            return "max_connections"
        if self.per_peer.get(host, 0) >= self.max_per_peer:
            return "max_connections_per_peer"
        tokens, last = self._buckets.pop(host, (self._burst, now))
        tokens = min(self._burst, tokens + (now - last) * self._rate)
        refused = tokens < 1.0
        self._buckets[host] = (tokens if refused else tokens - 1.0, now)
        if len(self._buckets) > self._max_peers:
            self._buckets.popitem(last=False)
        return "peer_connection_rate" if refused else ""

    def leave(self, host: str | None) -> None:
        self.open_connections -= 1
        key = host or ""
        left = self.per_peer.get(key, 0) - 1
        if left > 0:
            self.per_peer[key] = left
        else:
            self.per_peer.pop(key, None)


# --- exposure: validate and serve ------------------------------------------------------------


def _listeners(config: Config) -> list[tuple[str, str, str]]:
    """(section, listener, host) of every listener the configuration enables."""
    found = []
    for section, listeners in LISTENERS.items():
        if section not in config.names:
            continue
        cfg = config.section(section)
        if not getattr(cfg, "enabled", False):
            continue
        for listener in listeners:
            if listener.startswith("eventbus_chp_") and not getattr(cfg, "chp", False):
                continue
            found.append((section, listener, cfg.host))
    return found


def _own_control(config: Config, section: str, listener: str) -> bool:
    """Access control the protocol itself has: the web token, TLS client certificates that
    must verify, LogTK's per-app tokens (every LogTK connection must present one), CURVE with
    a list of client keys."""
    cfg = config.section(section)
    if section == "web":
        return bool(cfg.token)
    if section == "lumberjack":
        return bool(cfg.tls_cert) and cfg.tls_client_auth == "required"
    if section == "logtk":
        return True
    access: AccessConfig = config.access
    return bool(access.effective(listener, "curve_secret_key_file")) and bool(
        access.effective(listener, "curve_allowed_clients")
    )


_FIXES = {
    "web": "[web] token",
    "lumberjack": '[lumberjack] tls_client_auth = "required" (with tls_ca)',
    "logjam": "curve_secret_key_file and curve_allowed_clients in [access.<listener>]",
    "eventbus": "curve_secret_key_file and curve_allowed_clients in [access.<listener>]",
    "lager": "curve_secret_key_file and curve_allowed_clients in [access.<listener>]",
}


@config_check
def check_exposure(config: Config) -> None:
    """A listener off loopback with no access control is a configuration error that names it
    and the settings that fix it, unless ``open = true`` says it is exposed on purpose."""
    if "access" not in config.names:
        return
    access: AccessConfig = config.access
    bad: dict[str, list[str]] = {}
    hosts: dict[str, str] = {}
    for section, listener, host in _listeners(config):
        if is_loopback(host) or _own_control(config, section, listener):
            continue
        if access.effective(listener, "allow") or access.effective(listener, "open"):
            continue
        bad.setdefault(section, []).append(listener)
        hosts[section] = host
    for section, listeners in bad.items():
        names = ", ".join(listeners)
        raise ConfigError(
            f"{hosts[section]!r} is not loopback and listener{'s' if len(listeners) > 1 else ''} "
            f"{names} {'have' if len(listeners) > 1 else 'has'} no access control: set "
            f"allow = [...] in [access.{listeners[0] if len(listeners) == 1 else section}] "
            f"(or [access]), or {_FIXES[section]}, or open = true to expose it on purpose",
            key=f"{section}.host",
        )


def open_listeners(config: Config) -> list[str]:
    """``listener (host)`` of every listener off loopback that only ``open = true`` lets
    through: ``serve`` and ``validate`` warn about them once."""
    access: AccessConfig = config.access
    found = []
    for section, listener, host in _listeners(config):
        if is_loopback(host) or _own_control(config, section, listener):
            continue
        if not access.effective(listener, "allow") and access.effective(listener, "open"):
            found.append(f"{listener} ({host})")
    return found
