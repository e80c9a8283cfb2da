"""How the suite is spread over pytest-xdist workers (`make unit`: ``-n N --dist loadgroup``).

Each test goes to the next free worker, except that tests sharing something costly go to one
worker as a unit, in file order (a group; docs/testing.md):

* tests using the ``spark`` session fixture (a local JVM): the groups ``spark`` and
  ``spark-b`` (by module, ``SECOND_SPARK_SESSION``), so two JVMs serve them all on two
  workers, except those marked ``slow``, which run beside them with a session of their own;
* other tests using a fixture of module or class scope (a hub, a browser, a Spark cluster set
  up once for the module): grouped by module, so it is set up once and its tests keep their
  order (the probe's last test checks what the others left);
* tests with an ``xdist_group`` mark written by hand: that group.

Tests marked ``slow`` are sent first, then the Spark groups, then the other groups, then the
rest, so the longest units never start last and hold the run open while the other workers
are idle.

xdist's own loadgroup finds its groups by renaming each test's node id, which pytest 9.2 no
longer allows (node ids became structured values): with it every test ran alone, module
fixtures were set up once per worker, and the probe's tests were split across hubs. Here each
worker writes the groups it computed while collecting to a file in a directory the controller
names (``workerinput``); the controller's scheduler, xdist's load-scope scheduling, reads it
and sends each group as one unit.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "GROUPS_DIR",
    "cpu_bound_timeouts",
    "cpu_bound_yields",
    "group_of",
    "make_scheduler",
    "order",
    "record_groups",
]

# The workerinput key naming the directory where workers write their groups.
GROUPS_DIR = "taproom_groups_dir"

# The tests sharing a local SparkSession are split over two sessions (two workers, a JVM
# each): run on one they took ~10 minutes at load 20 (584 s, 35 tests, tests/spark and
# tests/fleet/test_spark_hubs.py), the longest unit of the suite; a second JVM costs ~40 s of
# start-up. These modules (~336 s of that run) form the second group, the rest (~285 s with
# the session's start) the first.
SPARK_GROUPS = ("spark", "spark-b")
SECOND_SPARK_SESSION = ("tests/fleet/", "tests/spark/test_jobs.py")


def _uses_fixture_of_scope(item: pytest.Item, scopes: tuple[str, ...]) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(d.scope in scopes for defs in info.name2fixturedefs.values() for d in defs)


def group_of(item: pytest.Item) -> str | None:
    """The group ``item`` runs in, or None when it may run on any worker alone."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    if "spark" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("slow"):
        return SPARK_GROUPS[1] if item.nodeid.startswith(SECOND_SPARK_SESSION) else SPARK_GROUPS[0]
    if _uses_fixture_of_scope(item, ("module", "class", "package")):
        return item.nodeid.split("::", 1)[0]
    return None


def order(items: list[pytest.Item]) -> None:
    """Slow tests first, then the Spark groups, then the other groups (several tests sharing
    a fixture: a unit longer than most single tests), then single tests; file order within
    each (a stable sort). Units are sent in the order their first test comes (no reordering by
    count: `make unit` passes ``--no-loadscope-reorder``), so the longest start first and the
    short ones fill the workers at the end."""

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("slow"):
            return 0
        group = group_of(item)
        if group in SPARK_GROUPS:
            return 1
        return 3 if group is None else 2

    items.sort(key=rank)


def record_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker: write {node id: group} where the controller's scheduler reads it."""
    workerinput = getattr(config, "workerinput", None)
    if not workerinput or GROUPS_DIR not in workerinput:
        return
    groups = {item.nodeid: group for item in items if (group := group_of(item)) is not None}
    path = Path(workerinput[GROUPS_DIR]) / f"{workerinput['workerid']}.json"
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(groups))
    os.replace(partial, path)  # whole or absent: the controller reads it after collection


def groups_dir(config: pytest.Config) -> str:
    """On the controller: the directory workers write their groups to (made once)."""
    key = "_taproom_groups_dir"
    if not hasattr(config, key):
        setattr(config, key, tempfile.mkdtemp(prefix="taproom-xdist-groups-"))
    return str(getattr(config, key))


def remove_groups_dir(config: pytest.Config) -> None:
    path = getattr(config, "_taproom_groups_dir", None)
    if path is not None:
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        os.rmdir(path)


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's load-scope scheduling, where a test's scope is its group (or itself)."""
    from xdist.scheduler import LoadScopeScheduling

    directory = groups_dir(config)

    class GroupScheduling(LoadScopeScheduling):
        _groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                # Called once every worker has collected (and so written its file); the
                # workers collected the same tests (xdist checks), so any file will do.
                self._groups = {}
                for name in sorted(os.listdir(directory)):
                    if name.endswith(".json"):
                        self._groups.update(json.loads(Path(directory, name).read_text()))
            return self._groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


# How much lower a property test's CPU priority is while it runs beside other tests (nice).
CPU_BOUND_NICE = 10
# pytest-timeout's limit for a property test (a hang guard, not a figure): at nice 10 it gets
# the CPU the other tests leave, and with a second copy of the suite on the machine (load
# 15-21) the journal model's and the protocol fuzzers' runs passed the default 300 s (45-115 s
# at load 10-15), each ending as hypothesis's "Inconsistent data generation" when the timeout's
# signal cut a run short.
CPU_BOUND_TIMEOUT_S = 900


def _is_property_test(item: pytest.Item) -> bool:
    return bool(getattr(getattr(item, "obj", None), "is_hypothesis_test", False))


def cpu_bound_timeouts(items: list[pytest.Item]) -> None:
    """Give each property test without a ``timeout`` mark of its own ``CPU_BOUND_TIMEOUT_S``."""
    for item in items:
        if _is_property_test(item) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(CPU_BOUND_TIMEOUT_S))


@contextlib.contextmanager
def cpu_bound_yields(item: pytest.Item) -> Iterator[None]:
    """On a parallel worker, a hypothesis test (CPU-bound: it keeps a core busy for its whole
    run) runs at a lower CPU priority, and so do the processes it starts. Tests beside it that
    wait on a deadline inside a program we do not control go first: Spark gives a Python worker
    it starts a fixed 10 s to connect back (PythonWorkerFactory, not configurable), which the
    Spark tests missed at CPU pressure ~85% with property tests on the other workers. The
    property test runs the same examples, only later. The priority is set back afterwards where
    the system allows it (raising it again needs CAP_SYS_NICE); else the worker stays lower."""
    if not _is_property_test(item) or not hasattr(item.config, "workerinput"):
        yield
        return
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, max(before, CPU_BOUND_NICE))
    try:
        yield
    finally:
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, before)
