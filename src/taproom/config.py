"""Configuration: one TOML file, typed sections, errors that name file, line and key.

Each subsystem declares its section as a frozen dataclass decorated with
:func:`config_section`; every field is a :func:`setting` whose default carries a one-line reason
(STYLE.md rule 4). Sections live beside the code they configure (``journal`` and ``hub`` here,
``lumberjack`` in ``servers/lumberjack/config.py``, ...); :data:`SECTION_MODULES` lists the modules
that declare sections so ``taproom validate`` knows all of them.

Resolution order for a value: the dataclass default, then the TOML file (with ``${VAR}``,
``${VAR:-default}`` and ``${VAR:?message}`` interpolated in strings), then
``TAPROOM_SECTION__KEY`` environment variables (``__`` separates nested keys).

Types are strict for what the file says: ``enabled = "false"`` is an error, not a boolean.
Text that comes from the environment (an interpolated string, an override) is read as the
setting's type: ``"8080"`` for an integer, ``"false"`` for a boolean, the text itself for a
string, a TOML literal for a list. An error in an override names the variable, not a file line.
"""

from __future__ import annotations

import dataclasses
import importlib
import ipaddress
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .errors import ConfigError

__all__ = [
    "SECTION_MODULES",
    "Config",
    "ConsoleConfig",
    "HubConfig",
    "JournalConfig",
    "WebConfig",
    "config_check",
    "config_section",
    "is_loopback",
    "load_config",
    "setting",
]

T = TypeVar("T")

# Modules that declare config sections. A module missing from the installed tree is skipped,
# so the list can name every subsystem the hub knows.
SECTION_MODULES = (
    "taproom.config",
    "taproom.access",
    "taproom.servers.lumberjack",
    "taproom.servers.logtk",
    "taproom.servers.logjam",
    "taproom.servers.eventbus",
    "taproom.servers.lager",
    "taproom.budget",  # no section: its check that the holders fit in memory_budget_bytes
    "taproom.servers.zmtp",
    "taproom.spark.settings",
)

_SECTIONS: dict[str, type] = {}
_RETIRED: dict[str, dict[str, str]] = {}  # section -> retired key -> why
# Checks that need several sections (a listener's host and the access rules that cover it).
_CHECKS: list[Callable[[Config], None]] = []


class _Text(str):
    """A string from the environment (interpolated or an override): it may stand for a number,
    a boolean or a TOML literal, where a string written in the file may not."""

    __slots__ = ()


def config_section(
    name: str, *, retired: Mapping[str, str] | None = None
) -> Callable[[type[T]], type[T]]:
    """Register a frozen dataclass as the ``[name]`` section of the configuration.

    ``retired`` names settings a release removed, each with why: a file that still sets one
    loads (an upgrade must not stop a hub for a key that no longer means anything), and the
    key is named in :attr:`Config.warnings` (``validate`` prints them, ``serve`` logs them).
    """

    def register(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls!r} must be a dataclass")
        _SECTIONS[name] = cls
        _RETIRED[name] = dict(retired or {})
        return cls

    return register


def config_check(check: Callable[[Config], None]) -> Callable[[Config], None]:
    """Register a check of the whole configuration, run once every section is valid; it
    raises :class:`ConfigError` with a dotted key (``section.key``) to be located."""
    _CHECKS.append(check)
    return check


