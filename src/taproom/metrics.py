"""Prometheus metrics with taproom's naming rule and bounded labels.

Names read ``taproom_<component>_<name>_<unit>_total`` for counters (prometheus-client adds the
``_total``); labels are drawn only from bounded sets: protocol, listener, reason, output, kind, loop. Each
:class:`Metrics` owns its registry so several hubs can live in one test process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics"]

# "loop": a supervised loop's name, fixed in the code (taproom.supervise).
_ALLOWED_LABELS = frozenset(
    {"protocol", "listener", "reason", "output", "segment_state", "kind", "holder", "loop"}
)


class Metrics:
    """Get-or-create access to counters, gauges and histograms on one registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, Any] = {}
        # accepted()'s two counters per protocol, looked up once: it runs once per commit
        # group of every protocol (a label lookup takes a lock and builds a key each time)
        self._accepted: dict[str, tuple[Any, Any]] = {}

    def _get(self, kind: type, name: str, doc: str, labels: Sequence[str], **kw: Any) -> Any:
        bad = set(labels) - _ALLOWED_LABELS
        if bad:
            raise ValueError(f"unbounded label(s) {sorted(bad)} on {name}")
        metric = self._metrics.get(name)
        if metric is None:
            metric = kind(name, doc, labelnames=tuple(labels), registry=self.registry, **kw)
            self._metrics[name] = metric
        return metric

    def collect(self, names: frozenset[str]) -> list[Any]:
        """The metric families of the metrics called ``names`` (as created, without the
        ``_total`` of counters), not the whole registry: the console's per-second sample
        reads a dozen of the hundreds a hub has."""
        families = []
        for name in names:
            metric = self._metrics.get(name)
            if metric is not None:
                families.extend(metric.collect())
        return families

    def counter(
        self, component: str, name: str, unit: str, doc: str, labels: Sequence[str] = ()
    ) -> Counter:
        """``taproom_<component>_<name>_<unit>_total``."""
        return self._get(Counter, f"taproom_{component}_{name}_{unit}", doc, labels)

    def gauge(
        self, component: str, name: str, unit: str, doc: str, labels: Sequence[str] = ()
    ) -> Gauge:
        return self._get(Gauge, f"taproom_{component}_{name}_{unit}", doc, labels)

    def gauge_fn(
        self, component: str, name: str, unit: str, doc: str, fn: Callable[[], float]
    ) -> None:
        """A gauge read at scrape time (queue fill levels, segment counts)."""
        self.gauge(component, name, unit, doc).set_function(fn)

    def histogram(
        self,
        component: str,
        name: str,
        unit: str,
        doc: str,
        buckets: Sequence[float],
        labels: Sequence[str] = (),
    ) -> Histogram:
        return self._get(
            Histogram, f"taproom_{component}_{name}_{unit}", doc, labels, buckets=tuple(buckets)
        )

    def rejected(self, protocol: str, reason: str, count: int = 1) -> None:
        """Count input refused by a protocol: a frame, message, connection or event."""
        self.counter(
            "ingest",
            "rejected",
            "items",
            "Frames, messages or connections refused, by reason",
            ("protocol", "reason"),
        ).labels(protocol=protocol, reason=reason).inc(count)

    def accepted(self, protocol: str, count: int, nbytes: int) -> None:
        """Count events a protocol handed to the journal (acked once committed), and their bytes.

        ``nbytes`` is the size of the encoded journal records, the same measure for every
        protocol (wire bytes differ by framing and compression).
        """
        children = self._accepted.get(protocol)
        if children is None:
            events = self.counter(
                "ingest",
                "accepted",
                "events",
                "Events handed to the journal, by protocol",
                ("protocol",),
            ).labels(protocol=protocol)
            size = self.counter(
                "ingest",
                "accepted",
                "bytes",
                "Bytes of journal records handed to the journal, by protocol",
                ("protocol",),
            ).labels(protocol=protocol)
            children = self._accepted[protocol] = (events, size)
        children[0].inc(count)
        children[1].inc(nbytes)

    def odd(self, protocol: str, reason: str, count: int = 1) -> None:
        """Count events accepted and stored with a caveat (a body that is not JSON, an event
        time the journal cannot hold: taproom.eventtime)."""
        self.counter(
            "ingest",
            "odd",
            "events",
            "Events accepted and stored with a caveat, by reason",
            ("protocol", "reason"),
        ).labels(protocol=protocol, reason=reason).inc(count)

    def connections(self, protocol: str, listener: str) -> Gauge:
        """Open connections of one listener."""
        return self.gauge(
            "ingest",
            "open_connections",
            "count",
            "Open connections by listener",
            ("protocol", "listener"),
        ).labels(protocol=protocol, listener=listener)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
