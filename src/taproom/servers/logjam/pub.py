"""The logjam PUB output: committed events as logjam messages on an XPUB, and heartbeats.

Fed from ``hub.subscribe("logjam_pub")``, so only committed events go out, in journal order,
renumbered from 1 under taproom's device number, plus a heartbeat every
``heartbeat_interval_s``. The socket is taproom's own (:class:`~taproom.servers.zmtp.
ZmtpPublisher`): each batch's messages are built once as ZMTP wire bytes (``lj_pubwire`` in C,
or the same in Python) and written to every subscriber whose prefixes take them. Sends never
block; a subscriber past its bounds (``snd_hwm`` messages, ``[zmtp] max_subscriber_bytes`` and
its share of the budget's output queues) misses messages alone, each one counted by reason in
``taproom_output_dropped_messages_total{output="logjam_pub"}``: a slow subscriber never costs a
fast one a message. Consumers see their own gaps in sequence numbers, and the replay index
kept here maps recent sequence numbers back to journal offsets (see docs/protocols/logjam.md).
"""

from __future__ import annotations

import array
import asyncio
import logging
import struct
import time
from typing import Any

import numpy as np
import orjson

from ... import zmqburst
from ...hub import CommittedBatch, Hub, Subscription
from ...protocols import logjam as lj
from ...protocols.zmtp.pubsub import Burst
from ...records import RECORD_HEAD
from ..zmtp import ZmtpPublisher
from .config import LogjamConfig

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


