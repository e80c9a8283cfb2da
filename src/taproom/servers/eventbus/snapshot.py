"""The SNAPSHOT port: SYNCSTART answered with the hashmap's entries and SYNCEND."""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from ...protocols.eventbus import (
    BStarState,
    Command,
    EventBusError,
    parse_syncstart,
    syncend_frames,
)
from ...zmqframes import recv_frames
from .collector import Collector
from .wire import MAX_FRAMES, MORE, NOBLOCK, base_send, rearm

SYNC = Command.SYNC.value


log = logging.getLogger("taproom.eventbus")


class SnapshotServer(Collector):
    """Serves snapshots side by side, each to one client."""

    async def _snapshot_loop(self) -> None:
        raw = self._snapshot_raw
        while True:
            await self._snapshot.poll()
            while True:
                try:
                    msg = recv_frames(raw, MAX_FRAMES)
                except zmq.Again:
                    break
                if msg is None:
                    self._reject("frame_count", f"SNAPSHOT: message over {MAX_FRAMES} frames")
                    continue
                try:
                    request = parse_syncstart(msg[1:], self.limits)
                except EventBusError as exc:
                    self._reject(exc.reason, f"SNAPSHOT: {exc}")
                    continue
                if not self._may_serve():
                    self._reject("not_active", "SYNCSTART to a server that is not active")
                    continue
                # Snapshots run side by side so one slow client holds up only itself; each
                # SYNC is sent whole between awaits, so their messages never interleave.
                await self._snapshot_slots.acquire()
                task = asyncio.create_task(
                    self._serve_snapshot(msg[0], request.subtrees, request.sequence)
                )
                self._snapshot_tasks.add(task)
                task.add_done_callback(self._snapshot_tasks.discard)

    async def _serve_snapshot(self, identity: bytes, subtrees: tuple[str, ...], floor: int) -> None:
        try:
            await self._send_snapshot(identity, subtrees, floor)
        except zmq.ZMQError as exc:  # the client went away (EHOSTUNREACH) mid-snapshot
            log.info("eventbus: snapshot abandoned: %s", exc)
        finally:
            self._snapshot_slots.release()
            rearm(self._snapshot)

    def _may_serve(self) -> bool:
        if self.fsm.state is BStarState.PASSIVE and not self.synced:
            return False  # never become active with state the peer had not confirmed
        before = self.fsm.state
        allowed = self.fsm.on_client_request(time.monotonic())
        if self.fsm.state is not before:
            self._transition(before)
        return allowed

    async def _send_snapshot(self, identity: bytes, subtrees: tuple[str, ...], floor: int) -> None:
        cut = self.last_seq
        prefixes = tuple(s.encode() for s in subtrees)
        values = self.hashmap.values()
        if prefixes:
            entries = [f for s, f in values if s > floor and f[0].startswith(prefixes)]
        else:
            entries = [f for s, f in values if s > floor]
        raw = self._snapshot_raw
        more = MORE
        first = MORE | NOBLOCK
        send = base_send
        deadline = time.monotonic() + self.config.snapshot_timeout_ms / 1000
        for sent, frames in enumerate(entries, 1):
            while True:
                try:
                    send(raw, identity, first)
                    break
                except zmq.Again:
                    if time.monotonic() > deadline:
                        log.warning("eventbus: snapshot to a slow client abandoned")
                        return
                    rearm(self._snapshot)
                    await asyncio.sleep(0.001)
            send(raw, SYNC, more)
            send(raw, frames[0], more)
            send(raw, frames[1], more)
            send(raw, frames[2], more)
            send(raw, frames[3], more)
            send(raw, frames[4], more)
            send(raw, frames[5], 0)
            if sent % 4096 == 0:
                rearm(self._snapshot)
                await asyncio.sleep(0)  # let the collector and broadcaster run
        while True:
            try:
                raw.send_multipart([identity, *syncend_frames(subtrees, cut)], zmq.NOBLOCK)
                break
            except zmq.Again:
                if time.monotonic() > deadline:
                    return
                await asyncio.sleep(0.001)
        self._m_snapshots.inc()
