"""Settings for the whole suite: hypothesis profiles, the SOAK switch, the journal's check of
declared kinds, the ZeroMQ path (compiled or pure Python) fixture, and how tests are spread
over parallel workers (tests/scheduling.py)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from tests import scheduling, zmqleaks

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False
)
settings.register_profile("ci", parent=settings.get_profile("default"), print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")

# Every commit checks the kinds its batches declare against their records (journal.kinds), in
# this process and in the hubs it starts.
os.environ.setdefault("TAPROOM_VERIFY_KINDS", "1")

# A ZeroMQ context a test leaves open fails that test, and never hangs the suite when the
# garbage collector reaches it (tests/zmqleaks.py).
zmqleaks.install()


@pytest.fixture(params=["ext", "py"])
def zmq_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test on taproom.zmqburst's compiled path and on its pure-Python twin. Modules of
    ZeroMQ protocol tests use it for every test (``pytestmark = usefixtures("zmq_path")``).
    Hubs started in this process take the selected path; child processes (HubProcess) get
    ``TAPROOM_NO_EXT=1`` for the Python one. "ext" fails, never skips, when the compiled
    module is not built."""
    from taproom import zmqburst

    before = zmqburst.active()
    saved = os.environ.get("TAPROOM_NO_EXT")
    zmqburst.select(request.param)
    if request.param == "py":
        os.environ["TAPROOM_NO_EXT"] = "1"
    else:
        os.environ.pop("TAPROOM_NO_EXT", None)
    try:
        yield request.param
    finally:
        zmqburst.select(before)
        if saved is None:
            os.environ.pop("TAPROOM_NO_EXT", None)
        else:
            os.environ["TAPROOM_NO_EXT"] = saved


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    scheduling.order(items)
    scheduling.record_groups(config, items)
    scheduling.cpu_bound_timeouts(items)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist, on the controller: tell each worker where to write its groups."""
    node.workerinput[scheduling.GROUPS_DIR] = scheduling.groups_dir(node.config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    return scheduling.make_scheduler(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    zmqleaks.set_phase(item.nodeid, "setup")
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    zmqleaks.set_phase(item.nodeid, "call")
    with scheduling.cpu_bound_yields(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Fail the test whose contexts leaked (or, for one reached by the garbage collector only
    now, the test it was reached in: the message names the test that made it)."""
    zmqleaks.set_phase(item.nodeid, "teardown")
    try:
        result = yield
    except BaseException as exc:
        leaks, reported = zmqleaks.check()
        for leak in leaks + reported:  # keep the teardown's own error, and say both
            exc.add_note(f"leaked ZeroMQ context: {leak}")
        raise
    finally:
        zmqleaks.set_phase("", f"between tests, after {item.nodeid}")
    leaks, reported = zmqleaks.check()
    for leak in reported:
        warnings.warn(f"leaked ZeroMQ context, by a failed test: {leak}", stacklevel=1)
    if leaks:
        pytest.fail("leaked ZeroMQ context(s):\n\n" + "\n\n".join(leaks), pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.failed:
        zmqleaks.failed(item.nodeid)
    return report


def pytest_unconfigure(config: pytest.Config) -> None:
    scheduling.remove_groups_dir(config)
