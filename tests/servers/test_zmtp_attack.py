"""Issue 26.2 against a real ``taproom serve``: unfinished multi-part messages on every ZeroMQ
ingest listener taproom reads with its own transport.

Raw ZMTP peers (greeting + READY, then 40 frames of 1 MiB flagged MORE, never the last) on
each listener, 5 peers (10 over two listeners under ``make soak``), while honest Lumberjack,
LogTK and logjam senders keep sending: the hub's peak RSS (VmHWM) stays within 2 x
max_pending_bytes + 100 MB, ``/health`` answers within 1 s throughout, the honest senders keep
being acknowledged, and every attacking peer is counted (``message_too_large`` past the
message bound, or ``unfinished_message`` / ``partial_timeout`` for those the full budget kept
from getting there). libzmq held every frame: 278 MiB with 5 peers on one socket, nothing counted.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from bench.bench_attack import goal_mib, zmq_unfinished_multipart

from taproom.servers.logtk import hash_token
from tests.support import SOAK, HubProcess, write_config
from tests.test_probe import (
    TOKEN,
    HealthWatch,
    HonestSenders,
    get,
    metric_sum,
    status_kib,
    wait_for,
)

# (listener, the socket type its peers have): every ingest listener on taproom's transport
LISTENERS = [
    ("logjam_router", b"DEALER"),
    ("logjam_pull", b"PUSH"),
    ("eventbus_collector", b"DEALER"),
    ("eventbus_chp_collector", b"PUB"),
    ("lager_forwarder_in", b"PUB"),
    ("lager_registrar_collector", b"PUB"),
]
PEERS = 10 if SOAK else 5
REASONS = ("message_too_large", "unfinished_message", "partial_timeout")


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubProcess]:
    tmp = tmp_path_factory.mktemp("zmtp-attack")
    apps = {"apps": {"probe": {"token_sha256": hash_token(TOKEN)}}}
    config = write_config(
        tmp,
        enable=("lumberjack", "logtk", "logjam", "eventbus", "lager"),
        logtk=apps,
        eventbus={"chp": True},
    )
    with HubProcess(config) as process:
        yield process


@pytest.fixture(scope="module")
def senders(hub: HubProcess) -> Iterator[HonestSenders]:
    with HonestSenders(hub) as running:
        yield running


def refused(hub: HubProcess, reason: str) -> float:
    return metric_sum(hub, "taproom_ingest_rejected_items_total", f'reason="{reason}"')


@pytest.mark.parametrize(("listener", "socket_type"), LISTENERS, ids=[n for n, _ in LISTENERS])
def test_unfinished_multipart_messages_stay_within_the_bound(
    hub: HubProcess, senders: HonestSenders, listener: str, socket_type: bytes
) -> None:
    targets = ((listener, socket_type),)
    if SOAK:  # the 10 peers, over two ports
        targets = (targets[0], LISTENERS[(LISTENERS.index(targets[0]) + 1) % len(LISTENERS)])
    before = sum(map(refused, [hub] * 3, REASONS))
    addresses = {name: hub.address(name) for name, _ in LISTENERS}
    with HealthWatch(hub) as watch:
        zmq_unfinished_multipart(targets, PEERS)(addresses, None)  # type: ignore[arg-type]
    # every attacker is counted: cut off past the 8 MiB bound (logjam max_frame_bytes), or
    # (not read while the budget's connection buffers were full: TCP pushed back) gone with
    # its message unfinished, or cut off after partial_timeout_s
    wait_for(lambda: sum(map(refused, [hub] * 3, REASONS)) - before >= PEERS, 60)
    assert watch.failures == [] and watch.answered > 0
    assert get(hub, "/health") == 200
    peak_mib = status_kib(hub, "VmHWM") / 1024
    assert peak_mib <= goal_mib(), (peak_mib, goal_mib())
    senders.still_acked()
    # nothing a refused peer sent is held any more
    wait_for(lambda: metric_sum(hub, "taproom_zmtp_buffered_bytes", listener) < 1 << 20, 30)
