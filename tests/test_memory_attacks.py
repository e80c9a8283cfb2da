"""Issue 26: memory bounds for the process as a whole, whatever the number of connections.

Each attack runs against a real ``taproom serve`` with every protocol on and the default
settings (``bench/bench_attack.py``: :data:`SCALED`, :func:`run_scaled`), while honest
Lumberjack, logjam and LogTK senders keep going and ``/health`` is polled. Each must hold:
peak RSS (VmHWM) within ``2 x max_pending_bytes + 100 MB``, every ``/health`` answered (the
1 s is the bench's figure), every honest sender acked while the attack ran, and the attack's
refusals counted.

``make test`` runs the short versions (8 attacking connections, smaller bombs and values);
``make soak`` the issue's sizes (1 GiB bombs, 1 MiB values) and 64 connections. Unfinished
ZeroMQ multi-part messages and slow PUB subscribers (issue 26 parts 2 and 3) are rows of
``SCALED`` too, so the all-at-once test runs them with the others; new attacks are rows
appended there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.bench_attack import SCALED, ScaledOutcome, goal_mib, run_all_at_once, run_scaled

from tests.support import SOAK

# The "/health within 1 s throughout" is a figure: `python -m bench attack` prints the
# slowest /health against it. Here every /health must be answered (200) within the watch's hang
# guard: a 1 s deadline failed at load > 18 on 2 cores (6 of 10 runs at load 23-32) whatever
# the memory did, the hub and the watcher waiting for a core (as tests/test_probe.py found).


def check(outcome: ScaledOutcome) -> None:
    print(outcome.explain())  # a failure's captured output says what each bound met
    assert outcome.hub_alive and not outcome.errors, outcome.errors
    assert outcome.health_failures == [], outcome.health_failures
    assert all(n > 0 for n in outcome.honest_during.values()), outcome.honest_during
    uncounted = [name for name, n in outcome.refused.items() if n <= 0]
    assert outcome.refused and not uncounted, (uncounted, outcome.explain())
    assert outcome.holder_peaks_within_bounds, outcome.explain()
    assert outcome.peak_mib <= goal_mib(), outcome.explain()


def row(name: str):
    return next(r for r in SCALED if r.name == name)


def test_zlib_bombs_on_8_connections(tmp_path: Path) -> None:
    # Attack 1: each connection was refused only after inflating its own 64 MiB (8: 326 MiB,
    # /health silent for 5 s, an honest window took 6.3 s).
    check(run_scaled([row("zlib bombs")], 8, tmp_path, full=SOAK))


def test_eventbus_hashmap_flood_from_4_dealers(tmp_path: Path) -> None:
    # Attack 4: 300 topics of valid 1 MiB updates from 4 DEALERs (267-276 MiB, the hashmap
    # alone 64 MiB); the hashmap holds its share of the budget (12 MiB), the rest is refused.
    outcome = run_scaled([row("eventbus 300 topics of 1 MiB")], 4, tmp_path, full=True)
    assert outcome.holder_peaks["eventbus_hashmap"] <= 12 << 20
    check(outcome)


def test_every_attack_at_once(tmp_path: Path) -> None:
    check(run_all_at_once(8, tmp_path, full=SOAK))


@pytest.mark.soak
@pytest.mark.skipif(not SOAK, reason="64 attacking connections per attack: make soak")
@pytest.mark.parametrize("attack", [r.name for r in SCALED])
def test_each_attack_on_64_connections(tmp_path: Path, attack: str) -> None:
    check(run_scaled([row(attack)], 64, tmp_path, full=True))
