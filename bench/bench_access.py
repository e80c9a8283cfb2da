"""Access control figures (issue 27): logjam PUSH ingest with no access control, with a
3-entry allowlist (checked by the ZAP handler once per connection) and with CURVE (every
frame encrypted by the agent's libzmq and decrypted by the hub's): events/s and the hub's CPU
per event, ``fsync = always``.

The hub is a child process (``taproom serve``); the agent is a C loop (bench/zmqloops.c) in a
process of its own, so the figure is the hub's. The three runs alternate (allowlist, CURVE,
none, ...) and each figure is the best of its runs: on a shared 2-core machine the rest of the
load moves every run, and the best is the least disturbed.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import orjson
import zmq
import zmq.auth
from tests.hubprocess import HubProcess

from .bench_logjam import _committed, _config_text, _push_agent, _Usage
from .common import Figure

_CTX = mp.get_context("spawn")
ALLOW = ["10.0.0.0/8", "192.168.1.7", "127.0.0.1"]


def _access_text(mode: str, keys: dict[str, str]) -> str:
    if mode == "allowlist":
        return f"[access.logjam_pull]\nallow = {orjson.dumps(ALLOW).decode()}\n"
    if mode == "curve":
        return (
            f'[access.logjam_pull]\ncurve_secret_key_file = "{keys["hub_secret"]}"\n'
            f'curve_allowed_clients = ["{keys["agent"]}"]\n'
        )
    return ""


def _run(tmp: Path, mode: str, n: int, keys: dict[str, str]) -> tuple[float, float]:
    """(events/s, hub CPU-seconds) of one ingest of ``n`` messages."""
    work = tmp / mode
    work.mkdir(exist_ok=True)
    cfg = work / "taproom.toml"
    cfg.write_text(_config_text(str(work / "journal")) + _access_text(mode, keys))
    hub = HubProcess(cfg).start()
    try:
        started = _CTX.Value("d", 0.0)
        base = _committed(hub)
        usage = _Usage(hub.pid)
        curve = (keys["hub"], keys["agent_secret"]) if mode == "curve" else None
        agent = _CTX.Process(
            target=_push_agent,
            args=("tcp://" + hub.addresses["logjam_pull"], n, started, curve),
        )
        agent.start()
        while _committed(hub) < base + n:
            time.sleep(0.1)  # each scrape costs the hub CPU: not too often
        done = time.time()
        cpu, _, _ = usage.stop()
        agent.join()
        return n / (done - started.value), cpu
    finally:
        hub.stop()


def run(quick: bool) -> list[Figure]:
    n = 60_000 if quick else 600_000
    rounds = 1 if quick else 3
    modes = ("allowlist", "curve", "none")
    best: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-access-") as tmp:
        keys: dict[str, str] = {}
        for name in ("hub", "agent"):
            public, secret = zmq.auth.create_certificates(tmp, name)
            keys[name], keys[f"{name}_secret"] = public, secret
        for _ in range(rounds):
            for mode in modes:
                rate, cpu = _run(Path(tmp), mode, n, keys)
                old = best.get(mode)
                best[mode] = (max(rate, old[0]) if old else rate, min(cpu, old[1]) if old else cpu)
    figures = []
    base_cpu = best["none"][1]
    labels = {
        "none": f"ingest PUSH, no access control (best of {rounds} x {n:,})",
        "allowlist": "ingest PUSH, 3-entry allowlist (ZAP)",
        "curve": "ingest PUSH, CURVE (client key list)",
    }
    for mode in ("none", "allowlist", "curve"):
        rate, cpu = best[mode]
        figures += [
            Figure(labels[mode], rate, "msg/s"),
            Figure("  hub CPU per event", cpu / n * 1e6, "us"),
            Figure("  per hub CPU-second", n / cpu, "msg/s"),
        ]
        if mode != "none":
            figures.append(Figure("  / no access control, per CPU-second", base_cpu / cpu, "ratio"))
    return figures
