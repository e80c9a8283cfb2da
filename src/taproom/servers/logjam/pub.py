"""The logjam PUB output: committed events as logjam messages on an XPUB, and heartbeats.

Fed from ``hub.subscribe("logjam_pub")``, so only committed events go out, in journal order,
renumbered from 1 under taproom's device number, plus a heartbeat every
``heartbeat_interval_s``. Sends never block. ``ZMQ_XPUB_NODROP`` makes a send fail with EAGAIN
when any matching subscriber's queue is full; that message is then counted in
``taproom_logjam_pub_dropped_messages_total`` (a lower bound: libzmq then stops offering
messages to the full subscriber until it drains) and sent once more in lossy mode, so it still
reaches every subscriber with room and only the full ones miss it. A slow subscriber never
costs a fast one a message; consumers see their own gaps in sequence numbers, and the replay
index kept here maps recent sequence numbers back to journal offsets (see
docs/protocols/logjam.md).
"""

from __future__ import annotations

import array
import asyncio
import functools
import logging
import struct
import time
from typing import Any

import numpy as np
import orjson
import zmq

from ... import zmqburst
from ...hub import CommittedBatch, Hub, Subscription
from ...protocols import logjam as lj
from ...records import RECORD_HEAD
from .config import LogjamConfig
from .zmqio import NOBLOCK, SNDMORE, raw_send

__all__ = ["PubOutput"]

log = logging.getLogger("taproom.logjam")

# The record header of records.py's batch layout, read here to publish logjam records without
# decoding them into Record objects (the PUB output's hot path).
_RECORD_HEAD = RECORD_HEAD

_META_OUT = {24: struct.Struct("!HBBIQQ"), 22: struct.Struct("!HBBHQQ")}
_HEAD_SIZE = RECORD_HEAD.size
_RECORD_LENGTH = struct.Struct("<I")
_PROTOCOL_LENGTH_AT = 28  # len(protocol) in RECORD_HEAD: after u32, i64, i64, u64


def _is_logjam(body: bytes, pos: int) -> bool:
    """Whether the record at ``pos`` is logjam's (its protocol field is exactly "logjam")."""
    q = pos + _HEAD_SIZE
    return body[pos + _PROTOCOL_LENGTH_AT] == 6 and body[q : q + 6] == b"logjam"


class _CompiledPublisher:
    """The compiled PUB path: ``lj_publish`` on the XPUB's libzmq handle."""

    def __init__(self, ffi: Any, lib: Any, handle: Any, config: LogjamConfig) -> None:
        self._lib, self._handle = lib, handle
        self._cfg = ffi.new(
            "lj_pub *",
            {
                "meta_size": config.meta_size,
                "meta_tag": lj.META_TAG,
                "meta_version": lj.META_VERSION,
                "device": config.device_number,
                "wrap": config.sequence_wrap,
            },
        )
        self._res = ffi.new("lj_published *")

    @classmethod
    def create(cls, sock: zmq.Socket, config: LogjamConfig) -> _CompiledPublisher | None:
        ffi, lib = zmqburst.ffi_lib()
        if lib is None:
            return None
        return cls(ffi, lib, zmqburst.handle(sock), config)

    def publish(self, body: bytes, pos: int, seq: int, now_ms: int, check_protocol: bool) -> Any:
        """Records from ``pos`` on, numbered after ``seq``: the result's pos, sent, dropped,
        stop (0: the body is done; 1: a record of another protocol is at pos; -1: error)."""
        res, cfg = self._res, self._cfg
        res.pos, res.sent, res.dropped, res.seq = pos, 0, 0, seq
        cfg.now_ms = now_ms
        self._lib.lj_publish(self._handle, body, len(body), 1 << 30, int(check_protocol), cfg, res)
        return res