class _CompiledWire:
    """The compiled PUB path: ``lj_pubwire`` writes a batch's logjam records as ZMTP wire
    bytes (one buffer, each message's end), the same bytes the Python loops build."""

    def __init__(self, ffi: Any, lib: Any, config: LogjamConfig) -> None:
        self._ffi, self._lib = ffi, lib
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
        self._ends: Any = None
        self._ends_cap = 0

    @classmethod
    def create(cls, config: LogjamConfig) -> _CompiledWire | None:
        ffi, lib = zmqburst.ffi_lib()
        if lib is None:
            return None
        return cls(ffi, lib, config)

    def build(
        self, body: bytes, pos: int, seq: int, now_ms: int, check_protocol: bool
    ) -> tuple[Burst, Any]:
        """Records from ``pos`` on, numbered after ``seq``, as one burst; the result's pos,
        sent, seq, stop (0: the body is done; 1: a record of another protocol is at pos; -1:
        error). A message's wire bytes are its record's fields plus at most 14 bytes, so the
        buffer sized here always holds the rest of the body."""
        left = len(body) - pos
        records = left // _HEAD_SIZE + 1
        if records > self._ends_cap:
            self._ends = self._ffi.new("size_t[]", records)
            self._ends_cap = records
        out = bytearray(left + 14 * records + 64)
        res, cfg = self._res, self._cfg
        res.pos, res.sent, res.seq, res.out_bytes = pos, 0, seq, 0
        cfg.now_ms = now_ms
        self._lib.lj_pubwire(
            body,
            len(body),
            1 << 30,
            int(check_protocol),
            cfg,
            self._ffi.from_buffer(out),
            len(out),
            self._ends,
            records,
            res,
        )
        del out[res.out_bytes :]  # shrinks in place: subscribers share it from now on
        return Burst(out, self._ffi.unpack(self._ends, res.sent)), res


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
        m = hub.metrics
        self._m_published = m.counter(
            "logjam", "published", "messages", "Messages sent on the PUB output", ("kind",)
        )
        # a tally (taproom.metrics): counted for every committed batch, on the loop
        self._m_pub_data = m.tally(
            "logjam", "published", "messages", "Messages sent on the PUB output", kind="data"
        )
        self._m_pub_heartbeat = self._m_published.labels(kind="heartbeat")
        m.gauge_fn(
            "logjam", "pub_subscriptions", "count", "Live SUB prefixes", self.subscriber_count
        )
        self._out: list[tuple[bytes, bytes, bytes, bytes]] = []  # messages of the batch so far

    def attach(self, pub: ZmtpPublisher, port: str) -> None:
        """Publish on ``pub`` (bound to ``port``) from a new hub subscription."""
        self._pub = pub
        self.pub_endpoint = f"tcp://{self.hostname.decode()}:{port}"
        self.subscription: Subscription = self.hub.subscribe("logjam_pub")
        self._compiled = _CompiledWire.create(self.config)
        self._guard = self.hub.supervisor.guard("logjam.pub", output="logjam_pub", logger=log)
        # While caught up, the hub publishes each committed batch from the commit itself
        # (no wakeup of publish_loop per batch, issue 32); publish_loop takes the rest.
        self.subscription.consume_directly(self._publish_one)

    def _emit(
        self,
        app_env: bytes,
        topic: bytes,
        body: bytes,
        created_ms: int,
        offset: int,
        compression: int,
    ) -> int:
        """Number one message and add it to the batch's burst (sent by :meth:`_flush`)."""
        k = self.published + 1
        self.published = k
        seq = (k - 1) % self.config.sequence_wrap + 1
        index = self._index
        index[k % len(index)] = offset
        meta = self.meta_struct.pack(
            lj.META_TAG, compression, lj.META_VERSION, self.config.device_number, created_ms, seq
        )
        self._out.append((app_env, topic, body, meta))
        return 1

    def _flush(self) -> None:
        """Send the messages built so far as one burst (built once for every subscriber)."""
        if self._out:
            out, self._out = self._out, []
            if self._pub.has_subscribers:
                self._pub.send(out)

    async def publish_loop(self) -> None:
        """Supervised as ``logjam.pub``: the batches the hub did not hand over directly
        (``_publish_one``), i.e. while this output catches up or reads back."""
        async for batch in self.subscription:
            self._publish_one(batch)

    def _publish_one(self, batch: CommittedBatch) -> None:
        """A batch whose publishing fails unexpectedly is counted (``output="logjam_pub"``)
        and logged, and the next batch goes out."""
        try:
            self._publish_batch(batch)
        except Exception as exc:  # a bug must not stop the output; the next batch goes out
            self._out = []
            self._guard.failed(exc, "committed batch", batch.count)

    def _publish_batch(self, batch: CommittedBatch) -> None:
        """Send one committed batch. Logjam records take a fast path straight off the batch
        body (layout in records.py); other protocols are decoded and mapped."""
        now_ms = int(time.time() * 1000)
        mapper = self.mapper
        compression = int(self.compression)
        emit = self._emit
        start = self._next_publish
        if not self._pub.has_subscribers and type(batch.body) is not lj.IngestedBody:
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
            self._flush()
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
        pack_meta = self.meta_struct.pack
        index = self._index
        index_size = len(index)
        wrap = self.config.sequence_wrap
        device = self.config.device_number
        tag, version = lj.META_TAG, lj.META_VERSION
        out = self._out
        k = self.published
        seq = (k - 1) % wrap + 1 if k else 0  # the last number handed out
        sent = 0
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
                elif routed_logjam:
                    q += lp + lc
                    app_env = body[q : q + ls]
                    q += ls
                    topic = body[q : q + lt]
                    q = pos + 4 + length - ll
                    k += 1
                    seq = seq + 1 if seq < wrap else 1
                    index[k % index_size] = offset
                    created = ts_ns // 1_000_000 if ts_ns > 0 else now_ms
                    meta = pack_meta(tag, 0, version, device, created, seq)
                    out.append((app_env, topic, body[q : q + ll], meta))
                    sent += 1
                pos += 4 + length
                offset += 1
                if others and (
                    pos >= end or body[pos + head_size : pos + head_size + 6] == b"logjam"
                ):
                    # keep journal order: map the non-logjam records before the next logjam one
                    self.published = k
                    sent += self._publish_others(batch, others, now_ms)
                    out = self._out
                    k = self.published
                    seq = (k - 1) % wrap + 1 if k else 0
                    others = []
        finally:
            self._flush()
            self._batch_done(batch, k, sent)

    def _publish_ingested(self, batch: CommittedBatch, now_ms: int) -> None:
        """A batch the ingest loops built (its body is an :class:`lj.IngestedBody`, which the
        hub hands on as it is; read back from the journal it is plain bytes): logjam records
        only, so no protocol checks. With no subscriber at all the messages are numbered (and
        indexed for replay) exactly as if sent, but not built."""
        count = batch.count
        k = self.published
        if not self._pub.has_subscribers:
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
        pack_meta = self.meta_struct.pack
        wrap = self.config.sequence_wrap
        seq = (k - 1) % wrap + 1 if k else 0  # the last number handed out
        device = self.config.device_number
        tag, version = lj.META_TAG, lj.META_VERSION
        out = self._out
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
                created = ts_ns // 1_000_000 if ts_ns > 0 else now_ms
                out.append(
                    (
                        app_env,
                        topic,
                        body[pos - ll : pos],
                        pack_meta(tag, 0, version, device, created, seq),
                    )
                )
        finally:
            # the replay index learns the whole run at once (offsets follow k one to one)
            self._index_run(first_k + 1, batch.base_offset, k - first_k)
            self.published = k
            self._flush()
            self._m_pub_data.inc(k - first_k)

    def _publish_compiled(
        self, batch: CommittedBatch, now_ms: int, *, check_protocol: bool
    ) -> None:
        """A batch's logjam records as wire bytes built in C (``lj_pubwire``,
        zmqburst/burst.c: the same frames and numbering as the Python loops), published as
        one burst. With ``check_protocol``, runs of other protocols' records between them are
        mapped here, in journal order."""
        compiled = self._compiled
        assert compiled is not None
        body = batch.body
        end = len(body)
        offset = batch.base_offset
        pos = sent = 0
        k = self.published
        wrap = self.config.sequence_wrap
        try:
            while pos < end:
                burst, run = compiled.build(
                    body, pos, (k - 1) % wrap + 1 if k else 0, now_ms, check_protocol
                )
                # the replay index learns the run at once (offsets follow k one to one)
                self._index_run(k + 1, offset, run.sent)
                k += run.sent
                offset += run.sent
                sent += run.sent
                pos = run.pos
                self._pub.publish(burst)
                if run.stop < 0:
                    raise ValueError(f"a record lj_pubwire cannot read at {pos}")
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
                self._flush()
                k = self.published
        finally:
            self._batch_done(batch, k, sent)

    def _number_unsent(self, batch: CommittedBatch, start: int) -> None:
        """No subscriber at all: the batch's routed records are numbered (and indexed for
        replay) exactly as if sent, but neither decoded, mapped nor built (a LogTK entry's
        one-request commit spent a third of its Python here, issue 32). Only each record's
        protocol field is read."""
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
        self._batch_done(batch, k, k - self.published)

    def _batch_done(self, batch: CommittedBatch, k: int, sent: int) -> None:
        """After a batch, sent whole or not: the numbering and the counters."""
        self.published = k
        self._next_publish = batch.end_offset
        self._m_pub_data.inc(sent)

    def _index_run(self, k_first: int, offset: int, count: int) -> None:
        """Remember offsets ``offset ..`` for messages ``k_first ..`` in the replay ring."""
        index = self._index_np
        size = len(index)
        if count > size:  # only the last ``size`` fit in the ring
            k_first, offset, count = k_first + count - size, offset + count - size, size
        start = k_first % size
        if count == 1:  # one request in flight: an arange costs more than the one store
            index[start] = offset
            return
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

    def subscriber_count(self) -> int:
        """Distinct live SUB prefixes (what libzmq's XPUB passed up as new ones)."""
        return self._pub.prefixes()

    async def heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        topic = self.pub_endpoint.encode()
        while True:
            await asyncio.sleep(interval)
            body = orjson.dumps(
                {
                    "device": self.config.device_number,
                    "hostname": self.hostname.decode(),
                    "next_offset": self.subscription.next_offset,
                }
            )
            self._emit(
                lj.HEARTBEAT_APP_ENV, topic, body, int(time.time() * 1000), -1, lj.Compression.NONE
            )
            self._flush()
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
