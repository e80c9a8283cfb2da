"""Shared test support: configs on port 0, the hub in-process, and the hub as a real process
(``HubProcess``, from tests/hubprocess.py, which the benches launch hubs with too).

Every server binds 127.0.0.1 on port 0 (the tests read the actual addresses back) and every
test stops what it starts.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import random
import selectors
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest

from taproom.app import App
from taproom.config import Config, known_sections, load_config
from taproom.servers import SERVICE_MODULES
from tests.hubprocess import HubProcess
from tests.slowcommits import slow_commits  # one slow disk for every test (both submit paths)

__all__ = [
    "FAST_JVM",
    "SOAK",
    "HubProcess",
    "descendants",
    "fast_jvm",
    "fill",
    "flip_byte",
    "free_port",
    "free_ports",
    "fuzz_examples",
    "local_spark",
    "needs_mount",
    "queued_connects",
    "running_app",
    "slow_commits",
    "small_tmpfs",
    "spark_worker_python",
    "write_config",
]

# `make test` runs the short, real version of every fuzz and crash loop; `make soak` the long one.
SOAK = os.environ.get("TAPROOM_SOAK") == "1"

# Options for every JVM the tests start (the local SparkSession, stream drivers, a standalone
# cluster's daemons, drivers and executors): the client compiler only and the serial collector.
# The JVMs of a test live seconds to minutes, where C2's compiler threads and the parallel
# collector cost more CPU than they save: the Spark tests took 36% less CPU with these (98 CPU-s
# instead of 154) on a shared 2-core machine. Results are the same; a real deployment keeps the
# JVM's defaults.
FAST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def fast_jvm() -> str:
    """FAST_JVM, and the class archive of Spark's jars once `make unit` has written it
    (tests/jvm_archive.py): read when a JVM is about to start, as the archive appears while the
    suite runs. The same classes from the same jars, for half of a short JVM's CPU."""
    from tests.jvm_archive import archive_options

    return f"{FAST_JVM} {archive_options()}".strip()


def local_spark(app: str, java_options: str) -> Any:
    """A local[2] SparkSession as the tests use one (2 shuffle partitions, no UI, taproom's
    session settings and data sources), its Python workers on spark_worker_python()."""
    os.environ["PYSPARK_PYTHON"] = spark_worker_python()
    from pyspark.sql import SparkSession

    from taproom.spark.jobs.session import SESSION_CONF, configure

    builder = (
        SparkSession.builder.master("local[2]")
        .appName(app)
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.extraJavaOptions", f"-Dlog4j2.level=ERROR {java_options}")
    )
    for key, value in SESSION_CONF.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    configure(session)
    return session


# Spark starts its Python workers (the executors' daemons, a stream source's planner) with its
# own pyspark.zip first on PYTHONPATH; Python compiles a zip's modules on every start (it caches
# no bytecode for them): 1.4 CPU-s to import a stream planner's modules against 0.35 from the
# installed pyspark, whose modules are byte for byte the zip's (pip's pyspark ships both). On a
# loaded machine that start is what missed Spark's fixed 10 s for a planner to connect back.
_WORKER_PYTHON = """#!/bin/sh
# Spark's Python workers for the tests: pyspark from the installed package (its bytecode cache)
# rather than Spark's pyspark.zip, which holds the same modules (tests/support.py).
PYTHONPATH=$(printf '%s' "$PYTHONPATH" | tr ':' '\\n' | grep -v '/pyspark\\.zip$' | paste -sd: -)
export PYTHONPATH
exec {python} "$@"
"""