class PubOutput:
    """Numbers and sends committed events; remembers which offset each number carried."""

    def __init__(
        self, hub: Hub, config: LogjamConfig, hostname: bytes, mapper: lj.OutputMapper
    ) -> None:
        self.hub = hub
        self.config = config
        self.hostname = hostname
        self.mapper = mapper
        self.compression = lj.compression_by_name(config.output_compression)
        self.meta_struct = _META_OUT[config.meta_size]
        self.pub_endpoint = ""
        # Output numbering: the k-th message sent carries sequence ((k - 1) % wrap) + 1.
        self.published = 0
        self._next_publish = 0  # journal offset after the last record handled
        self._index = array.array("q", [-1]) * config.replay_index_size
        # the same memory as numpy sees it: a run of offsets is one arange, not a list
        self._index_np = np.frombuffer(self._index, dtype=np.int64)
        self.subscriptions = 0
        m = hub.metrics
        self._m_published = m.counter(
            "logjam", "published", "messages", "Messages sent on the PUB output", ("kind",)
        )
        self._m_pub_data = self._m_published.labels(kind="data")
        self._m_pub_heartbeat = self._m_published.labels(kind="heartbeat")
        self._m_dropped = m.counter(
            "logjam",
            "pub_dropped",
            "messages",
            "PUB messages refused because a matching subscriber was at its HWM",
            ("reason",),
        ).labels(reason="hwm")
        m.gauge_fn(
            "logjam", "pub_subscriptions", "count", "Live SUB prefixes", lambda: self.subscriptions
        )

    def attach(self, sock: zmq.Socket, port: str) -> None:
        """Publish on ``sock`` (bound to ``port``) from a new hub subscription."""
        self._pub = sock
        self.pub_endpoint = f"tcp://{self.hostname.decode()}:{port}"
        self.subscription: Subscription = self.hub.subscribe("logjam_pub")
        self._compiled = _CompiledPublisher.create(sock, self.config)

    def _emit(
        self,
        app_env: bytes,
        topic: bytes,
        body: bytes,
        created_ms: int,
        offset: int,
        compression: int,
    ) -> bool:
        """Number and send one message; a subscriber that was full misses it (counted)."""
        k = self.published + 1
        self.published = k
        seq = (k - 1) % self.config.sequence_wrap + 1
        index = self._index
        index[k % len(index)] = offset
        meta = self.meta_struct.pack(
            lj.META_TAG, compression, lj.META_VERSION, self.config.device_number, created_ms, seq
        )
        pub = self._pub
        try:
            raw_send(pub, app_env, zmq.NOBLOCK | zmq.SNDMORE)
        except zmq.Again:
            self._m_dropped.inc()
            self._send_past_full(app_env, topic, body, meta)
            return True  # sent: only the full subscribers miss it
        # With XPUB_NODROP only the first frame can hit the HWM (pipes count whole messages).
        raw_send(pub, topic, zmq.SNDMORE)
        raw_send(pub, body, zmq.SNDMORE)
        raw_send(pub, meta, 0)
        return True

    def _send_past_full(self, app_env: bytes, topic: bytes, body: bytes, meta: bytes) -> None:
        """Some matching subscriber's queue is full: send this one message in lossy mode, so
        every subscriber with room gets it and only the full ones miss it (their sequence
        numbers show the gap; replay fills it)."""
        pub = self._pub
        pub.setsockopt(zmq.XPUB_NODROP, 0)
        try:
            raw_send(pub, app_env, zmq.NOBLOCK | zmq.SNDMORE)
            raw_send(pub, topic, zmq.SNDMORE)
            raw_send(pub, body, zmq.SNDMORE)
            raw_send(pub, meta, 0)
        finally:
            pub.setsockopt(zmq.XPUB_NODROP, 1)

    async def publish_loop(self) -> None:
        """Supervised as ``logjam.pub``: a batch whose publishing fails unexpectedly is
        counted (``output="logjam_pub"``) and logged, and the next batch goes out."""
        guard = self.hub.supervisor.guard("logjam.pub", output="logjam_pub", logger=log)
        async for batch in self.subscription:
            self._drain_subscriptions()
            try:
                self._publish_batch(batch)
            except Exception as exc:  # a bug must not stop the output; the next batch goes out
                guard.failed(exc, "committed batch", batch.count)

    def _publish_batch(self, batch: CommittedBatch) -> None:
        """Send one committed batch. Logjam records take a fast path straight off the batch
        body (layout in records.py); other protocols are decoded and mapped."""
        now_ms = int(time.time() * 1000)
        mapper = self.mapper
        compression = int(self.compression)
        emit = self._emit
        start = self._next_publish
        if self.subscriptions == 0 and type(batch.body) is not lj.IngestedBody:
            self._number_unsent(batch, start)
            return
        if batch._records is not None or compression or batch.base_offset < start:
            sent = 0
            for record in batch.records():
                if record.offset < start or not mapper.routed(record.protocol):
                    continue
                app_env, topic, body, created = mapper.map(record, now_ms)
                if compression:
                    body = lj.compress(compression, body)
                sent += emit(app_env, topic, body, created, record.offset, compression)
            self._next_publish = batch.end_offset
            self._m_pub_data.inc(sent)
            return
        if type(batch.body) is lj.IngestedBody:
            if mapper.routed("logjam"):
                self._publish_ingested(batch, now_ms)
            self._next_publish = batch.end_offset
            return
        routed_logjam = mapper.routed("logjam")
        if routed_logjam and self._compiled is not None:
            self._publish_compiled(batch, now_ms, check_protocol=True)
            return
        body = batch.body
        unpack = _RECORD_HEAD.unpack_from
        head_size = _RECORD_HEAD.size
        pub_send = functools.partial(raw_send, self._pub)
        pack_meta = self.meta_struct.pack
        index = self._index
        index_size = len(index)
        wrap = self.config.sequence_wrap
        device = self.config.device_number
        tag, version = lj.META_TAG, lj.META_VERSION
        first_flags = NOBLOCK | SNDMORE
        more = SNDMORE
        k = self.published
        seq = (k - 1) % wrap + 1 if k else 0  # the last number handed out
        sent = dropped = 0
        others: list[int] = []
        pos = 0
        end = len(body)
        offset = batch.base_offset
        try:
            while pos < end:
                (length, _recv, ts_ns, _seq, lp, lc, ls, lt, _lr, _le, _la, ll) = unpack(body, pos)
                q = pos + head_size
                if body[q : q + lp] != b"logjam":
                    others.append(offset)  # mapped below, after this run of logjam records
                else:
                    if routed_logjam:
                        q += lp + lc
                        app_env = body[q : q + ls]
                        q += ls
                        topic = body[q : q + lt]
                        q = pos + 4 + length - ll
                        k += 1
                        seq = seq + 1 if seq < wrap else 1
                        index[k % index_size] = offset
                        meta = pack_meta(
                            tag,
                            0,
                            version,
                            device,
                            ts_ns // 1_000_000 if ts_ns > 0 else now_ms,
                            seq,
                        )
                        try:
                            pub_send(app_env, first_flags)
                        except zmq.Again:
                            dropped += 1
                            self._send_past_full(app_env, topic, body[q : q + ll], meta)
                            sent += 1
                        else:
                            pub_send(topic, more)
                            pub_send(body[q : q + ll], more)
                            pub_send(meta, 0)
                            sent += 1
                pos += 4 + length
                offset += 1
                if others and (
                    pos >= end or body[pos + head_size : pos + head_size + 6] == b"logjam"
                ):
                    # keep journal order: flush the non-logjam records before the next logjam one
                    self.published = k
                    sent += self._publish_others(batch, others, now_ms)
                    k = self.published
                    seq = (k - 1) % wrap + 1 if k else 0
                    others = []
        finally:
            self._batch_done(batch, k, sent, dropped)

    def _publish_ingested(self, batch: CommittedBatch, now_ms: int) -> None:
        """A batch the ingest loops built (its body is an :class:`lj.IngestedBody`, which the
        hub hands on as it is; read back from the journal it is plain bytes): logjam records
        only, so no protocol checks. With no subscriber at all the messages are numbered (and
        indexed for replay) exactly as if sent, but not handed to libzmq, which would drop
        every one."""
        count = batch.count
        k = self.published
        if self.subscriptions == 0:
            self._index_run(k + 1, batch.base_offset, count)
            self.published = k + count
            self._m_pub_data.inc(count)
            return
        if self._compiled is not None:
            self._publish_compiled(batch, now_ms, check_protocol=False)
            return
        body = batch.body
        unpack = _RECORD_HEAD.unpack_from
        head_size = _RECORD_HEAD.size
        send = functools.partial(raw_send, self._pub)
        pack_meta = self.meta_struct.pack
        wrap = self.config.sequence_wrap
        seq = (k - 1) % wrap + 1 if k else 0  # the last number handed out
        device = self.config.device_number
        tag, version = lj.META_TAG, lj.META_VERSION
        first_flags = NOBLOCK | SNDMORE
        more = SNDMORE
        dropped = 0
        pos = 0
        first_k = k
        try:
            for _ in range(count):
                (length, _recv, ts_ns, _seq, lp, lc, ls, lt, _lr, _le, _la, ll) = unpack(body, pos)
                # protocol "logjam", then the content type ("json", or "raw" for a body that
                # is not JSON)
                q = pos + head_size + lp + lc
                app_env = body[q : q + ls]
                q += ls
                topic = body[q : q + lt]
                pos += 4 + length
                k += 1
                seq = seq + 1 if seq < wrap else 1
                meta = pack_meta(
                    tag, 0, version, device, ts_ns // 1_000_000 if ts_ns > 0 else now_ms, seq
                )
                try:
                    send(app_env, first_flags)
                except zmq.Again:
                    dropped += 1
                    self._send_past_full(app_env, topic, body[pos - ll : pos], meta)
                    continue
                send(topic, more)
                send(body[pos - ll : pos], more)
                send(meta, 0)
        finally:
            # the replay index learns the whole run at once (offsets follow k one to one)
            self._index_run(first_k + 1, batch.base_offset, k - first_k)
            self.published = k
            if dropped:
                self._m_dropped.inc(dropped)
            self._m_pub_data.inc(k - first_k)

    def _publish_compiled(
        self, batch: CommittedBatch, now_ms: int, *, check_protocol: bool
    ) -> None:
        """Send a batch's logjam records in C (``lj_publish``, zmqburst/burst.c: the same
        frames, numbering and lossy resend as the Python loops). With ``check_protocol``, runs
        of other protocols' records between them are mapped here, in journal order."""
        compiled = self._compiled
        assert compiled is not None
        body = batch.body
        end = len(body)
        offset = batch.base_offset
        pos = sent = dropped = 0
        k = self.published
        wrap = self.config.sequence_wrap
        try:
            while pos < end:
                run = compiled.publish(
                    body, pos, (k - 1) % wrap + 1 if k else 0, now_ms, check_protocol
                )
                # the replay index learns the run at once (offsets follow k one to one)
                self._index_run(k + 1, offset, run.sent)
                k += run.sent
                offset += run.sent
                sent += run.sent
                dropped += run.dropped
                pos = run.pos
                if run.stop < 0:
                    raise zmq.ZMQError(run.error)
                if run.stop == 0:
                    break
                # records of other protocols up to the next logjam one, mapped in Python
                others = []
                while pos < end and not _is_logjam(body, pos):
                    others.append(offset)
                    pos += 4 + _RECORD_LENGTH.unpack_from(body, pos)[0]
                    offset += 1
                self.published = k
                sent += self._publish_others(batch, others, now_ms)
                k = self.published
        finally:
            self._batch_done(batch, k, sent, dropped)

    def _number_unsent(self, batch: CommittedBatch, start: int) -> None:
        """No subscriber at all: the batch's routed records are numbered (and indexed for
        replay) exactly as if sent, but neither decoded, mapped nor handed to libzmq, which
        would drop every one (a LogTK entry's one-request commit spent a third of its Python
        here, issue 32). Only each record's protocol field is read."""
        body = batch.body
        end = len(body)
        routed = self.mapper.routed
        decided: dict[bytes, bool] = {}
        index = self._index
        size = len(index)
        k = self.published
        pos, offset = 0, batch.base_offset
        while pos < end:
            q = pos + _HEAD_SIZE
            protocol = body[q : q + body[pos + _PROTOCOL_LENGTH_AT]]
            wanted = decided.get(protocol)
            if wanted is None:
                wanted = decided[protocol] = routed(protocol.decode("utf-8", "replace"))
            if wanted and offset >= start:
                k += 1
                index[k % size] = offset
            pos += 4 + _RECORD_LENGTH.unpack_from(body, pos)[0]
            offset += 1
        self._batch_done(batch, k, k - self.published, 0)

    def _batch_done(self, batch: CommittedBatch, k: int, sent: int, dropped: int) -> None:
        """After a batch, sent whole or not: the numbering and the counters."""
        self.published = k
        self._next_publish = batch.end_offset
        if dropped:
            self._m_dropped.inc(dropped)
        self._m_pub_data.inc(sent)

    def _index_run(self, k_first: int, offset: int, count: int) -> None:
        """Remember offsets ``offset ..`` for messages ``k_first ..`` in the replay ring."""
        index = self._index_np
        size = len(index)
        if count > size:  # only the last ``size`` fit in the ring
            k_first, offset, count = k_first + count - size, offset + count - size, size
        start = k_first % size
        head = min(count, size - start)
        index[start : start + head] = np.arange(offset, offset + head, dtype=np.int64)
        if count > head:
            index[: count - head] = np.arange(offset + head, offset + count, dtype=np.int64)

    def _publish_others(self, batch: CommittedBatch, offsets: list[int], now_ms: int) -> int:
        wanted = set(offsets)
        mapper = self.mapper
        sent = 0
        for record in batch.records():
            if record.offset in wanted and mapper.routed(record.protocol):
                app_env, topic, body, created = mapper.map(record, now_ms)
                sent += self._emit(app_env, topic, body, created, record.offset, 0)
        return sent

    def _drain_subscriptions(self) -> None:
        """Read XPUB subscription messages: the count is a gauge, and libzmq queues them."""
        while True:
            try:
                msg = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] == b"\x01":
                self.subscriptions += 1
            elif msg[:1] == b"\x00":
                self.subscriptions = max(0, self.subscriptions - 1)

    def subscriber_count(self) -> int:
        """Live SUB subscriptions (prefixes) the XPUB has seen, after reading pending ones."""
        self._drain_subscriptions()
        return self.subscriptions

    async def heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        topic = self.pub_endpoint.encode()
        while True:
            await asyncio.sleep(interval)
            self._drain_subscriptions()
            body = orjson.dumps(
                {
                    "device": self.config.device_number,
                    "hostname": self.hostname.decode(),
                    "next_offset": self.subscription.next_offset,
                }
            )
            if self._emit(
                lj.HEARTBEAT_APP_ENV, topic, body, int(time.time() * 1000), -1, lj.Compression.NONE
            ):
                self._m_pub_heartbeat.inc()

    def seq_offsets(self, first_seq: int, last_seq: int) -> dict[int, int] | None:
        """Journal offset per data sequence number in ``first..last``; None if forgotten."""
        k_now = self.published
        if k_now == 0:
            return None
        wrap = self.config.sequence_wrap
        seq_now = (k_now - 1) % wrap + 1
        if first_seq < 1 or last_seq > wrap:
            return None
        back = (seq_now - first_seq) % wrap
        k_first = k_now - back
        size = len(self._index)
        if k_first < 1 or k_now - k_first >= size:
            return None
        # Numbers not handed out yet are simply not there (the reply's "next" says so).
        count = min(last_seq - first_seq + 1, k_now - k_first + 1)
        result = {}
        for i in range(count):
            offset = self._index[(k_first + i) % size]
            if offset >= 0:
                result[offset] = first_seq + i
        return result