def setting(
    default: Any = dataclasses.MISSING,
    why: str = "",
    *,
    min: float | None = None,
    max: float | None = None,
    choices: tuple[Any, ...] | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A configuration field: its default, the reason for that default, and its bounds."""
    metadata = {"why": why, "min": min, "max": max, "choices": choices}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@config_section("journal")
@dataclass(frozen=True)
class JournalConfig:
    dir: str = setting("./var/journal", "next to the working directory, as `make run` expects")
    fsync: str = setting(
        "always",
        "ack only what is on disk: a power loss cannot take back an acknowledged event",
        choices=("always", "interval", "off"),
    )
    fsync_interval_ms: int = setting(
        200, "with fsync=interval: the window of acked-but-unsynced data", min=1, max=60_000
    )
    segment_bytes: int = setting(
        128 * 1024 * 1024,
        "large enough to keep file counts low, small enough that retention frees space often",
        min=1024 * 1024,
        max=1 << 40,
    )
    cache_keep_bytes: int = setting(
        32 * 1024 * 1024,
        "the last seconds of writes stay in the page cache for readers near the end; older "
        "durable bytes are dropped, else every write takes fresh pages (3x the kernel's copy "
        "cost measured: a third of the hub's CPU at Lumberjack's ingest rate); 0 never drops",
        min=0,
    )
    retention_bytes: int = setting(
        0, "0 keeps everything; set it to bound disk use (whole sealed segments are deleted)", min=0
    )
    retention_age_s: int = setting(0, "0 keeps everything; else delete segments older", min=0)
    max_commit_bytes: int = setting(
        8 * 1024 * 1024,
        "one group commit writes at most this much so one fsync never waits on a huge write",
        min=64 * 1024,
    )
    retain_unread: bool = setting(
        False,
        "off: retention alone decides; on: keep segments a registered reader's cursor has not "
        "passed (up to retain_unread_max_bytes)",
    )
    retain_unread_max_bytes: int = setting(
        16 * 1024**3,
        "hard cap with retain_unread: a reader gone for good cannot fill the disk; past it the "
        "oldest segments go anyway and the loss is counted and reported to the reader",
        min=1024 * 1024,
    )
    max_remote_readers: int = setting(
        8, "concurrent network reads of the journal (Spark tasks): each holds a thread", min=1,
        max=256,
    )  # fmt: skip
    max_read_bytes: int = setting(
        64 * 1024 * 1024,
        "most frame bytes one network read answers with (larger budgets get this much)",
        min=1024 * 1024,
        max=1 << 30,
    )
    remote_write_timeout_s: float = setting(
        60.0,
        "a network reader that takes no bytes for this long is cut off and frees its slot",
        min=1,
        max=3600,
    )

    def validate(self) -> None:
        """A journal directory that is a file, or lies below one, can never be opened.

        Permissions are left to ``taproom serve`` (a runtime error there): ``taproom tail``
        and ``validate`` may run as a user who cannot write the journal.
        """
        path = Path(self.dir)
        for candidate in (path, *path.parents):
            if os.path.exists(candidate):
                if not os.path.isdir(candidate):
                    raise ConfigError(f"{candidate} is not a directory", key="dir")
                return


@config_section("hub")
@dataclass(frozen=True)
class HubConfig:
    name: str = setting("taproom", "shows in logs, metrics and the logjam/Event BUS producer id")
    memory_budget_bytes: int = setting(
        128 * 1024 * 1024,
        "what the hub may hold in memory, split between the holders below (taproom.budget); "
        "the promise is a peak RSS within this + ~100 MB for the interpreter and libraries, "
        "2 x max_pending_bytes + 100 MB with the defaults (issue 26)",
        min=1024 * 1024,
    )
    max_pending_bytes: int = setting(
        64 * 1024 * 1024,
        "bytes accepted but not yet committed; above this servers stop reading their sockets "
        "(half the budget: the journal's group commit is what keeps throughput up)",
        min=64 * 1024,
    )
    max_inflate_bytes: int = setting(
        16 * 1024 * 1024,
        "inflated bytes in flight over all connections (Lumberjack C frames, logjam bodies): "
        "one largest event (lumberjack.max_event_bytes, 12 MiB) plus pieces of others; a "
        "connection that finds no room waits its turn",
        min=1024 * 1024,
    )
    connection_buffer_bytes: int = setting(
        16 * 1024 * 1024,
        "received, unparsed bytes of all connections of every listener together (incomplete "
        "frames, unfinished ZeroMQ messages): one largest uncompressed event plus room for "
        "others; a connection that finds no room stops reading",
        min=1024 * 1024,
    )
    output_queue_bytes: int = setting(
        16 * 1024 * 1024,
        "committed batches queued in memory for outputs (two of Lumberjack's 8 MiB batches); "
        "beyond it a lossless output reads back from the journal, a lossy one drops and counts",
        min=64 * 1024,
    )
    inline_commit_max_bytes: int = setting(
        16 * 1024,
        "a group this small, admitted while the commit thread is idle, is written and fsynced "
        "by the event loop itself: for a few requests in flight the thread's two hand-offs and "
        "wakeups cost more CPU than the commit (issue 32); busier loops make larger groups, "
        "which go to the commit thread so reading overlaps their fsync; 0 turns it off",
        min=0,
        max=8 * 1024 * 1024,
    )
    inline_commit_max_ms: float = setting(
        2.0,
        "inline commits stop while small commits take longer than this on average, so the "
        "loop never waits long on a slow or busy disk (SSDs fsync in 0.1-1 ms)",
        min=0,
        max=1000,
    )
    output_queue_batches: int = setting(
        1024, "committed batches buffered per output before it reads back from the journal", min=1
    )
    grace_period_s: float = setting(
        10.0, "SIGTERM: time to finish in-flight commits and acks before exiting", min=0, max=3600
    )
    stall_after_s: float = setting(
        10.0, "/ready turns 503 when a commit has been pending this long", min=0.1
    )
    log_level: str = setting(
        "INFO",
        "operators want connections and rejects, not per-event lines",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
    )
    error_log_interval_s: float = setting(
        1.0,
        "an internal error refusing one message is logged with its traceback at most this "
        "often per loop (the rest are counted): a poison stream must not flood the log",
        min=0,
        max=3600,
    )
    loop_restart_max_s: float = setting(
        5.0,
        "a supervised loop that died starts again after 0.1 s, doubling per death in a row up "
        "to this: quick back after one bug, no busy crash loop",
        min=0.1,
        max=600,
    )
    loop_settle_s: float = setting(
        10.0,
        "a restarted loop is back (off /ready's degraded list) once it has run this long; "
        "one that dies on its next message must not look healthy between deaths",
        min=0,
        max=3600,
    )
    loop_death_limit: int = setting(
        5,
        "deaths of one loop within loop_death_window_s that make /ready 503: it keeps dying "
        "(five restarts with backoff take about 1.5 s)",
        min=1,
    )
    loop_death_window_s: float = setting(
        60.0, "the window loop_death_limit counts deaths in", min=1, max=86400
    )


@config_section("web")
@dataclass(frozen=True)
class WebConfig:
    enabled: bool = setting(True, "/metrics, /health, /ready and the console")
    host: str = setting("127.0.0.1", "loopback until an operator opts in to exposure")
    port: int = setting(8686, "the port Vector's API uses by convention", min=0, max=65535)
    max_connections: int = setting(
        256,
        "scrapers and console tabs, not crowds; above asyncio's accept batch (100) so one "
        "burst of reset connections cannot fill it; ~20 KB each",
        min=1,
        max=65536,
    )
    listen_backlog: int = setting(
        4096,
        "the kernel's accept queue (capped by net.core.somaxconn): a full queue drops SYNs, "
        "retried after 1 s, so /health was late during a flood of this port with 100",
        min=1,
        max=65535,
    )
    max_connections_per_peer: int = setting(
        64,
        "connections one address may hold: a browser opens ~6, a scraper or a Spark "
        "executor host a few; a quarter of max_connections stays one address's most",
        min=1,
        max=65536,
    )
    peer_connections_per_s: float = setting(
        256.0,
        "new connections one address may open a second once its burst is spent: Spark "
        "executors open one per partition read (HubJournal), hundreds a second on small "
        "segments; pages poll every second over keep-alive connections",
        min=0.01,
    )
    peer_connection_burst: int = setting(
        512, "new connections one address may open at once: a Spark job's first reads", min=1
    )
    accept_batch: int = setting(
        100,
        "connections accepted per loop wakeup, and how far a burst may pass max_connections "
        "for a moment; larger batches let reset connections pile up unread under a connect "
        "flood (1024: refusals and late /health over 10,000 connect/RST cycles)",
        min=1,
        max=65535,
    )
    token: str = setting(
        "",
        "required (bearer header or login session) for all but /health; off loopback it, or "
        "an [access] allowlist, is needed",
    )
    session_ttl_s: float = setting(
        12 * 3600.0,
        "a console sign-in lasts a working day, then the token is asked again",
        min=1,
        max=30 * 86400,
    )
    max_sessions: int = setting(
        10_000, "signed-in browsers remembered (~100 B each); the oldest is signed out", min=1
    )
    secure_cookies: bool = setting(
        False,
        "true behind a TLS proxy: the session cookie gets Secure (it does anyway when the "
        "request itself came over TLS)",
    )
    login_free_failures: int = setting(
        5, "wrong tokens one address may try before it has to wait (typos)", min=1
    )
    login_backoff_s: float = setting(
        1.0,
        "the first wait after the free failures, doubled after each further failure: 50 "
        "wrong tries cost a guesser days, a person a few seconds",
        min=0.01,
    )
    login_backoff_max_s: float = setting(
        900.0, "the longest wait: an operator who mistyped is never locked out for long", min=1
    )
    max_header_bytes: int = setting(
        8192, "longest request line or header field; browsers send well under 8 KiB", min=1024
    )
    max_headers: int = setting(64, "header fields per request; browsers send about 20", min=8)
    head_timeout_s: float = setting(
        5.0, "a connection must finish its first request head this fast (slow-loris)", min=0.1
    )
    keepalive_timeout_s: float = setting(
        15.0, "an idle keep-alive connection is closed after this; pages poll every 1 s", min=0.1
    )


def is_loopback(host: str) -> bool:
    """True for names and addresses that only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@config_section("console")
@dataclass(frozen=True)
class ConsoleConfig:
    rollups: str = setting(
        "./var/rollups", "where `taproom spark rollup|stream --out` writes: the Requests page"
    )
    kegs: str = setting("./var/kegs", "Lager kegs (*.lgr) listed on the Telemetry page")
    stats_seconds: int = setting(
        900, "per-second samples kept in memory for the Overview: 15 minutes", min=60, max=86400
    )
    tail_queue_events: int = setting(
        2000, "events queued per live-tail page before the rest are skipped (and counted)", min=10
    )
    tail_events_per_s: int = setting(
        500,
        "committed events the live tail decodes per second, all pages together (more than a "
        "person reads); the rest are skipped and counted so the tail never takes ingest's CPU",
        min=10,
    )
    max_tail_clients: int = setting(16, "live-tail pages open at once", min=1, max=1024)
    tail_bytes: int = setting(
        4 * 1024 * 1024,
        "live-tail rows queued for all pages together (its share of hub.memory_budget_bytes; "
        "a row is under 2 KiB, so 16 full pages of 2000 rows fit in about 4 MiB)",
        min=64 * 1024,
    )
    max_rows: int = setting(10_000, "rows one /api/ answer may hold", min=100)
    hubs: Mapping[str, str] = setting(
        None,
        "journal id -> web address (host:port) of the fleet's other hubs: the Request page reads "
        "a request stored on another hub from that hub (none: this hub's journal only)",
        factory=dict,
    )
    hubs_token: str = setting(
        "", "[web] token of the hubs in `hubs` (empty: this hub's own token; a fleet shares one)"
    )
    hub_timeout_s: float = setting(
        10.0, "a fleet hub that has not answered a request lookup within this is unavailable",
        min=0.1, max=300,
    )  # fmt: skip
    find_dates: int = setting(
        31,
        "dates a request-id search reads (newest first) when the id carries no time (not a "
        "version 1 UUID) and no date is given; each costs one row group per index file",
        min=1,
        max=3660,
    )


class Config:
    """All sections, validated. ``config.journal`` or ``config.section("journal")``."""

    def __init__(
        self,
        sections: Mapping[str, Any],
        source: str | None = None,
        warnings: tuple[str, ...] = (),
    ) -> None:
        self._sections = dict(sections)
        self.source = source
        # What loaded but an operator should change (retired settings), one line each.
        self.warnings = warnings

    def section(self, name: str) -> Any:
        return self._sections[name]

    def __getattr__(self, name: str) -> Any:
        try:
            return self._sections[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def names(self) -> list[str]:
        return list(self._sections)

    def replace(self, name: str, **changes: Any) -> Config:
        """A copy with some fields of one section changed (tests and CLI flags)."""
        sections = dict(self._sections)
        sections[name] = dataclasses.replace(sections[name], **changes)
        return Config(sections, self.source, self.warnings)


def known_sections() -> dict[str, type]:
    for module in SECTION_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    return dict(_SECTIONS)


# --- interpolation and overrides -------------------------------------------------------------

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\?)([^}]*))?\}")