@functools.cache
def spark_worker_python() -> str:
    """``PYSPARK_PYTHON`` for the tests' Spark sessions, drivers and clusters: this interpreter
    (so workers import taproom), importing pyspark from the installed package (above). A JVM
    setting, like FAST_JVM: the same code runs, for a quarter of the CPU at each start."""
    directory = tempfile.mkdtemp(prefix="taproom-worker-python-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    path = os.path.join(directory, "python")
    with open(path, "w") as f:
        f.write(_WORKER_PYTHON.format(python=shlex.quote(sys.executable)))
    os.chmod(path, 0o755)
    return path


def fuzz_examples(in_test: int, in_soak: int) -> int:
    """How many examples or cycles: ``in_test`` under `make test`, ``in_soak`` under soak."""
    return in_soak if SOAK else in_test


# A real full filesystem: a small tmpfs, which only root can mount.
needs_mount = pytest.mark.skipif(
    os.geteuid() != 0, reason="a real full filesystem needs root to mount tmpfs"
)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. "2m") mounted at ``path`` for the block."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> Path:
    """Fill the filesystem of ``path`` to its last byte; delete the returned file to free it."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for size in (65536, 4096, 1):  # down to the last byte the filesystem has
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return filler


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now, for servers that must keep their
    ports across restarts (port 0 would give them new ones each time).

    Taken below the kernel's ephemeral range, never from it: while such a server is down (a
    SIGKILL, a restart), any connect() on the machine may take a port of that range as its
    local port, a client retrying against the stopped server even connecting to itself on it,
    and the restart's bind then fails with "address already in use" (seen once in a clean-clone
    run: the Lumberjack client's resend test, reconnecting every 0.1 s while its hub was down).
    A port below the range is only ever taken by a bind that names it."""
    low = _ephemeral_low()
    pool = range(10_000, low) if low > 11_000 else range(1024, 10_000)
    rng = random.SystemRandom()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.choice(pool)
        if port in ports:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (another test's server, or anything else listening)
        ports.append(port)
    return ports


def free_port() -> int:
    """One of :func:`free_ports`."""
    return free_ports(1)[0]


def flip_byte(path: Path | str, position: int, mask: int = 0x40) -> None:
    """Corrupt one byte of a file in place (journal damage tests)."""
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ mask]))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return orjson.dumps(value).decode()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def write_config(
    tmp_path: Path,
    *,
    enable: Iterable[str] = (),
    journal_dir: Path | None = None,
    **sections: Mapping[str, Any],
) -> Path:
    """A taproom.toml in ``tmp_path``: journal there, every port 0, only ``enable`` services on.

    Keyword arguments are section tables, e.g. ``lumberjack={"max_window": 100}``. Every field
    of a known section whose name ends in ``port`` is set to 0 unless given.
    """
    enable = set(enable)
    known = known_sections()
    tables: dict[str, dict[str, Any]] = {name: dict(values) for name, values in sections.items()}
    tables.setdefault("journal", {}).setdefault("dir", str(journal_dir or tmp_path / "journal"))
    tables.setdefault("web", {}).setdefault("port", 0)
    for name, cls in known.items():
        fields = getattr(cls, "__dataclass_fields__", {})
        if name in SERVICE_MODULES:
            tables.setdefault(name, {}).setdefault("enabled", name in enable)
        for field_name in fields:
            if field_name.endswith("port") and name in tables:
                tables[name].setdefault(field_name, 0)
    lines = []
    for name, values in tables.items():
        lines.append(f"[{name}]")
        for key, value in values.items():
            if (
                isinstance(value, dict)
                and all(isinstance(v, dict) for v in value.values())
                and value
            ):
                continue
            lines.append(f"{key} = {_toml_value(value)}")
        for key, value in values.items():
            if (
                isinstance(value, dict)
                and all(isinstance(v, dict) for v in value.values())
                and value
            ):
                for sub, subvalues in value.items():
                    lines.append(f"[{name}.{key}.{sub}]")
                    lines.extend(f"{k} = {_toml_value(v)}" for k, v in subvalues.items())
        lines.append("")
    path = tmp_path / "taproom.toml"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def load(path: Path) -> Config:
    return load_config(path, env={})


@contextlib.asynccontextmanager
async def running_app(
    tmp_path: Path, *, enable: Iterable[str] = (), **sections: Mapping[str, Any]
) -> AsyncIterator[App]:
    """The whole hub in this test's event loop: ``async with running_app(...) as app``."""
    config = load(write_config(tmp_path, enable=enable, **sections))
    app = App(config)
    try:
        await app.start()
    except BaseException:
        await app.stop()  # what started before the failure (the hub's commit thread...)
        raise
    try:
        yield app
    finally:
        await app.stop()


def queued_connects(address: tuple[str, int], count: int, wait: float = 0.5) -> int:
    """Open ``count`` connections while the server accepts none (call it from the server's
    own event loop thread, which it blocks): how many the kernel completed within ``wait`` s,
    i.e. how deep the listener's accept queue is (a full queue drops SYNs)."""
    selector = selectors.DefaultSelector()
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(address)
            selector.register(sock, selectors.EVENT_WRITE)
            socks.append(sock)
        completed = 0
        deadline = time.monotonic() + wait
        while selector.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                selector.unregister(key.fileobj)
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                completed += sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        return completed
    finally:
        selector.close()
        for sock in socks:
            sock.close()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (a Spark driver's JVM, a worker's executors and their
    Pythons), read from /proc."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


@contextlib.contextmanager
def lone_commit_probe(hub: Any, what: str) -> Iterator[tuple[list[bool], list[bool]]]:
    """While in it, each batch ``hub`` is given is watched (issue 32's one request in flight):
    yields ``(in_place, in_callback)``, one flag a batch: committed in the turn of the loop that
    submitted it, and submitted outside any task (in a read callback). Turns are counted at the
    loop's select (a callback scheduled to tell would itself keep ``Hub.commit_now`` from
    committing in place). Each commit is checked durable before ``what`` (the ack) goes out."""
    import asyncio

    selector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
    select = selector.select
    real = hub.submit_callback
    turns = [0]
    in_place: list[bool] = []
    in_callback: list[bool] = []

    def counting_select(timeout: float | None = None) -> Any:
        turns[0] += 1
        return select(timeout)

    def probe(batch: Any, callback: Any, **kw: Any) -> None:
        turn = turns[0]
        in_callback.append(asyncio.current_task() is None)
        end = hub.journal.end_offset + batch.count

        def on_commit(commit: Any, error: Any) -> None:
            in_place.append(turns[0] == turn)
            assert hub.journal.end_offset >= end, f"not durable before the {what}"
            callback(commit, error)

        real(batch, on_commit, **kw)

    selector.select = counting_select
    hub.submit_callback = probe
    try:
        yield in_place, in_callback
    finally:
        del selector.select
        hub.submit_callback = real
