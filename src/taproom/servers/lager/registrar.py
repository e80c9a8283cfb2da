"""The Bartender's registrar: CHP over three sockets, with the journal as its memory.

SNAPSHOT ROUTER at P answers ``ICANHAZ?``; PUBLISHER PUB at P+1 sends each hashmap change and
``HUGZ`` when idle; COLLECTOR SUB at P+2 takes tap registrations. A registration is committed
to the journal (content type ``lager-registration``, stream = tap key, producer = tap uuid,
payload = the format XML) before the hashmap changes and the update is published, so the
journal is the source of truth. ``<journal dir>/lager-registrar.json`` is a checkpoint of the
hashmap plus the journal offset it covers (the journal's end whenever no registration is being
committed), written atomically after registrations (at most every ``checkpoint_interval_s``),
once a minute while only the journal moved on, and at stop; on start the checkpoint is loaded
and the registrations after that offset replayed (every one in the journal if there is no
checkpoint; the journal's index skips the frames holding none), so registrations survive a
restart and even a SIGKILL.

A key moves to a new uuid only when a registration names that uuid: a registration for a
held key takes it over once the holder is *gone* (nothing, rows or registrations, came from the
old uuid for ``takeover_after_s``); one that arrives while the holder is alive is refused as
``duplicate_key`` and remembered as a claim, which takes the key as soon as the holder is gone
(checked every ``_CLAIM_TICK_S``). A takeover is journaled as a registration with
``attrs.replaces`` = the old uuid and published as an update. Rows never move a key: a restarted
nasa/lager Tap often sends none (its snapshot already shows its key with its format), and rows
name no key, so its rows are journaled unattributed until a registration names its uuid (the
forwarder's module docstring; docs/protocols/lager.md, "Restarted taps").
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid as uuid_module
from collections.abc import Awaitable, Callable, Iterable

import orjson
import zmq
import zmq.asyncio

from ... import zmqburst
from ...checkpoint import CheckpointSchedule, discard_checkpoint
from ...errors import HubStopped, ProtocolError
from ...hub import Hub
from ...journal.kinds import Kind
from ...protocols.lager.chp import (
    ChpError,
    Registrar,
    Registration,
    hugz_frames,
    kthxbai_frames,
    parse_registration,
    parse_snapshot_request,
)
from ...protocols.lager.formats import parse_format_xml
from ...records import BatchBuilder, iter_batch
from ..zmtp import ZmtpPublisher, ZmtpSocket
from .config import LagerConfig
from .sockets import readable, recv_bounded, send

__all__ = ["REGISTRATION_CONTENT_TYPE", "RegistrarServer"]

log = logging.getLogger("taproom.lager")

REGISTRATION_CONTENT_TYPE = "lager-registration"
REGISTRATION_KIND = Kind("lager", REGISTRATION_CONTENT_TYPE)
_STATE_VERSION = 1
_MAX_CLAIMS = 1024
_CLAIM_TICK_S = 0.1  # how often claims are checked against their holders
# Only the journal moved on (no registration): the checkpoint's offset is brought up to date
# this often. Not needed for speed (the journal's index skips frames without registrations),
# it keeps the offset a restart starts from recent.
_IDLE_CHECKPOINT_S = 60.0


class RegistrarServer:
    """The registrar's sockets, loops and persistence around a :class:`Registrar` hashmap.

    ``on_change`` runs before a committed registration changes the map (the forwarder drops
    what it cached about formats), ``on_applied`` after it did (the forwarder releases rows it
    held for that uuid); ``on_hugz`` runs at every HUGZ round.
    """

    def __init__(
        self,
        hub: Hub,
        config: LagerConfig,
        reject: Callable[[str, str], None],
        *,
        on_change: Callable[[], None],
        on_applied: Callable[[Registration], None],
        on_hugz: Callable[[], None],
    ) -> None:
        self.hub = hub
        self.config = config
        self._reject = reject
        self._on_change = on_change
        self._on_applied = on_applied
        self._on_hugz = on_hugz
        # Per-message supervision of the collector and snapshot loops (taproom.supervise).
        supervisor = hub.supervisor
        self._collector_guard = supervisor.guard("lager.registrar.collector", protocol="lager")
        self._snapshot_guard = supervisor.guard("lager.registrar.snapshot", protocol="lager")
        # Only one change of the map at a time (collector bursts and takeovers both commit
        # first, then apply: the checks must still hold when they apply).
        self._map_lock = asyncio.Lock()
        # uuid -> when rows or a registration last came from it (monotonic); a uuid not in it
        # has been silent since this process started.
        self._active: dict[bytes, float] = {}
        self._started = time.monotonic()
        # uuid -> its registration refused as duplicate_key: it takes the key when the holder
        # is gone (bounded: the oldest claims go first).
        self._claims: dict[bytes, Registration] = {}
        self.registrar = Registrar(max_taps=config.max_taps)
        self.state_path = config.state_file or os.path.join(
            hub.config.journal.dir, "lager-registrar.json"
        )
        self._registered_offset = 0  # journal end covered by the hashmap
        self._schedule = CheckpointSchedule(
            hub.metrics,
            "lager",
            interval_s=max(_IDLE_CHECKPOINT_S, config.checkpoint_interval_s),
            after_events=1,  # a few taps: a checkpoint is a small file
            size_ratio=0.0,
            min_gap_s=config.checkpoint_interval_s,
        )
        self._last_publish = 0.0
        m = hub.metrics
        self._m_hugz = m.counter("lager", "hugz", "messages", "HUGZ sent by the registrar")
        self._m_registered = m.counter(
            "lager", "registrations", "messages", "Registrations that changed the hashmap"
        )
        self._m_snapshots = m.counter("lager", "snapshots", "requests", "ICANHAZ? answered")
        self._m_takeovers = m.counter(
            "lager", "takeovers", "keys", "Keys moved to a new uuid after their tap was gone"
        )
        self._m_abandoned = m.counter(
            "lager",
            "snapshots_abandoned",
            "requests",
            "Snapshot answers the client had stopped reading (nasa/lager's CHP client asks once "
            "per message it reads and closes at KTHXBAI: normal, not a refusal)",
        )
        m.gauge_fn("lager", "taps", "count", "Taps in the registrar's hashmap", self._tap_count)

    def _tap_count(self) -> float:
        return len(self.registrar)

    def open(self, ctx: zmq.asyncio.Context) -> None:
        cfg = self.config
        self.snapshot = ctx.socket(zmq.ROUTER)
        self.snapshot.setsockopt(zmq.LINGER, 0)
        # taproom's own publisher (servers.zmtp): max_taps + 16 messages per subscriber (a
        # whole snapshot's worth of changes) and [zmtp]'s bytes, every message one misses
        # counted. A subscriber's subscriptions are input too: a key prefix, never more than
        # a key (a longer one disconnects it, counted message_too_large).
        self.publisher = ZmtpPublisher(
            "PUB",
            hub=self.hub,
            protocol="lager",
            name="lager_registrar_publisher",
            hwm=cfg.max_taps + 16,
            max_subscription_bytes=cfg.max_key_bytes + 64,
        )
        # Bigger than any valid registration: an oversized one must reach the parser to be
        # refused and counted; past the bound the tap's whole connection is dropped, and with
        # it the registrations queued behind the big one. taproom's own transport
        # (servers.zmtp) checks it for the whole message, at each frame header.
        frame_max = max(cfg.max_registration_frame_bytes, cfg.max_format_bytes + cfg.max_key_bytes)
        self.collector = ZmtpSocket(
            "SUB",
            hub=self.hub,
            protocol="lager",
            name="lager_registrar_collector",
            max_message_bytes=frame_max + cfg.max_key_bytes + 4096,
            subscribe=(b"",),
        )
        self.snapshot.setsockopt(zmq.MAXMSGSIZE, cfg.max_key_bytes + 16)
        self.snapshot.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A snapshot is up to max_taps messages in one burst: the HWM must hold all of them.
        self.snapshot.setsockopt(zmq.SNDHWM, cfg.max_taps + 16)

    @property
    def sockets(self) -> tuple[zmq.asyncio.Socket | ZmtpSocket | ZmtpPublisher, ...]:
        return (self.snapshot, self.publisher, self.collector)

    def bound(self, base: int) -> dict[str, str]:
        """The sockets are bound at ``base`` + 0, 1, 2: take shadows, name the listeners."""
        cfg = self.config
        # Synchronous shadows of the same sockets for NOBLOCK bursts (DESIGN.md decision 3).
        self._snapshot_raw: zmq.Socket[bytes] = zmq.Socket.shadow(self.snapshot.underlying)
        self._last_publish = time.monotonic()
        return {
            "lager_registrar_snapshot": f"{cfg.host}:{base}",
            "lager_registrar_publisher": f"{cfg.host}:{base + 1}",
            "lager_registrar_collector": f"{cfg.host}:{base + 2}",
        }

    @property
    def loops(self) -> tuple[Callable[[], Awaitable[None]], ...]:
        return (
            self._collector_loop,
            self._snapshot_loop,
            self._hugz_loop,
            self._checkpoint_loop,
            self._claim_loop,
        )

    async def close(self) -> None:
        schedule = self._schedule
        if schedule.unsaved or schedule.applied or self._covered() != schedule.covered:
            try:
                await self.save()
            except OSError as exc:
                log.error("lager: checkpoint at stop failed (%s); the journal has it all", exc)
        self.collector.close()
        self.publisher.close()
        self.snapshot.close(linger=0)

    # --- persistence ----------------------------------------------------------------------

    def restore(self) -> None:
        """Checkpoint, then every registration the journal holds after it."""
        began = time.monotonic()
        journal = self.hub.journal
        start = journal.first_offset
        covered: int | None = None
        try:
            with open(self.state_path, "rb") as f:
                state = orjson.loads(f.read())
            if int(state["journal_offset"]) > journal.opened_end_offset:
                # The journal lost a tail the checkpoint had seen (fsync = "interval" and a
                # crash): its offsets may hold other records now; replay the journal alone.
                discard_checkpoint(self.state_path)
                raise ValueError(
                    f"it covers offsets up to {state['journal_offset']}, past the journal's "
                    f"end ({journal.opened_end_offset}) when it was opened"
                )
            entries = []
            for tap in state["taps"]:
                fmt = parse_format_xml(tap["value"], max_bytes=1 << 30, max_items=1 << 20)
                entries.append(
                    Registration(
                        tap["key"], bytes.fromhex(tap["uuid"]), tap["value"], fmt, tap["sequence"]
                    )
                )
            self.registrar.restore(entries)
            self.registrar.sequence = max(self.registrar.sequence, int(state["sequence"]))
            covered = int(state["journal_offset"])
            start = max(start, covered)
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError, ProtocolError) as exc:
            log.error(
                "lager: checkpoint %s unreadable (%s); replaying the journal", self.state_path, exc
            )
            self.registrar = Registrar(max_taps=self.config.max_taps)
        replayed = read = 0
        marker = REGISTRATION_CONTENT_TYPE.encode()
        end = journal.end_offset
        for base, _count, body in journal.read_batches(start, end, kind=REGISTRATION_KIND):
            if marker not in body:  # data batches never mention it; skip decoding them
                continue

            for record in iter_batch(body, base, b"lager"):
                if record.offset < start or record.content_type != REGISTRATION_CONTENT_TYPE:
                    continue
                if record.offset >= end:
                    break
                read += 1
                try:
                    reg = parse_registration(
                        [record.stream.encode(), bytes(8), uuid_module.UUID(record.producer).bytes,
                         b"", record.payload],
                        max_xml_bytes=1 << 30,
                        max_items=1 << 20,
                    )  # fmt: skip
                    replaces = record.attrs.get("replaces")
                    replacing = uuid_module.UUID(replaces).bytes if replaces else None
                    if self.registrar.check(reg, replacing=replacing):
                        self.registrar.apply(reg)
                        replayed += 1
                except (ProtocolError, ValueError) as exc:
                    log.warning("lager: journal registration at %d skipped: %s", record.offset, exc)
        self._registered_offset = end
        self._schedule.started(seconds=time.monotonic() - began, replayed=read, covered=covered)
        log.info(
            "lager: %d taps registered (%d replayed from the journal)",
            len(self.registrar),
            replayed,
        )

    def _covered(self) -> int:
        """The journal offset the hashmap covers: the journal's end while no registration is
        being committed (each holds the map lock from its commit to its apply)."""
        if not self._map_lock.locked():
            self._registered_offset = max(self._registered_offset, self.hub.journal.end_offset)
        return self._registered_offset

    def _state(self) -> dict[str, object]:
        """The checkpoint's content, taken on the loop in one step."""
        return {
            "version": _STATE_VERSION,
            "journal_offset": self._covered(),
            "sequence": self.registrar.sequence,
            "taps": [
                {"key": r.key, "uuid": r.uuid.hex(), "value": r.value, "sequence": r.sequence}
                for r in self.registrar.snapshot()
            ],
        }

    async def save(self) -> None:
        """Write the checkpoint (in a thread), of the state as it is now."""
        state = self._state()
        taken = self._schedule.taken()
        began = time.monotonic()
        try:
            await asyncio.to_thread(self._write, state)
        except BaseException:
            self._schedule.failed(taken)
            raise
        offset = state["journal_offset"]
        assert isinstance(offset, int)
        self._schedule.written(offset, time.monotonic() - began)

    def _write(self, state: dict[str, object]) -> None:
        tmp = self.state_path + ".tmp"
        os.makedirs(os.path.dirname(os.path.abspath(self.state_path)), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(orjson.dumps(state))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.state_path)
        fd = os.open(os.path.dirname(os.path.abspath(self.state_path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    async def _checkpoint_loop(self) -> None:
        """Checkpoints by progress (CheckpointSchedule): after registrations, or once the
        journal moved on for a while."""
        await self._schedule.run(
            check_s=min(1.0, self.config.checkpoint_interval_s),
            applied=None,  # counted as registrations are applied
            covered=self._covered,
            size=lambda: len(self.registrar),
            save=self.save,
            what="lager registrar",
        )

    # --- sockets --------------------------------------------------------------------------

    def _publish(self, frames: list[bytes]) -> None:
        """Never blocks; a subscriber past its bounds misses it (counted by the publisher)."""
        self.publisher.send([frames])
        self._last_publish = time.monotonic()

    async def _collector_loop(self) -> None:
        cfg = self.config
        collector = self.collector
        reader = collector.reader(6)
        while True:
            await self.hub.wait_capacity()
            if not collector.readable:
                await collector.wait_readable(1.0)
            async with self._map_lock:
                if not await self._collect_burst(reader, cfg):
                    return
            await asyncio.sleep(0)  # a flood of refused registrations must not starve the loop

    async def _collect_burst(self, reader: zmqburst.Reader, cfg: LagerConfig) -> bool:
        """Read, check, commit and apply what the collector holds. False: the hub stopped."""
        accepted: list[tuple[Registration, bytes | None]] = []
        pending_keys: dict[str, Registration] = {}
        pending_uuids: dict[bytes, Registration] = {}
        echoes: list[list[bytes]] = []
        now = time.monotonic()
        for count, frames in reader.recv(cfg.max_batch_messages, 1 << 62).messages():
            if count > 5:
                self._reject("frame_count", "registration with more than 5 frames")
                continue
            try:
                reg = parse_registration(
                    frames,
                    max_key_bytes=cfg.max_key_bytes,
                    max_xml_bytes=cfg.max_format_bytes,
                    max_items=cfg.max_format_items,
                )
                self._active[reg.uuid] = now
                held = pending_keys.get(reg.key)
                other = pending_uuids.get(reg.uuid)
                if held is not None and held.uuid != reg.uuid:
                    raise ChpError("key registered by another tap", reason="duplicate_key")
                if other is not None and other.key != reg.key:
                    raise ChpError("uuid registered under another key", reason="duplicate_uuid")
                replacing = None
                holder = self.registrar.by_key.get(reg.key)
                if holder is not None and holder.uuid != reg.uuid and self._gone(holder, now):
                    replacing = holder.uuid  # the old tap is gone: the key moves
                changes = self.registrar.check(reg, replacing=replacing)
            except ProtocolError as exc:
                self._reject(exc.reason, str(exc))
                if exc.reason == "duplicate_key":
                    self._claim(reg)
                    # Show the holder to the refused tap (it watches the publisher).
                    holder = pending_keys.get(reg.key) or self.registrar.by_key.get(reg.key)
                    if holder is not None:
                        echoes.append(holder.frames())
                continue
            except Exception as exc:  # a bug: this registration is refused alone
                self._collector_guard.failed(exc, "registration")
                continue
            if changes and reg.key not in pending_keys:
                pending_keys[reg.key] = reg
                pending_uuids[reg.uuid] = reg
                accepted.append((reg, replacing))
            elif reg.key in self.registrar.by_key:
                echoes.append(self.registrar.by_key[reg.key].frames())  # a repeat: confirm it
        if accepted and not await self._commit(accepted):
            return False
        for frames in echoes:
            self._publish(frames)
        return True

    async def _commit(self, accepted: list[tuple[Registration, bytes | None]]) -> bool:
        """Journal, then change the map and publish (caller holds the map lock)."""
        builder = BatchBuilder()
        for reg, replacing in accepted:
            attrs = {"version": reg.format.version}
            if replacing is not None:
                attrs["replaces"] = str(uuid_module.UUID(bytes=replacing))
            builder.add(
                "lager",
                reg.value.encode("utf-8"),
                stream=reg.key,
                topic="registration",
                producer=reg.uuid_str,
                event_id=reg.uuid_str,
                content_type=REGISTRATION_CONTENT_TYPE,
                attrs=attrs,
            )
        try:
            commit = await self.hub.ingest(builder.build())
        except HubStopped:
            return False
        self._on_change()  # a tap's format may have changed
        for reg, replacing in accepted:  # under the map lock: the checks still hold
            stored = self.registrar.apply(reg)
            self._claims.pop(reg.uuid, None)
            self._m_registered.inc()
            if replacing is not None:
                self._m_takeovers.inc()
                log.warning(
                    "lager: %s moved from tap %s (silent) to tap %s",
                    reg.key, uuid_module.UUID(bytes=replacing), reg.uuid_str,
                )  # fmt: skip
            self._publish(stored.frames())
            self._on_applied(stored)
        self._registered_offset = max(self._registered_offset, commit.end_offset)
        self._schedule.applied += len(accepted)
        return True

    # --- takeovers ------------------------------------------------------------------------

    def touch(self, uuids: Iterable[bytes], now: float) -> None:
        """Rows came from these uuids (the forwarder calls this per batch)."""
        active = self._active
        for raw_uuid in uuids:
            active[raw_uuid] = now
        if len(active) > 4 * self.config.max_taps:  # uuids long gone and never registered
            known = self.registrar.by_uuid
            for raw_uuid in [u for u in active if u not in known]:
                del active[raw_uuid]

    def _gone(self, reg: Registration, now: float) -> bool:
        last = self._active.get(reg.uuid, self._started)
        return now - last >= self.config.takeover_after_s

    def _claim(self, reg: Registration) -> None:
        claims = self._claims
        claims.pop(reg.uuid, None)
        claims[reg.uuid] = reg
        while len(claims) > _MAX_CLAIMS:
            del claims[next(iter(claims))]

    async def _claim_loop(self) -> None:
        """A claim (a registration refused as ``duplicate_key``) takes its key once the holder
        is gone, if the claimant itself is not (a restarted tap that registered and logs on)."""
        while True:
            await asyncio.sleep(_CLAIM_TICK_S)
            if self._claims:
                async with self._map_lock:
                    await self._settle_claims()

    async def _settle_claims(self) -> None:
        now = time.monotonic()
        moves: list[tuple[Registration, bytes | None]] = []
        for raw_uuid, claim in list(self._claims.items()):
            if raw_uuid in self.registrar.by_uuid:  # it got a key meanwhile
                del self._claims[raw_uuid]
                continue
            holder = self.registrar.by_key.get(claim.key)
            if holder is not None and not self._gone(holder, now):
                continue
            if self._gone(claim, now):
                continue  # the claimant went quiet too: it waits, it does not take the key
            if any(reg.key == claim.key for reg, _ in moves):
                continue  # two claims for one key: the older first, the other stays a claim
            try:
                self.registrar.check(claim, replacing=holder.uuid if holder else None)
            except ProtocolError as exc:
                del self._claims[raw_uuid]
                self._reject(exc.reason, str(exc))
                continue
            moves.append((claim, holder.uuid if holder else None))
        if moves:
            await self._commit(moves)

    async def _snapshot_loop(self) -> None:
        cfg = self.config
        raw = self._snapshot_raw
        while True:
            if not readable(raw):
                await self.snapshot.poll(timeout=1000)
            for _ in range(256):
                try:
                    frames = recv_bounded(raw, 3)
                except zmq.Again:
                    break
                if frames is None or len(frames) < 2:
                    self._reject("bad_request", "snapshot request framing")
                    continue
                identity, request = frames[0], frames[1:]
                try:
                    subtree = parse_snapshot_request(request, max_key_bytes=cfg.max_key_bytes)
                except ChpError as exc:
                    self._reject(exc.reason, str(exc))
                    continue
                except Exception as exc:  # a bug: this request goes unanswered, the loop on
                    self._snapshot_guard.failed(exc, "snapshot request")
                    continue
                self._m_snapshots.inc()
                try:
                    for reg in self.registrar.snapshot(subtree):
                        send(raw, [identity, *reg.frames()])
                    send(raw, [identity, *kthxbai_frames(self.registrar.sequence)])
                except zmq.ZMQError:
                    # The client went away (EHOSTUNREACH) before this answer. nasa/lager's CHP
                    # client sends ICANHAZ? again after every message it reads and closes its
                    # socket at the first KTHXBAI, so all but one of its requests end here every
                    # time it starts: counted apart, never as a refusal.
                    self._m_abandoned.inc()
                await asyncio.sleep(0)

    async def _hugz_loop(self) -> None:
        interval = self.config.hugz_interval_s
        while True:
            idle = time.monotonic() - self._last_publish
            if idle >= interval:
                self._publish(hugz_frames())
                self._m_hugz.inc()
                idle = 0.0
                self._on_hugz()
            await asyncio.sleep(max(interval - idle, 0.001))
