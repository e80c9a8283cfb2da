"""Feeding hubs the way shippers do: logjam agents (DEALER, 202 after the commit)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from taproom.clients.logjam import LogjamAgent
from tests.spark.generate import GeneratedEvent, generate_events

__all__ = ["LOGJAM", "logjam_requests", "send_logjam_events"]

# Hub settings for them: the logjam service on (its default grammar, logjam-device's, takes the
# generated app "api-gw", whose topics hold a "-").
LOGJAM: dict[str, Any] = {"enable": ["logjam"]}

# Requests in flight per agent before it waits for their replies (what a busy agent pipelines).
_WINDOW = 200


def logjam_requests(n: int, seed: int, **options: Any) -> list[GeneratedEvent]:
    """The logjam events of ``generate_events`` whose body is JSON (the generator mangles 1%):
    a hub stores the others as ``raw`` events, which are no requests, so leaving them out
    keeps what the tests expect independent of how the rollup treats them."""
    events = []
    for event in generate_events(n, seed=seed, **options):
        if event.protocol != "logjam":
            continue
        try:
            json.loads(event.payload)
        except ValueError:
            continue
        events.append(event)
    return events


def send_logjam_events(address: str, events: Sequence[GeneratedEvent]) -> None:
    """Send each event's payload as a logjam message on its stream (app-env) and topic, and
    return once the hub has answered 202 for every one (they are committed). The agent's
    send time (the meta frame's created ms, which the hub keeps as the event time) is the
    event's generated receive time, so event times follow the generator, not the clock."""
    agent = LogjamAgent(f"tcp://{address}", timeout=60)
    try:
        pending = 0
        for event in events:
            agent.send_frames(
                agent.frames(
                    event.payload,
                    app_env=event.stream,
                    topic=event.topic,
                    created_ms=event.received_ns // 10**6,
                ),
                wait=False,
            )
            pending += 1
            if pending == _WINDOW:
                for _ in range(pending):
                    assert agent.recv_reply()[-1] == b"202 Accepted"
                pending = 0
        for _ in range(pending):
            assert agent.recv_reply()[-1] == b"202 Accepted"
    finally:
        agent.close()
