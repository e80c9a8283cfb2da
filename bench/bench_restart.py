"""Restart after SIGKILL: time to ready (wall and CPU) on a 10M-event journal of every protocol.

The journal is written straight through the journal API (tests/mixedjournal.py; under
``BENCH_DIR`` or the system's temporary directory, deleted afterwards): 35% Lumberjack, 25%
logjam, 15% LogTK (1.5M idempotency keys in the window), 15% Lager rows, 10% Event BUS (10,000
topics), a few Lager registrations, interleaved batch by batch. For each service that rebuilds
state from the journal (the LogTK idempotency index, the Event BUS hashmap, the Lager
registrar), and for all of them together, ``taproom serve`` runs as a real process on a copy:

* without its checkpoint: the first start on the journal (the journal's index exists, the
  service has no checkpoint: it reads every record of its own);
* with its checkpoint: SIGKILLed once its checkpoints are written, then ``TAIL`` more events
  of every protocol committed after them (what a restart reads), started again; for all
  services together also with the longest tail the checkpoint policy leaves LogTK (its keys
  since the last save: at most max(100,000, 0.1 x its index)).

"base" is ``serve`` with no protocol service (interpreter, imports, journal open, web
listener): the floor under every other figure. "all, no index" deletes the journal's index as
well (a journal from before the index: its first start reads every segment once). CPU is the
hub process's own (user + system, every thread) when its ready file appears; the per-service
rebuild time and records read come from its /metrics. Figures are printed, never asserted.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.hubprocess import HubProcess
from tests.mixedjournal import MixedEvents

from .common import Figure, cpu_seconds_of_pid

SERVICES = ("logtk", "eventbus", "lager")
TAIL = 100_000


def _config(root: Path, journal: str, enabled: tuple[str, ...]) -> Path:
    lines = [
        f'[journal]\ndir = "{journal}"\nfsync = "always"',
        '[web]\nport = 0\n[hub]\nlog_level = "WARNING"',
    ]
    ports = {
        "lumberjack": "port = 0",
        "logtk": "ws_port = 0\ntcp_port = 0",
        "logjam": "router_port = 0\npull_port = 0\npub_port = 0\nreplay_port = 0",
        "eventbus": "port = 0",
        "lager": "registrar_port = 0",
    }
    for name, port in ports.items():
        lines.append(f"[{name}]\nenabled = {'true' if name in enabled else 'false'}\n{port}")
    path = root / ("taproom-" + ("-".join(enabled) or "base") + ".toml")
    path.write_text("\n".join(lines) + "\n")
    return path


def _metrics(hub: HubProcess) -> str:
    with urllib.request.urlopen(f"http://{hub.addresses['web']}/metrics", timeout=60) as r:
        return r.read().decode()


def _by_kind(text: str, name: str) -> dict[str, float]:
    pattern = rf'^{name}\{{kind="(\w+)"\}} ([0-9.e+-]+)$'
    return {kind: float(value) for kind, value in re.findall(pattern, text, re.M)}


def _start(
    hub: HubProcess, label: str, enabled: tuple[str, ...], figures: list[Figure]
) -> dict[str, float]:
    began = time.monotonic()
    hub.start(900)
    wall = time.monotonic() - began
    cpu = cpu_seconds_of_pid(hub.pid)
    figures.append(Figure(f"{label}: ready, wall", wall, "s"))
    figures.append(Figure(f"{label}: ready, hub CPU", cpu, "s", "<= 2" if enabled else ""))
    text = _metrics(hub)
    seconds = _by_kind(text, "taproom_restart_rebuild_seconds")
    replayed = _by_kind(text, "taproom_restart_replayed_events")
    for kind in enabled:
        figures.append(
            Figure(f"  {kind}: rebuilt in (its thread, wall)", seconds.get(kind, 0), "s")
        )
        figures.append(Figure(f"  {kind}: records read", replayed.get(kind, 0), "records"))
    return replayed


def _checkpointed(hub: HubProcess, enabled: tuple[str, ...], timeout: float = 300) -> None:
    """Wait until each enabled service has written a checkpoint after its start."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        written = _by_kind(_metrics(hub), "taproom_restart_checkpoints_calls_total")
        if all(written.get(kind, 0) >= 1 for kind in enabled):
            return
        time.sleep(0.5)
    raise TimeoutError(f"no checkpoint from {enabled} in {timeout}s")


def _copy(master: str, work: str, *, index: bool = True) -> None:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(master, work)
    if not index:
        shutil.rmtree(os.path.join(work, "index"))


def run(quick: bool) -> list[Figure]:
    events = 1_000_000 if quick else 10_000_000
    root = Path(tempfile.mkdtemp(prefix="taproom-bench-restart-", dir=os.environ.get("BENCH_DIR")))
    figures: list[Figure] = [Figure("load average (1 min) at the start", os.getloadavg()[0], "")]
    try:
        master = str(root / "master")
        began = time.monotonic()
        mixed = MixedEvents(events)
        built = mixed.write(master, events)
        figures.append(Figure("journal: events", built.events, "events"))
        figures.append(Figure("  MB", built.bytes / 1e6, "MB"))
        figures.append(Figure("  segments", built.segments, "segments"))
        figures.append(Figure("  seconds to write it", time.monotonic() - began, "s"))
        work = str(root / "work")
        # The longest tail the checkpoint policy lets LogTK (the biggest state) read: its keys
        # since the last save, max(100,000, 0.1 x the index); here 15% of the events are LogTK.
        worst = int(max(100_000, 0.1 * 0.15 * events) / 0.15)
        runs = [((), 0), *(((s,), TAIL) for s in SERVICES), (SERVICES, TAIL)]
        for enabled, tail, measure_first in [
            *((e, t, True) for e, t in runs),
            (SERVICES, worst, False),
        ]:
            name = "+".join(enabled) or "base"
            _copy(master, work)
            hub = HubProcess(_config(root, work, enabled))
            try:
                if measure_first:
                    _start(hub, f"{name}, no checkpoint", enabled, figures)
                else:  # measured already above
                    hub.start(900)
                if not enabled:
                    continue
                _checkpointed(hub, enabled)
                hub.kill()
                # What came after the checkpoints: the same journal's next events.
                copy.deepcopy(mixed).write(work, tail)
                _start(hub, f"{name}, checkpoint + {tail // 1000}k-event tail", enabled, figures)
            finally:
                hub.kill()
        _copy(master, work, index=False)
        hub = HubProcess(_config(root, work, SERVICES))
        try:
            _start(hub, "all, no checkpoint, no index (first start)", SERVICES, figures)
        finally:
            hub.kill()
        figures.append(Figure("load average (1 min) at the end", os.getloadavg()[0], ""))
        return figures
    finally:
        shutil.rmtree(root, ignore_errors=True)