def _interpolate(value: str, env: Mapping[str, str], where: Callable[[str], ConfigError]) -> str:
    def replace(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        current = env.get(name)
        if current is not None and current != "":
            return current
        if op == ":-":
            return arg or ""
        if op == ":?":
            raise where(f"${{{name}}} is not set: {arg or 'required'}")
        if current is None:
            raise where(f"${{{name}}} is not set (use ${{{name}:-default}} for a default)")
        return current

    return _VAR.sub(replace, value)


def _literal(text: _Text) -> Any:
    """Environment text where the setting wants a list or table: a TOML literal, if it is one."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _line_index(text: str) -> dict[tuple[str, ...], int]:
    """Map dotted key paths to the line they are defined on (tomllib gives no positions)."""
    index: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    header = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
    keyline = re.compile(r"^\s*([A-Za-z0-9_\-\".]+)\s*=")
    for number, line in enumerate(text.splitlines(), start=1):
        if m := header.match(line):
            table = tuple(part.strip().strip('"') for part in m.group(1).split("."))
            index.setdefault(table, number)
        elif m := keyline.match(line):
            path = table + tuple(part.strip().strip('"') for part in m.group(1).split("."))
            index.setdefault(path, number)
    return index


# --- typed conversion ------------------------------------------------------------------------


def _convert(value: Any, hint: Any, path: str) -> Any:
    """Check ``value`` against ``hint``; only environment text is read as another type."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as exc:
                errors.append(exc.message)
        raise ConfigError("; ".join(errors), key=path)
    from_env = isinstance(value, _Text)
    if hint is bool:
        if from_env and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise ConfigError(f"expected true or false, got {value!r}", key=path)
        return value
    if hint is int:
        if from_env:
            try:
                value = int(value.replace("_", ""), 0)
            except ValueError:
                raise ConfigError(f"expected an integer, got {value!r}", key=path) from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"expected an integer, got {value!r}", key=path)
        return value
    if hint is float:
        if from_env:
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"expected a number, got {value!r}", key=path) from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"expected a number, got {value!r}", key=path)
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"expected a string, got {value!r}", key=path)
        return str(value)
    if from_env:
        value = _literal(value)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"expected a list, got {value!r}", key=path)
        item = args[0] if args else Any
        return tuple(_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping) or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"expected a table, got {value!r}", key=path)
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _convert(v, vt, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if not isinstance(value, dict):
            raise ConfigError(f"expected a table, got {value!r}", key=path)
        return _build(hint, value, path)
    if hint is Any:
        return value
    raise ConfigError(f"unsupported setting type {hint!r}", key=path)


def _build(cls: type, table: Mapping[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in table:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"unknown key (known: {known})", key=f"{path}.{key}")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in table:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError("required", key=f"{path}.{name}")
            continue
        key = f"{path}.{name}"
        value = _convert(table[name], hints[name], key)
        meta = f.metadata
        if meta.get("choices") is not None and value not in meta["choices"]:
            allowed = ", ".join(repr(c) for c in meta["choices"])
            raise ConfigError(f"{value!r} is not one of {allowed}", key=key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            if meta.get("min") is not None and value < meta["min"]:
                raise ConfigError(f"{value} is below the minimum {meta['min']}", key=key)
            if meta.get("max") is not None and value > meta["max"]:
                raise ConfigError(f"{value} is above the maximum {meta['max']}", key=key)
        kwargs[name] = value
    instance = cls(**kwargs)
    validate = getattr(instance, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError as exc:
            # Section validators name keys relative to the section; make them absolute.
            exc.key = f"{path}.{exc.key}" if exc.key else path
            raise ConfigError(exc.message, key=exc.key) from None
    return instance


def _walk_strings(value: Any, fn: Callable[[str, str], str], path: str) -> Any:
    if isinstance(value, str):
        return fn(value, path)
    if isinstance(value, dict):
        return {k: _walk_strings(v, fn, f"{path}.{k}" if path else k) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk_strings(v, fn, path) for v in value]
    return value


def _read_utf8(path: Path, source: str | None) -> str:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", file=source) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"not UTF-8 (byte {raw[exc.start]:#04x}): TOML files are UTF-8",
            file=source,
            line=line,
        ) from None


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    text: str | None = None,
) -> Config:
    """Load and validate a configuration. ``path=None`` and ``text=None`` gives the defaults."""
    env = os.environ if env is None else env
    source = str(path) if path is not None else None
    if text is None and path is not None:
        text = _read_utf8(Path(path), source)
    text = text or ""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"at line (\d+)", str(exc))
        raise ConfigError(
            f"not valid TOML: {exc}", file=source, line=int(m.group(1)) if m else None
        ) from None
    lines = _line_index(text)
    overrides: dict[tuple[str, ...], str] = {}  # key path -> the variable that set it

    def located(exc: ConfigError) -> ConfigError:
        """``exc`` at the variable that set its key, else at the key's line in the file."""
        parts = tuple(p for p in re.split(r"\.|\[\d+\]", exc.key) if p)
        for end in range(len(parts), 0, -1):
            if parts[:end] in overrides:
                variable = f"environment variable {overrides[parts[:end]]}"
                return ConfigError(exc.message, file=variable, key=exc.key)
        for end in range(len(parts), 0, -1):
            if parts[:end] in lines:
                return ConfigError(exc.message, file=source, line=lines[parts[:end]], key=exc.key)
        return ConfigError(exc.message, file=source, key=exc.key)

    def interpolate(value: str, key: str) -> str:
        if "${" not in value:
            return value
        return _Text(_interpolate(value, env, lambda msg: ConfigError(msg, key=key)))

    try:
        data = _walk_strings(data, interpolate, "")
    except ConfigError as exc:
        raise located(exc) from None

    for name, raw in env.items():
        if not name.startswith("TAPROOM_") or "__" not in name:
            continue
        parts = tuple(p.lower() for p in name[len("TAPROOM_") :].split("__"))
        overrides[parts] = name
        node = data
        for depth, part in enumerate(parts[:-1], start=1):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                overrides[parts[:depth]] = name
                key = ".".join(parts[:depth])
                raise located(ConfigError("not a table: cannot override a key inside it", key=key))
        node[parts[-1]] = _Text(raw)

    sections = known_sections()
    built: dict[str, Any] = {}
    for name in data:
        if name not in sections:
            known = ", ".join(sorted(sections))
            raise located(ConfigError(f"unknown section (known: {known})", key=name))
    warnings: list[str] = []
    for name, table in data.items():  # in the file's order, whatever order sections register in
        if not isinstance(table, dict):
            raise located(ConfigError("expected a table", key=name))
        retired = _RETIRED.get(name, {})
        for key in [k for k in table if k in retired]:
            where = located(ConfigError(f"retired, ignored: {retired[key]}", key=f"{name}.{key}"))
            warnings.append(str(where))
        data[name] = {k: v for k, v in table.items() if k not in retired}
    for name, cls in sections.items():
        table = data.get(name, {})
        try:
            built[name] = _build(cls, table, name)
        except ConfigError as exc:
            raise located(exc) from None
    config = Config(built, source, tuple(warnings))
    for check in _CHECKS:
        try:
            check(config)
        except ConfigError as exc:
            raise located(exc) from None
    return config


def describe_defaults() -> list[tuple[str, str, Any, str]]:
    """(section, key, default, why) for every setting: docs and ``taproom config defaults``."""
    rows = []
    for name, cls in known_sections().items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            if f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            rows.append((name, f.name, default, f.metadata.get("why", "")))
    return rows
