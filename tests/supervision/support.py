"""What every loop's supervision test checks (taproom.supervise): a message whose handler
raises is refused alone, counted as ``internal_error``, logged once with its traceback; the
messages around it are kept, the loop goes on, and the hub stays ready."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from taproom.app import App

__all__ = [
    "INJECTED",
    "assert_supervised",
    "first_call",
    "inject",
    "internal_errors",
    "output_errors",
    "until",
]

INJECTED = "injected by the test"


async def until(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``predicate`` until true, failing after ``timeout`` s (never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def inject(
    monkeypatch: pytest.MonkeyPatch,
    owner: ModuleType | type | object,
    name: str,
    poisoned: Callable[..., bool],
) -> list[int]:
    """Replace ``owner.name`` (a loop's per-message handler) with one that raises
    ``RuntimeError`` when ``poisoned(*args)`` is true and otherwise does what it did.
    Returns a one-item list counting the injected failures."""
    real = getattr(owner, name)
    raised = [0]

    def handler(*args: Any, **kwargs: Any) -> Any:
        if poisoned(*args):
            raised[0] += 1
            raise RuntimeError(INJECTED)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, handler)
    return raised


def first_call() -> Callable[..., bool]:
    """A ``poisoned`` predicate for :func:`inject` that is true for the first call only."""
    calls = [0]

    def first(*_: object, **__: object) -> bool:
        calls[0] += 1
        return calls[0] == 1

    return first


def _sample(app: App, name: str, labels: dict[str, str]) -> float:
    return app.hub.metrics.registry.get_sample_value(name, labels) or 0.0


def internal_errors(app: App, protocol: str) -> float:
    labels = {"protocol": protocol, "reason": "internal_error"}
    return _sample(app, "taproom_ingest_rejected_items_total", labels)


def output_errors(app: App, output: str) -> float:
    labels = {"output": output, "reason": "internal_error"}
    return _sample(app, "taproom_hub_output_errors_items_total", labels)


def assert_supervised(app: App, loop: str, caplog: pytest.LogCaptureFixture) -> None:
    """The injected failure was logged with its traceback under the loop's name, the loop
    never died, and the hub is ready."""
    logged = [
        r
        for r in caplog.records
        if r.levelno == logging.ERROR
        and r.getMessage().startswith(f"{loop}: internal error")
        and r.exc_info is not None
        and INJECTED in str(r.exc_info[1])
    ]
    assert logged, f"no internal error logged for {loop}"
    status = app.hub.supervisor.loops.get(loop)
    assert status is None or status.total_deaths == 0, f"{loop} died"
    assert app.readiness() == [], app.readiness()
