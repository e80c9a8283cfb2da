"""Each start-up rebuild's state, the way the services make it, for tests comparing a rebuild
from checkpoint plus tail with a full read of the journal (tests/servers/test_rebuild.py, the
crash loop of tests/test_restart.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from taproom.config import Config, load_config
from taproom.journal import Journal
from taproom.metrics import Metrics
from taproom.servers.eventbus.checkpoint import rebuild_state
from taproom.servers.lager.config import LagerConfig
from taproom.servers.lager.registrar import RegistrarServer
from taproom.servers.logtk.dedup import TAG_BITS, DedupIndex, rebuild
from taproom.supervise import Supervisor

__all__ = ["BUS_WINDOW", "WINDOW_S", "Host", "checkpoint_paths", "open_host", "registrar", "states"]

WINDOW_S = 3600.0
BUS_WINDOW = 50


@dataclass
class Host:
    """What the services' rebuilds use of a hub: its journal (here with segments smaller than
    a hub's configuration allows, to have many), metrics, supervisor and configuration."""

    config: Config
    metrics: Metrics
    journal: Journal
    supervisor: Supervisor


def open_host(directory: str, segment_bytes: int) -> Host:
    config = load_config(None, env={"TAPROOM_JOURNAL__DIR": directory})
    metrics = Metrics()
    journal = Journal(directory, segment_bytes=segment_bytes, fsync="off", metrics=metrics)
    return Host(config, metrics, journal, Supervisor(config.hub, metrics))


def checkpoint_paths(directory: str) -> dict[str, str]:
    """Where each service keeps its checkpoint beside the journal at ``directory``."""
    return {
        "eventbus": os.path.join(directory, "eventbus", "checkpoint"),
        "logtk": os.path.join(directory, "logtk", "dedup.checkpoint"),
        "lager": os.path.join(directory, "lager-registrar.json"),
    }


def registrar(host: Host, state_file: str) -> RegistrarServer:
    return RegistrarServer(
        host,  # type: ignore[arg-type]  # a hub's journal, metrics and config are all it reads
        LagerConfig(state_file=state_file),
        lambda reason, detail: None,
        on_change=lambda: None,
        on_applied=lambda reg: None,
        on_hugz=lambda: None,
    )


def states(
    host: Host, now: float, *, checkpoints: bool, bus_window: int = BUS_WINDOW
) -> dict[str, Any]:
    """Each service's state as its start rebuilds it; a full read without ``checkpoints``."""
    paths = checkpoint_paths(host.config.journal.dir)
    missing = os.path.join(host.config.journal.dir, "no-such-checkpoint")
    bus = rebuild_state(host, bus_window, paths["eventbus"] if checkpoints else None)  # type: ignore[arg-type]
    index = DedupIndex(WINDOW_S, 4_000_000)
    rebuild(index, host.journal, paths["logtk"] if checkpoints else None, 10**9, now)
    lager = registrar(host, paths["lager"] if checkpoints else missing)
    lager.restore()
    return {
        "eventbus": (bus.hashmap, bus.sequence, bus.recent_uuids),
        "logtk": logtk_keys(index),
        "lager": (
            [(r.key, r.uuid, r.value, r.sequence) for r in lager.registrar.snapshot()],
            lager.registrar.sequence,
        ),
    }


def logtk_keys(index: DedupIndex) -> dict[tuple[str, int, int], float]:
    """(app, client id, idem) -> start of its time bucket, whatever slot numbers it got."""
    names = {slot: pair for pair, slot in index._slots.items()}
    out: dict[tuple[str, int, int], float] = {}
    for start, keys in index._buckets:
        for key in keys:
            out[(*names[key >> 32], key & 0xFFFFFFFF)] = start
    for tagged in index._frozen.tolist():
        key = tagged >> TAG_BITS
        start = index._frozen_starts[tagged & ((1 << TAG_BITS) - 1)]
        out.setdefault((*names[key >> 32], key & 0xFFFFFFFF), start)
    return out
